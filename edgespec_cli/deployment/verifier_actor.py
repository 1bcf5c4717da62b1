"""The verifier role as Ray actors (``edgespec deploy``, ``edgespec simulate``).

``VerifierActor`` runs the same server as ``edgespec verifier`` (the Verifier gRPC service and,
with ``http_port``, the OpenAI-compatible HTTP API) on its node's address, sharing the cache's
Redis. Several replicas may share one cache, each with its own KV slots; ``RouterActor`` is then
the clients' one endpoint and spreads sessions over the replicas (see ``router.py``). Ray
restarts a failed actor by calling ``__init__`` again: it binds the same port, and the sessions
it was running resume from their committed tokens in Redis.
"""

from __future__ import annotations

import os


class VerifierActor:
    def __init__(self, port: int, redis_url: str, model: str = "default",
                 max_sessions: int = 8, threads: int | None = None,
                 http_port: int | None = None, auth_token: str | None = None,
                 max_queue: int = 64, device: str = "cpu", dtype: str = "auto",
                 engine: dict | None = None, cpus: tuple[int, ...] | None = None):
        """``engine``: EngineConfig fields to override (max_draft, draft_wait_ms, ...).
        ``cpus``: confine the verifier to these cores, its torch threads one a core unless
        ``threads`` says otherwise (a simulated fleet's server side)."""
        from edgespec_cli.cli_args import configure_logging, set_threads
        from edgespec.config import EngineConfig
        from edgespec.runner.kernel_caches import bound_kernel_caches
        from edgespec_cli.server import EdgespecServer, ServerOptions

        from .cpu_share import pin_process
        from .cluster import where

        bound_kernel_caches()  # as the commands do, before this worker's first product
        pin_process(cpus)
        configure_logging()
        # a count derived from its cores is a default: lowered where no dtype is exact at it;
        # without cores, set_threads' own rule ($EDGESPEC_THREADS is the user's)
        set_threads(threads if threads is not None or not cpus else len(cpus),
                    by_user=(threads is not None) if cpus else None)
        self.where = where()
        self.node_ip = self.where["node_ip"]
        opts = ServerOptions(listen=f"{self.node_ip}:{port}", roles=("verifier",),
                             model=model, device=device, dtype=dtype, redis_url=redis_url,
                             auth_token=auth_token, max_queue=max_queue, http_port=http_port,
                             http_host=self.node_ip,
                             engine=EngineConfig(**{**(engine or {}),
                                                    "max_sessions": max_sessions}))
        self.server = EdgespecServer(opts).start()

    def info(self) -> dict:
        s = self.server
        return {"role": "verifier", **self.where, "pid": os.getpid(),
                "address": f"{self.node_ip}:{s.port}",
                "http": f"http://{self.node_ip}:{s.http_port}/v1" if s.http_port else None,
                "healthy": s.healthy(), "model": s.model_name,
                "kv_slots": s.engine_cfg.max_sessions}

    def batch_sizes(self) -> dict[int, int]:
        """Verification forwards by sessions in the batch, since the actor started."""
        metrics = self.server.metrics
        assert metrics is not None  # a verifier role's server always keeps metrics
        return dict(metrics.batch_counts)

    def step_totals(self) -> dict:
        """Steps since the actor started and the seconds they spent waiting for drafts, in
        the forward (with verification) and committing; the one-token-a-row steps by rows."""
        metrics = self.server.metrics
        assert metrics is not None  # a verifier role's server always keeps metrics
        plain = dict(metrics.plain_by_rows)  # a copy first: the scheduler's thread adds to it
        return {**metrics.step_totals,
                "plain_by_rows": {str(n): list(v) for n, v in plain.items()}}

    def cpu_seconds(self) -> float | None:
        """CPU seconds of this process so far."""
        from .cpu_share import process_tree_cpu_s

        return process_tree_cpu_s()

    def stop(self, drain_timeout_s: float = 0.0) -> None:
        self.server.stop(drain_timeout_s=drain_timeout_s)


class RouterActor:
    """The clients' endpoint in front of several verifier replicas."""

    def __init__(self, port: int, replicas: list[str], auth_token: str | None = None):
        from edgespec_cli.cli_args import configure_logging
        from verifier_node.router import VerifierRouter

        from .cluster import where

        configure_logging()
        self.where = where()
        self.node_ip = self.where["node_ip"]
        self.router = VerifierRouter(f"{self.node_ip}:{port}", replicas, auth_token).start()

    def info(self) -> dict:
        return {"role": "router", **self.where,
                "address": f"{self.node_ip}:{self.router.port}",
                "replicas": self.router.replicas, "healthy": self.router.healthy()}

    def stop(self) -> None:
        self.router.stop()
