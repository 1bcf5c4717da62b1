"""Starting the server roles: the verifier, the draft cache, or both on one address.

``edgespec serve`` runs both (and an embedded Redis unless ``--redis-url`` names one), so clients
and drafters need one address. ``edgespec verifier`` and ``edgespec cache`` run one role each,
sharing state through the same Redis. Every server also serves ``grpc.health.v1``; SIGTERM or
Ctrl-C marks the services NOT_SERVING, lets in-flight calls finish for a grace period, and stops.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .config import EngineConfig
from .v1 import edgespec_pb2_grpc as pb_grpc
from .wire import bind, make_server, resolve_token

log = logging.getLogger("edgespec.server")

VERIFIER_SERVICE = "edgespec.v1.Verifier"
CACHE_SERVICE = "edgespec.v1.DraftCache"


@dataclass
class ServerOptions:
    listen: str = "127.0.0.1:50051"
    roles: tuple[str, ...] = ("verifier", "cache")
    model: str = "default"
    device: str = "cpu"
    dtype: str = "float32"
    redis_url: str | None = None
    auth_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_workers: int = 64
    max_queue: int = 64
    session_ttl_s: int = 600
    default_max_new_tokens: int = 128
    engine: EngineConfig = None


class EdgespecServer:
    def __init__(self, opts: ServerOptions):
        from cache_service.redis_conn import RedisHandle
        from cache_service.store import RedisSessionStore

        self.opts = opts
        self.engine_cfg = opts.engine or EngineConfig()
        self.redis = RedisHandle(opts.redis_url)
        self.store = RedisSessionStore(self.redis.client, ttl_s=opts.session_ttl_s)
        self.server = make_server(opts.max_workers, resolve_token(opts.auth_token))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.scheduler = None
        self.cache = None
        self._services = [""]
        try:
            if "verifier" in opts.roles:
                self._add_verifier()
            if "cache" in opts.roles:
                self._add_cache()
            self.port = bind(self.server, opts.listen, opts.tls_cert, opts.tls_key)
        except BaseException:
            self.redis.close()
            raise

    def _add_verifier(self) -> None:
        from verifier_node.scheduler import Scheduler
        from verifier_node.service import VerifierService

        from .engine import SpecEngine
        from .models import load_model, stop_token_ids, tokenizer_fingerprint
        from .runner import TargetRunner

        cfg = self.engine_cfg
        target = load_model(self.opts.model, self.opts.device, self.opts.dtype)
        runner = TargetRunner(target.model, n_slots=cfg.max_sessions, max_len=cfg.max_context)
        engine = SpecEngine(runner, None, cfg, stop_token_ids(target), store=self.store)
        self.store.set_target({"model": target.name,
                               "fingerprint": tokenizer_fingerprint(target.tokenizer),
                               "vocab_size": runner.vocab_size, "window": cfg.window,
                               "chunk": cfg.chunk})
        self.scheduler = Scheduler(engine, max_queue=self.opts.max_queue)
        service = VerifierService(self.scheduler, self.store, target.tokenizer,
                                  runner.vocab_size, self.opts.default_max_new_tokens)
        pb_grpc.add_VerifierServicer_to_server(service, self.server)
        self._services.append(VERIFIER_SERVICE)

    def _add_cache(self) -> None:
        from cache_service.service import DraftCacheService

        self.cache = DraftCacheService(self.store, self.engine_cfg.window, self.engine_cfg.chunk)
        pb_grpc.add_DraftCacheServicer_to_server(self.cache, self.server)
        self._services.append(CACHE_SERVICE)

    def start(self) -> "EdgespecServer":
        if self.scheduler:
            self.scheduler.start()
        self.server.start()
        for name in self._services:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on port %d (redis: %s)", ", ".join(self.opts.roles), self.port,
                 "embedded" if self.redis.embedded else self.redis.url)
        return self

    def stop(self, grace: float = 5.0) -> None:
        for name in self._services:
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.cache:
            self.cache.stop()
        done = self.server.stop(grace)
        if self.scheduler:
            self.scheduler.stop()
        done.wait(grace + 1)
        self.redis.close()

    def wait(self) -> None:
        """Block until SIGINT/SIGTERM, then stop gracefully."""
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        log.info("shutting down")
        self.stop()
