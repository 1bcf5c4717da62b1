"""Starting the server roles: the verifier, the draft cache, or both on one address.

``edgespec serve`` runs both (and an embedded Redis unless ``--redis-url`` names one), so clients
and drafters need one address. ``edgespec verifier`` and ``edgespec cache`` run one role each,
sharing state through the same Redis. Every server also serves ``grpc.health.v1``, and it tells
the truth: a monitor thread marks the services NOT_SERVING while the scheduler is dead or Redis
is unreachable or refuses writes (full, read-only), and SERVING again when they recover.

Threads: the sync gRPC server holds one worker thread per open stream. The worker pool is sized
for every stream the verifier admits (KV slots + admission queue) and every drafter the cache
attaches, plus a reserve, and streams beyond those limits are refused at once with
RESOURCE_EXHAUSTED, so health checks and Cancel always find a free thread.

SIGTERM or Ctrl-C drains: the services turn NOT_SERVING, new sessions are refused with
UNAVAILABLE (the SDK resumes them elsewhere or after a restart), running sessions get up to
``drain_timeout_s`` to finish, then what is left fails with UNAVAILABLE (resumable) and the
process exits 0.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpc_health.v1 import health, health_pb2_grpc
from prometheus_client import CollectorRegistry

from edgespec.config import ConfigError, EngineConfig
from edgespec.wire.request_parsing import add_servicer
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire.convert import resolve_token
from edgespec.wire.channels import bind, make_server
from edgespec_cli.server_health import STOPPING, ServerHealth

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    import uvicorn

    from cache_service.redis_conn import ExposedRedis
    from cache_service.service import DraftCacheService
    from verifier_node.metrics import VerifierMetrics
    from verifier_node.scheduler import Scheduler
    from verifier_node.service import VerifierService

log = logging.getLogger("edgespec.server")

VERIFIER_SERVICE = "edgespec.v1.Verifier"
CACHE_SERVICE = "edgespec.v1.DraftCache"


RESERVE_THREADS = 16  # for health checks, Cancel and unary pushes when every stream is busy


@dataclass
class ServerOptions:
    listen: str = "127.0.0.1:50051"
    roles: tuple[str, ...] = ("verifier", "cache")
    model: str = "default"
    device: str = "cpu"
    dtype: str = "auto"
    redis_url: str | None = None
    auth_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # require client certificates signed by this CA (mTLS)
    device_tokens: str | None = None  # file of per-device drafter tokens ("device_id: token")
    max_queue: int = 64
    max_drafters: int = 64  # Attach streams the cache holds at once
    session_ttl_s: int = 600
    fleet_leaders: int = 1 << 17  # the fleet-wide Cacheback table's bound; 0: no table
    default_max_new_tokens: int = 128
    drain_timeout_s: float = 30.0
    handover_after_s: float = 30.0  # a board gone this long: its sessions to another (0: never)
    http_port: int | None = None  # the OpenAI-compatible API and /metrics (verifier roles)
    http_host: str = "127.0.0.1"
    http_max_request_bytes: int | None = None  # None: fits the longest prompt (body_limit)
    http_body_timeout_s: float = 60.0  # a body arrives whole this long after its headers (0: ever)
    metrics_port: int | None = None  # a bare Prometheus /metrics endpoint
    metrics_host: str = "127.0.0.1"
    engine: EngineConfig | None = None
    expose_redis: "ExposedRedis | None" = None  # the embedded Redis on TCP too (the fleet's cache)

    def max_streams(self) -> int:
        """Generate streams the verifier admits: one per KV slot and queue place."""
        return (self.engine or EngineConfig()).max_sessions + self.max_queue


class EdgespecServer(ServerHealth):
    def __init__(self, opts: ServerOptions):
        from cache_service.redis_conn import RedisHandle
        from cache_service.store import RedisSessionStore

        self.opts = opts
        self.engine_cfg = opts.engine or EngineConfig()
        workers = RESERVE_THREADS
        if "verifier" in opts.roles:  # its streams, and a resumed one a session beside them
            workers += 2 * opts.max_streams()
        if "cache" in opts.roles:
            workers += opts.max_drafters
        self.credentials = None
        if opts.device_tokens and "cache" in opts.roles:
            from cache_service.credentials import DeviceCredentials

            self.credentials = DeviceCredentials.load(opts.device_tokens)
        elif "cache" in opts.roles and resolve_token(opts.auth_token):
            log.warning("drafters attach with the clients' token (no --device-tokens): a board "
                        "can call what a client can for the sessions it drafts for (cancel "
                        "them, read their output); give boards you do not trust their own "
                        "tokens with --device-tokens")
        self.server = make_server(workers, resolve_token(opts.auth_token),
                                  _stream_limits(opts), self.credentials)
        self.redis = RedisHandle(opts.redis_url, expose=opts.expose_redis)
        self.store = RedisSessionStore(self.redis.client, ttl_s=opts.session_ttl_s,
                                       fleet_leaders=opts.fleet_leaders)
        self.registry = CollectorRegistry()
        self.metrics: VerifierMetrics | None = None
        self.http: uvicorn.Server | None = None
        self.http_port: int | None = None
        self._metrics_server: WSGIServer | None = None
        self.health = health.HealthServicer()
        add_servicer(health_pb2_grpc.add_HealthServicer_to_server, self.health, self.server)
        self.scheduler: Scheduler | None = None
        self.cache: DraftCacheService | None = None
        self.verifier_service: VerifierService | None = None
        self._services = [""]
        self._stopping = threading.Event()
        self._redis_closing = threading.Event()  # the monitor's end: Redis is closed next
        self._monitor_thread = threading.Thread(target=self._monitor, daemon=True,
                                                name="health-monitor")
        self._abort_drain = threading.Event()  # a third signal: stop waiting for sessions
        self._stop_signalled = threading.Event()  # the first signal: drain, then stop
        self._signals_caught = False
        self._drain_until = 0.0
        self._serving: bool | None = None
        self.why_not_serving: str | None = "not started"  # what health last said, in words
        self._redis_ok = True  # the last health probe's answer from Redis
        self._writes_refused: str | None = None  # the last write probe's error (None: took it)
        self._write_probed = -float("inf")  # monotonic time of the last write probe
        try:
            # listen first: a taken or malformed address fails before a model loads
            self.port = bind(self.server, opts.listen, opts.tls_cert, opts.tls_key,
                             client_ca=opts.tls_client_ca)
            if opts.metrics_port is not None:  # a busy port fails before a model loads too
                self._start_metrics(opts.metrics_port, opts.metrics_host)
            if opts.http_port is not None and "verifier" in opts.roles:
                self._start_http(opts.http_port)  # /health answers 503 while the model loads
            if "verifier" in opts.roles:
                self._add_verifier()
            if "cache" in opts.roles:
                self._add_cache()
        except BaseException:
            if self.http is not None:
                self.http.should_exit = True
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
            self.redis.close()
            raise

    def _start_metrics(self, port: int, host: str) -> None:
        """/metrics served from the start (what is registered so far: a scrape while the model
        loads finds the process's own series)."""
        from prometheus_client import start_http_server

        try:
            self._metrics_server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:  # taken, or an address this machine does not have
            raise ConfigError(f"cannot serve metrics on {host}:{port} (--metrics-port, "
                              f"--metrics-host): {e}") from None

    def _add_verifier(self) -> None:
        from verifier_node.admission import Admission
        from verifier_node.scheduler import Scheduler
        from verifier_node.service import VerifierService

        from edgespec.engine.spec_engine import SpecEngine
        from edgespec.models.loading import load_model, stop_token_ids, tokenizer_fingerprint
        from edgespec.runner.kernel_caches import kernel_caches_in_effect
        from edgespec.runner.target_runner import TargetRunner

        cfg = self.engine_cfg
        target = load_model(self.opts.model, self.opts.device, self.opts.dtype)
        if not self.opts.device.startswith("cuda"):
            log.info("%s", kernel_caches_in_effect().describe())
        runner = TargetRunner(target.model, n_slots=cfg.max_sessions, max_len=cfg.max_context,
                              graphs=cfg.cuda_graphs)
        engine = SpecEngine(runner, None, cfg, stop_token_ids(target), store=self.store,
                            vision=target.vision)
        self.target_info = {"model": target.name,
                            "fingerprint": tokenizer_fingerprint(target.tokenizer),
                            "vocab_size": runner.vocab_size, "window": cfg.window,
                            "chunk": cfg.chunk}
        self.store.set_target(self.target_info)
        from verifier_node.metrics import VerifierMetrics

        self.model_name = target.name
        self.metrics = VerifierMetrics(self.registry)
        self.scheduler = Scheduler(engine, max_queue=self.opts.max_queue, metrics=self.metrics,
                                   handover_after_s=self.opts.handover_after_s)
        self.metrics.bind_load(self.scheduler.load, lambda: runner.cache.free_slots,
                               self.scheduler.prefilling)
        self.metrics.bind_links(engine.lateness.snapshot)
        self.metrics.bind_graphs(lambda: runner.graphs.state() if runner.graphs else None)
        self.metrics.bind_model(target.dtype, runner.kernel_set)
        if self.scheduler.engine.head is not None:
            self.metrics.bind_head(self.scheduler.engine.head)
        self.admission = Admission(self.scheduler, self.store, target.tokenizer,
                                   runner.vocab_size, self.opts.default_max_new_tokens)
        service = self.verifier_service = VerifierService(self.admission, model_name=target.name)
        service.serving = lambda: self._serving is True  # what health says
        service.why_not_serving = lambda: None if self._serving else self.why_not_serving
        service.cache_reachable = lambda: self._redis_ok
        add_servicer(pb_grpc.add_VerifierServicer_to_server, service, self.server)
        self._services.append(VERIFIER_SERVICE)

    def _add_cache(self) -> None:
        from cache_service.service import DraftCacheService

        kwargs: dict[str, Any] = {}
        try:
            from cache_service.metrics import CacheMetrics

            kwargs["metrics"] = CacheMetrics(self.registry)
        except ImportError:
            pass
        self.cache = DraftCacheService(self.store, self.engine_cfg.window, self.engine_cfg.chunk,
                                       credentials=self.credentials, **kwargs)
        add_servicer(pb_grpc.add_DraftCacheServicer_to_server, self.cache, self.server)
        self._services.append(CACHE_SERVICE)

    def _start_http(self, port: int) -> None:
        import uvicorn

        from edgespec.wire.reachability import port_in_use, why_not_listening
        from verifier_node.body_limit import default_max_request_bytes
        from verifier_node.http_api import ServingState, make_app

        self.http_state = ServingState(self.registry, lambda: self._serving is True)
        limit = (self.opts.http_max_request_bytes
                 or default_max_request_bytes(self.engine_cfg.max_context))
        app = make_app(self.http_state, resolve_token(self.opts.auth_token), limit,
                       self.opts.http_body_timeout_s)
        tls: dict[str, Any] = ({"ssl_certfile": self.opts.tls_cert,
                                "ssl_keyfile": self.opts.tls_key}
                               if self.opts.tls_cert else {})  # HTTPS with the gRPC certificate
        if self.opts.tls_client_ca:  # and clients' certificates required, as gRPC requires them
            import ssl

            tls.update(ssl_ca_certs=self.opts.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        where = f"cannot serve HTTP on {self.opts.http_host}:{port}"
        if port and port == self.port:  # (each said before uvicorn logs a line of its own)
            raise ConfigError(f"{where}: the server's gRPC port (--listen) is {port}: give "
                              "--http-port another")
        if port and port_in_use(self.opts.http_host, port):
            raise ConfigError(where + why_not_listening(self.opts.http_host, port,
                                                        "--http-port", "--http-host"))
        self.http = http = uvicorn.Server(uvicorn.Config(
            app, host=self.opts.http_host, port=port, log_level="warning",
            lifespan="off", timeout_graceful_shutdown=5, **tls))
        thread = threading.Thread(target=http.run, daemon=True, name="http")
        thread.start()
        while not http.started:
            if not thread.is_alive():
                raise ConfigError(where + why_not_listening(self.opts.http_host, port,
                                                            "--http-port", "--http-host"))
            time.sleep(0.02)
        self.http_port = http.servers[0].sockets[0].getsockname()[1]
        self._http_thread = thread

    def start(self) -> "EdgespecServer":
        from cache_service.redis_conn import shown_url
        from edgespec.runner.process_heap import freeze_startup_heap

        frozen = freeze_startup_heap()  # the model and libraries: out of the collector's passes
        log.info("%d objects alive at start frozen out of the garbage collector's passes", frozen)
        if self.scheduler:
            self.scheduler.start()
        self.server.start()
        # health's verdict first, then the HTTP API's: /health and /v1/models turn ready at once
        # (a stop signalled during start drains at once: health never says SERVING then)
        self._set_health(self.healthy() and not self._stop_signalled.is_set())
        if self.http is not None:
            self.http_state.model_name = self.model_name
            self.http_state.admission = self.admission
        self._monitor_thread.start()
        log.info("serving %s on port %d (redis: %s)", ", ".join(self.opts.roles), self.port,
                 "embedded" if self.redis.embedded else shown_url(self.redis.url))
        return self

    def stop(self, drain_timeout_s: float | None = None) -> None:
        """Drain, then stop: see the module docstring."""
        timeout = self.opts.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        self._drain_until = time.monotonic() + timeout
        self._stopping.set()
        self.why_not_serving = STOPPING  # health says why, to a status read during the drain
        self._set_health(False)
        if self.scheduler:
            t0 = time.monotonic()
            if not self.scheduler.drain(timeout, self._abort_drain):
                why = "a third signal ended it" if self._abort_drain.is_set() else "it timed out"
                log.warning("drain ended after %.1fs (%s); failing the sessions left",
                            time.monotonic() - t0, why)
            self.scheduler.stop()
            self.scheduler.engine.close()  # its drafter thread and head learner, if any
        if self.cache:
            self.cache.stop()
        if self.http is not None:
            self.http.should_exit = True
            self._http_thread.join(10)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self.server.stop(grace=2.0).wait(5)
        self._redis_closing.set()
        if self._monitor_thread.is_alive():
            self._monitor_thread.join(10)
        self.store.shutdown()
        self.redis.close()
        from edgespec.runner.process_heap import thaw_heap

        thaw_heap()  # what start froze: collectable again once the server is gone

    def catch_stop_signals(self) -> None:
        """From now on SIGINT/SIGTERM drain (see ``wait``). Called before ``start`` by the
        commands: health says SERVING from within ``start``, and a supervisor may stop the
        process as soon as it sees that; a signal before ``wait`` then still drains, where
        Python's defaults would end the process mid-start (SIGTERM: exit -15; SIGINT: a
        KeyboardInterrupt), nothing drained."""
        signals = 0

        def on_signal(*_) -> None:
            nonlocal signals
            signals += 1
            if signals == 1:
                self._stop_signalled.set()
            elif signals == 2:
                left = self.scheduler.sessions_left() if self.scheduler else 0
                log.warning("still draining: %d session(s) left, up to %.0fs more; signal again "
                            "to stop now (they fail)", left,
                            max(0.0, self._drain_until - time.monotonic()))
            else:
                log.warning("stopping now: ending the drain")
                self._abort_drain.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        self._signals_caught = True

    def wait(self) -> None:
        """Block until SIGINT/SIGTERM, then drain and stop. A second signal says what the drain
        has left; a third ends it (the sessions left fail, resumable elsewhere)."""
        if not self._signals_caught:
            self.catch_stop_signals()
        # woken every second: a signal's Python handler runs in this thread only when it runs
        # bytecode, and a wait with no timeout may sleep through a signal another thread took
        # (a SIGINT once went unanswered so in the suite; the next one drained)
        while not self._stop_signalled.wait(timeout=1.0):
            pass
        log.info("shutting down: draining for up to %.0fs (signal twice more to stop at once)",
                 self.opts.drain_timeout_s)
        self.stop()
        log.info("stopped")


def _stream_limits(opts: ServerOptions) -> dict[str, int]:
    limits = {}  # Generate streams are capped by the service itself (resumes exempt)
    if "cache" in opts.roles:
        limits[f"/{CACHE_SERVICE}/Attach"] = opts.max_drafters
    return limits
