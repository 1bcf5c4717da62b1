"""The composed server in process for the tests that drive it (real gRPC on loopback, embedded
Redis, the tiny model): the ``server`` fixture, health's states, and a wait for one."""

from __future__ import annotations

import pytest
from grpc_health.v1 import health_pb2

from edgespec.config import EngineConfig
from edgespec_cli.server import EdgespecServer, ServerOptions
from procs import wait_health

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture()
def server(tiny_dir):
    srv = EdgespecServer(ServerOptions(
        listen="127.0.0.1:0", model=str(tiny_dir), max_drafters=1, drain_timeout_s=5,
        engine=EngineConfig(max_sessions=2, max_context=256))).start()
    yield srv
    srv.stop(drain_timeout_s=0)


def _wait_status(port: int, want: int) -> None:
    wait_health(f"127.0.0.1:{port}", want, timeout=30, service="edgespec.v1.Verifier")
