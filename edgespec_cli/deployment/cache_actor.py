"""The draft cache as a Ray actor on the head node (``edgespec deploy``, ``edgespec simulate``).

The actor runs the same server as ``edgespec cache``: the DraftCache gRPC service on the node's
address, drafters attach to it. Its Redis is the embedded one, served on TCP as well (bound to
the node's address, with a password) so that verifier replicas on other nodes share it; or an
external Redis by URL. The embedded Redis keeps its append-only file in ``data_dir``, so a cache
actor that Ray restarts comes back with its sessions.
"""

from __future__ import annotations

import shutil


class CacheActor:
    def __init__(self, port: int, data_dir: str, redis_password: str,
                 redis_url: str | None = None, auth_token: str | None = None,
                 max_drafters: int = 256, cpus: tuple[int, ...] | None = None):
        """``cpus``: confine the cache and its embedded Redis to these cores (a simulated
        fleet's server side)."""
        from cache_service.redis_conn import ExposedRedis
        from edgespec_cli.cli_args import configure_logging
        from edgespec_cli.server import EdgespecServer, ServerOptions

        from .cpu_share import pin_process
        from .cluster import where

        pin_process(cpus)  # first: Redis and every thread started below inherit it
        configure_logging()
        self.where = where()
        self.data_dir = data_dir
        self.node_ip = self.where["node_ip"]
        expose = None if redis_url else ExposedRedis(self.node_ip, 0, redis_password, data_dir)
        opts = ServerOptions(listen=f"{self.node_ip}:{port}", roles=("cache",),
                             redis_url=redis_url, auth_token=auth_token,
                             max_drafters=max_drafters, expose_redis=expose)
        self.server = EdgespecServer(opts).start()
        self.redis_url = redis_url or self.server.redis.tcp_url

    def info(self) -> dict:
        return {"role": "cache", **self.where,
                "address": f"{self.node_ip}:{self.server.port}", "redis_url": self.redis_url,
                "healthy": self.server.healthy()}

    def cpu_seconds(self) -> float | None:
        """CPU seconds of this process and its children (the embedded Redis) so far."""
        from .cpu_share import process_tree_cpu_s

        return process_tree_cpu_s()

    def stop(self) -> None:
        """Stop for good (``edgespec deploy --down``): the persisted sessions go too."""
        self.server.stop(drain_timeout_s=0)
        shutil.rmtree(self.data_dir, ignore_errors=True)
