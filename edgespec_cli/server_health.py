"""The server's health, told truthfully: ``grpc.health.v1`` SERVING while the scheduler runs
and Redis answers and takes writes, NOT_SERVING with a reason in words otherwise, and a monitor
thread that checks twice a second and restarts an embedded Redis that died (on its socket and
append-only file: its sessions come back). ``ServerHealth`` is a base class of
``EdgespecServer``, which sets up what it reads (the Redis handle and store, the scheduler, the
health servicer and the services' names).

From SIGTERM on, health stays NOT_SERVING (``STOPPING``) and the monitor only keeps the embedded
Redis running until the server closes it: a signal sent to every process of a service (systemd's
default stop) reaches the embedded redis-server too, and the drain needs it to commit.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from grpc_health.v1 import health, health_pb2

if TYPE_CHECKING:
    from cache_service.redis_conn import RedisHandle
    from cache_service.store import RedisSessionStore
    from verifier_node.scheduler import Scheduler

log = logging.getLogger("edgespec.server")

# health writes a key to Redis this often (every tick while it refuses them): a Redis that answers
# pings may refuse writes; a write a tick would cost an idle Redis an AOF fsync a second
WRITE_PROBE_S = 5.0
STOPPING = "draining: the server is stopping"  # health's reason from SIGTERM on


class ServerHealth:
    """Health's verdict (``healthy``), its publication (``_set_health``) and the monitor
    thread (``_monitor``)."""

    redis: RedisHandle
    store: RedisSessionStore
    scheduler: Scheduler | None
    health: health.HealthServicer
    target_info: dict[str, Any]
    _services: list[str]
    _stopping: threading.Event  # set by SIGTERM's stop: the drain has begun
    _redis_closing: threading.Event  # set when the drain is over: the monitor ends
    _serving: bool | None
    why_not_serving: str | None
    _redis_ok: bool
    _writes_refused: str | None
    _write_probed: float

    def healthy(self) -> bool:
        """Whether to serve; ``why_not_serving`` says why not, in words."""
        self.why_not_serving = self._why_not()
        return self.why_not_serving is None

    def _why_not(self) -> str | None:
        if self._stopping.is_set():
            return STOPPING
        self._redis_ok = self.redis.reachable()
        if self.scheduler is not None and self.scheduler.unhealthy_reason is not None:
            return self.scheduler.unhealthy_reason
        if not self._redis_ok:
            return f"its Redis does not answer ({self.redis.last_error})"
        now = time.monotonic()
        if now - self._write_probed >= WRITE_PROBE_S or self._writes_refused is not None:
            self._write_probed = now
            took = self.redis.writable(self.store.keys.health)
            self._writes_refused = None if took else self.redis.last_error
        if self._writes_refused is not None:
            return f"its Redis refuses writes ({self._writes_refused})"
        return None

    def _set_health(self, serving: bool) -> None:
        if serving == self._serving:
            return
        self._serving = serving
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self._services:
            self.health.set(name, status)
        log.info("health: %s", "SERVING" if serving else
                 f"NOT_SERVING ({self.why_not_serving or 'no reason given'})")

    def _monitor(self) -> None:
        self._watch_health()
        # draining: a dead embedded Redis is still restarted (a signal to every process of the
        # service, systemd's default stop, reaches it too), so that the drain can commit
        while not self._redis_closing.wait(0.5):
            self._keep_redis_running()

    def _keep_redis_running(self) -> None:
        """Restart the embedded Redis if it died; a failed restart is tried at the next tick."""
        try:
            self.redis.ensure_running()
        except Exception as e:
            log.error("restarting the embedded Redis failed: %s", e)

    def _watch_health(self) -> None:
        while not self._stopping.wait(0.5):
            if self.redis.exited:  # not serving while it restarts (up to 3 x 30 s)
                self.why_not_serving = "its embedded Redis exited: restarting it"
                self._set_health(False)
            self._keep_redis_running()
            healthy = self.healthy()
            if healthy and self.scheduler is not None:
                try:  # a Redis that restarted without persistence forgot the target
                    self.store.ensure_target(self.target_info)
                except Exception as e:
                    healthy = False
                    self.why_not_serving = f"cannot register the target in Redis ({e})"
            self._set_health(healthy)
