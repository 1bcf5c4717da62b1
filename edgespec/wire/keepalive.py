"""Liveness on every gRPC connection: HTTP/2 keepalive pings, sent by both ends, answered or the
connection is closed.

An edge link rarely fails cleanly: a partition forwards nothing while both sockets stay open, a
NAT box or middlebox forgets the connection and the board's socket waits on it forever. Without
pings neither end notices (seen here: a drafter waited on an abandoned connection for 9 minutes;
a client's calls hung to their 120 s deadline). With them, a connection that has not answered a
ping within ``timeout`` of sending it, ``interval`` after the last activity, is closed: a drafter's
Attach stream then fails (UNAVAILABLE) and it attaches again on a new connection; the SDK resumes
its stream; the cache sees the stream end and marks the board detached, so its sessions decode
without it until it is back.

Above the transport, a drafter's Attach stream carries an application ``Heartbeat`` both ways
every ``EDGESPEC_HEARTBEAT_S`` (2 s): each end announces its interval when the stream opens, and
the other ends the stream (the cache: UNAVAILABLE, saying why, and marks the board detached, last
seen when last heard; the board: attaches again) after ``SILENT_HEARTBEATS`` intervals without
hearing anything. This catches what keepalive cannot: a proxy between the two that answers pings
itself while the far side is gone.

Defaults suit a flaky edge link: a ping every 10 s of silence, 5 s to answer, so a silent link is
noticed within about 15 s, at the cost of one 17-byte frame each way every 10 s (nothing while
data flows). ``EDGESPEC_KEEPALIVE_S`` and ``EDGESPEC_KEEPALIVE_TIMEOUT_S`` change both ends (a
server permits pings as often as half its own interval, and never punishes a client for pinging:
edge clients of other versions may ping more often); the SDK's ``channel_options`` override a
client's.
"""

from __future__ import annotations

import os
from typing import Any

from ..config import ConfigError

INTERVAL_ENV, TIMEOUT_ENV = "EDGESPEC_KEEPALIVE_S", "EDGESPEC_KEEPALIVE_TIMEOUT_S"
DEFAULT_INTERVAL_S, DEFAULT_TIMEOUT_S = 10.0, 5.0
HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S = "EDGESPEC_HEARTBEAT_S", 2.0
SILENT_HEARTBEATS = 3  # a peer heard nothing from for this many of its intervals is gone


def _seconds(env: str, default: float) -> float:
    raw = os.environ.get(env, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{env} must be a number of seconds, got {raw[:20]!r}") from None
    if not 0.1 <= value <= 3600:
        raise ConfigError(f"{env} must be within 0.1..3600 seconds, got {value}")
    return value


def keepalive_interval_s() -> float:
    return _seconds(INTERVAL_ENV, DEFAULT_INTERVAL_S)


def keepalive_timeout_s() -> float:
    return _seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def heartbeat_interval_s() -> float:
    """How often each end of an Attach stream says it is there (``Heartbeat``)."""
    return _seconds(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S)


def client_keepalive_options() -> list[tuple[str, Any]]:
    """A channel's arguments: ping after ``interval`` of silence, with or without calls, and
    close the connection when a ping is not answered within ``timeout``. gRPC 1.85 enforces a
    keepalive ping's answer by ``grpc.http2.ping_timeout_ms`` (default a minute), not by
    ``grpc.keepalive_timeout_ms`` alone: both are set (seen here: with the latter only, a ping
    into an abandoned connection was waited on for the whole minute)."""
    return [("grpc.keepalive_time_ms", int(keepalive_interval_s() * 1000)),
            ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s() * 1000)),
            ("grpc.http2.ping_timeout_ms", int(keepalive_timeout_s() * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]  # 0: as many as needed


def server_keepalive_options() -> list[tuple[str, Any]]:
    """A server's arguments: the same pings towards its clients, and permission for theirs."""
    interval_ms = int(keepalive_interval_s() * 1000)
    return [("grpc.keepalive_time_ms", interval_ms),
            ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s() * 1000)),
            ("grpc.http2.ping_timeout_ms", int(keepalive_timeout_s() * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", max(100, interval_ms // 2)),
            ("grpc.http2.max_ping_strikes", 0)]  # 0: a client that pings often is not cut off
