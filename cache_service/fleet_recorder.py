"""Teaching the fleet-wide Cacheback table every closed session's output, off the verifier's
loop: a bounded queue and a thread of its own (recording a 512-token session costs ~28 ms of
Lua), started on the first session it is given."""

from __future__ import annotations

import logging
import queue
import threading

import redis

from edgespec.protocol.fleet_table import record_output

from .codec import KeyLayout, unpack_tokens
from .fleet_table import RedisFleetTable

log = logging.getLogger("edgespec.cache")


class FleetRecorder:
    """Records closed sessions (by id, read back from Redis) into ``table``."""

    def __init__(self, client: redis.Redis, keys: KeyLayout, table: RedisFleetTable):
        self.redis, self.keys, self.table = client, keys, table
        self._queue: queue.Queue[str | None] = queue.Queue(maxsize=1024)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def record(self, sid: str) -> None:
        """Queue a closed session; never blocks (a full queue drops it, logged)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._record_forever,
                                                name="fleet-record", daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait(sid)
        except queue.Full:
            log.warning("the fleet table is behind; session %s not recorded in it", sid)

    def wait_idle(self) -> None:
        """Wait until every session queued so far is recorded (or given up on, logged)."""
        self._queue.join()

    def stop(self) -> None:
        """Record what is queued, then stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=10)

    def _record_forever(self) -> None:
        while True:
            sid = self._queue.get()
            if sid is None:
                self._queue.task_done()
                return
            try:
                self._record(sid)
            except Exception:  # never lose the thread: the next session is recorded again
                log.exception("recording session %s in the fleet table failed", sid)
            finally:
                self._queue.task_done()

    def _record(self, sid: str) -> None:
        """Teach the table a session's committed output (its prompt's tail as leaders)."""
        h, tok = self.keys.session(sid)[:2]
        try:
            prompt_len, blob = self.redis.hget(h, "prompt_len"), self.redis.get(tok)
        except redis.RedisError as e:
            log.warning("session %s not recorded in the fleet table: %s", sid, e)
            return
        if prompt_len is None or blob is None:
            return
        record_output(self.table, unpack_tokens(blob), int(prompt_len))
