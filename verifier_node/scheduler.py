"""The verifier's scheduler: one thread that owns the target runner and runs the engine's steps.

Requests arrive from gRPC handler threads through ``submit`` and wait in a bounded admission
queue; the scheduler admits them while KV slots are free (prefill, session created in the draft
cache with its drafter), then repeats one verification step over every active session: wait for
drafts up to a short deadline, verify all in one forward pass, commit in the cache (fixes go to
the drafters), hand committed tokens to the handlers. A full admission queue is backpressure:
``submit`` raises ``Overloaded`` instead of queueing without bound.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from dataclasses import dataclass, field

from edgespec.config import ConfigError
from edgespec.engine import Request, SpecEngine

log = logging.getLogger("edgespec.verifier")


class Overloaded(Exception):
    pass


@dataclass
class Ticket:
    """A handler's view of one generation: events arrive on ``events``."""

    request: Request
    device: str | None
    reserved: bool = False  # the device was picked (reserved) by the store for this ticket
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    events: queue.Queue = field(default_factory=queue.Queue)
    # events: ("tokens", [ids]) ... then ("done", Result) or ("error", exception)


class Scheduler(threading.Thread):
    def __init__(self, engine: SpecEngine, max_queue: int = 64):
        super().__init__(daemon=True, name="verifier-scheduler")
        self.engine = engine
        self.pending: queue.Queue[Ticket] = queue.Queue(maxsize=max_queue)
        self.cancels: queue.Queue[str] = queue.Queue()
        self.tickets: dict[str, Ticket] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()

    # -- called from handler threads ------------------------------------------------------------
    def submit(self, ticket: Ticket) -> Ticket:
        self.engine.validate(ticket.request)  # ConfigError before any queueing
        try:
            self.pending.put_nowait(ticket)
        except queue.Full:
            raise Overloaded(f"{self.pending.maxsize} requests are already waiting") from None
        self._wake.set()
        return ticket

    def cancel(self, session_id: str) -> None:
        self.cancels.put(session_id)
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.join(timeout=10)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self._apply_cancels()
                self._admit()
                if self.engine.active:
                    self.engine.step()
                else:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
            except Exception as exc:  # keep serving the others; fail the sessions in flight
                log.exception("verification step failed")
                for act in list(self.engine.active):
                    self._fail(act.sid, exc)
        for act in list(self.engine.active):
            self._fail(act.sid, RuntimeError("the verifier is shutting down"))
        while not self.pending.empty():
            t = self.pending.get_nowait()
            t.events.put(("error", RuntimeError("the verifier is shutting down")))

    def _admit(self) -> None:
        while self.engine.target.cache.free_slots and not self.pending.empty():
            t = self.pending.get_nowait()
            t.request.on_tokens = lambda new, t=t: t.events.put(("tokens", new))
            try:
                act = self.engine.add(t.request, session_id=t.session_id, device=t.device)
            except ConfigError as exc:
                t.events.put(("error", exc))
                continue
            finally:
                if t.reserved:
                    self.engine.store.release_pick(t.device)
            act.on_finish = lambda res, t=t: self._finished(t, res)
            self.tickets[t.session_id] = t

    def _finished(self, t: Ticket, result) -> None:
        self.tickets.pop(t.session_id, None)
        t.events.put(("done", result))

    def _apply_cancels(self) -> None:
        while not self.cancels.empty():
            sid = self.cancels.get_nowait()
            if not self.engine.cancel(sid):
                # still waiting for admission: drop it there
                kept = []
                while not self.pending.empty():
                    t = self.pending.get_nowait()
                    if t.session_id == sid:
                        if t.reserved:
                            self.engine.store.release_pick(t.device)
                        t.events.put(("error", ConfigError("cancelled before it started")))
                    else:
                        kept.append(t)
                for t in kept:
                    self.pending.put_nowait(t)

    def _fail(self, sid: str, exc: Exception) -> None:
        t = self.tickets.pop(sid, None)
        for act in list(self.engine.active):
            if act.sid == sid:
                act.on_finish = None
                self.engine.cancel(sid)
        if t is not None:
            t.events.put(("error", exc))
