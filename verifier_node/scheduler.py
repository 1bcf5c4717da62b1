"""The verifier's scheduler: one thread that owns the target runner and runs the engine's steps.

Requests arrive from gRPC handler threads through ``submit`` and wait in a bounded admission
queue; the scheduler admits them while KV slots are free (prefill, session created in the draft
cache with its drafter), then repeats one verification step over every active session: wait for
drafts up to a short deadline, verify all in one forward pass, commit in the cache (fixes go to
the drafters), hand committed tokens to the handlers. A full admission queue is backpressure:
``submit`` raises ``QueueFull`` instead of queueing without bound.

Faults: a failure of one session (it vanished from the cache, its forward failed) fails that
session only. The cache being unreachable fails none: the loop backs off and retries the step
(the engine keeps its verdicts until the cache takes them), and ``healthy`` is False meanwhile.
The loop never dies of an exception.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from typing import NamedTuple

from edgespec.config import ConfigError
from edgespec.engine.spec_engine import Admission, Result, SessionFailed, SpecEngine
from edgespec.protocol.request_stats import Stats
from edgespec.protocol.contract import StoreUnavailable

from .handover import HANDOVER_AFTER_S, Handover
from .pace import Pace, prompts_ahead, tokens_before_a_slot, tokens_left
from .tickets import QueueFull, ShuttingDown, Ticket, TooSlowForDeadline

log = logging.getLogger("edgespec.verifier")

FAILING_STEPS = 3  # verification steps failing in a row after which health says NOT_SERVING
FAILING_FOR_S = 30.0  # ... for this long after the last failure (or until a step succeeds)
# a step running this long is stuck (a hung device or kernel): NOT_SERVING until it returns. A
# step's prefill is bounded by --prefill-budget: a few seconds on a CPU
STUCK_STEP_S = 60.0


class _Cancel(NamedTuple):
    """A cancel asked for, applied by the scheduler's thread (``_apply_cancels``)."""

    session_id: str
    orphaned: bool  # only if nobody follows the session then (its last reader left)
    reason: str  # its finish reason


class Scheduler(threading.Thread):
    def __init__(self, engine: SpecEngine, max_queue: int = 64, metrics=None,
                 handover_after_s: float = HANDOVER_AFTER_S):
        """``metrics``: a ``verifier_node.metrics.VerifierMetrics`` (or None);
        ``handover_after_s``: how long a board is gone before its sessions are handed to
        another (``Handover``; 0: no session is ever handed over)."""
        super().__init__(daemon=True, name="verifier-scheduler")
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self._pending: deque[Ticket] = deque()
        self._cancels: deque[_Cancel] = deque()
        self._tickets: dict[str, Ticket] = {}  # queued or active, by session id
        self._lock = threading.Lock()
        self._stopping = threading.Event()  # (not ``_stop``: threading.Thread has a _stop())
        self._wake = threading.Event()
        self.store_ok = True
        self.store_error = ""  # what the cache's last failure said (while not store_ok)
        self._failed_steps = 0  # steps in a row that raised (a bug, a device fault)
        self._failed_at = 0.0
        self._step_began: float | None = None  # the running step's start (None: between)
        self._said_stuck: float | None = None  # the start of the step said stuck
        self.draining = False
        self.pace = Pace(engine.cost.fit)
        engine.on_prefill = self._prefilled  # what each step's chunked prefill did
        self._step_tokens = 0  # committed during the step running now
        self.handover = Handover(engine, lambda: self._tickets, metrics,
                                 after_s=handover_after_s) \
            if handover_after_s > 0 and Handover.possible(engine) else None

    # -- called from handler threads ------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Sessions it holds at once: running in KV slots plus waiting for one."""
        return self.engine.cfg.max_sessions + self.max_queue

    def room(self) -> int:
        """Sessions it would take now: its capacity less those running and queued."""
        with self._lock:
            return self.capacity - len(self._tickets)

    @property
    def healthy(self) -> bool:
        """Serving: the loop runs, the cache answers, its steps do not all fail (a device
        fault that fails every step: unhealthy from the ``FAILING_STEPS``-th in a row, for
        ``FAILING_FOR_S`` after the last, or until a step succeeds) and none hangs (a step
        running past ``STUCK_STEP_S``: unhealthy until it returns)."""
        return self.unhealthy_reason is None

    @property
    def unhealthy_reason(self) -> str | None:
        """Why it is not ``healthy``, in words (None: it is)."""
        if self._stopping.is_set():
            return "the verifier is draining (shutting down)"
        if not self.is_alive():
            return "the verification loop is not running"
        if not self.store_ok:
            return f"the draft cache is unreachable ({self.store_error})"
        if self._failed_steps >= FAILING_STEPS and \
                time.monotonic() - self._failed_at < FAILING_FOR_S:
            return f"the last {self._failed_steps} verification steps failed"
        if self.stuck:
            return f"a verification step has run for over {STUCK_STEP_S:.0f} s"
        return None

    @property
    def stuck(self) -> bool:
        """A step has run past ``STUCK_STEP_S`` and not returned (said once in the log)."""
        began = self._step_began
        stuck = began is not None and time.monotonic() - began > STUCK_STEP_S
        if stuck and self._said_stuck != began:
            self._said_stuck = began
            log.error("a verification step has run for over %.0f s: health says NOT_SERVING "
                      "until it returns (a hung device or kernel?)", STUCK_STEP_S)
        return stuck

    def submit(self, ticket: Ticket, deadline_s: float | None = None) -> Ticket:
        """Queue a ticket; if its session is already queued or running, the running ticket is
        returned instead (a client resuming a stream that is still alive). ``deadline_s``: the
        seconds the caller waits for a new session's whole output (None: no deadline); one that
        the measured pace and the work ahead would not meet is refused (``TooSlowForDeadline``,
        ``pace.py``)."""
        self.engine.validate(ticket.request)  # ConfigError before any queueing
        with self._lock:
            running = self._tickets.get(ticket.session_id)
            if running is not None:  # a resume: its handler will follow it, so no orphan
                with running.cond:  # cancel may end it meanwhile (``_apply_cancels``)
                    running.claims += 1
                return running
            if ticket.submitted:  # the running ticket a resume found has ended since: its
                return ticket  # handler reads its end, it is not queued again
            if self.draining or self._stopping.is_set():
                raise ShuttingDown("the verifier is draining: it admits no new sessions")
            # running + queued, not queued alone: a ticket not yet moved to a free slot must not
            # take a queue place
            if len(self._tickets) >= self.capacity:
                raise QueueFull(f"{self.engine.cfg.max_sessions} sessions are running and "
                                 f"{self.max_queue} waiting")
            if deadline_s is not None:
                self._check_pace(ticket, deadline_s)
            self._pending.append(ticket)
            self._tickets[ticket.session_id] = ticket
            ticket.submitted = True
        self._wake.set()
        return ticket

    def _check_pace(self, ticket: Ticket, deadline_s: float) -> None:
        """Raise TooSlowForDeadline when ``ticket`` would not finish in time (the lock held)."""
        queued = {id(t) for t in self._pending}
        ahead = tokens_before_a_slot(
            self.engine.cfg.max_sessions,
            [tokens_left(t) for t in self._tickets.values() if id(t) not in queued],
            [tokens_left(t) for t in self._pending])
        prompts = prompts_ahead(self.engine, [t.request for t in self._pending],
                                ticket.request)
        batch = min(self.engine.cfg.max_sessions, len(self._tickets) + 1)
        verdict = self.pace.verdict(tokens_left(ticket), ahead, prompts, deadline_s, batch)
        if not verdict.admit:
            if self.metrics is not None:
                self.metrics.refused_for_pace()
            raise TooSlowForDeadline(verdict)

    def ticket(self, session_id: str) -> Ticket | None:
        with self._lock:
            return self._tickets.get(session_id)

    def cancel(self, session_id: str, orphaned: bool = False, reason: str = "cancelled"
               ) -> bool:
        """Cancel a queued or running session; False if there is none. ``orphaned``: only if
        nobody follows it any more when the cancel is applied (a client may have resumed the
        stream in between). ``reason``: its finish reason ("stop" for a stop string)."""
        with self._lock:
            t = self._tickets.get(session_id)
            if t is None:
                return False
            self._cancels.append(_Cancel(session_id, orphaned, reason))
        self._wake.set()
        return True

    def load(self) -> tuple[int, int]:
        """(active sessions, queued requests)."""
        with self._lock:
            return len(self.engine.sessions), len(self._pending)

    def drain(self, timeout: float, abort: threading.Event | None = None) -> bool:
        """Admit nothing new and wait up to ``timeout`` for queued and running sessions to
        finish (``abort`` set: stop waiting). True when all finished."""
        with self._lock:
            self.draining = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (abort is not None and abort.is_set()):
            if self.sessions_left() == 0:
                return True
            time.sleep(0.05)
        return self.sessions_left() == 0

    def sessions_left(self) -> int:
        """Sessions queued or running."""
        with self._lock:
            return len(self._tickets)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self.is_alive():
            self.join(timeout=30)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        backoff = 0.05
        while not self._stopping.is_set():
            try:
                self._apply_cancels()
                with self._watched():  # an image prompt is prefilled here, alone
                    self._admit()
                if self.engine.sessions:  # running, or waiting for their prompts' prefill
                    if self.handover is not None:  # boards for those without (a second apart)
                        with self._watched():  # a hung cache holds the loop here too
                            self.handover.run()
                    self._step_tokens = 0
                    with self._watched() as began:
                        try:
                            report = self.engine.step()
                        finally:  # a step that raised counts its forwards that raised too
                            if self.engine.forwards_failed and self.metrics is not None:
                                self.metrics.forward_failures.inc(self.engine.forwards_failed)
                    if self.engine.faulted:  # every forward raised: its sessions failed alone
                        self._count_failing_step()
                    else:
                        self._failed_steps = 0
                    if report is not None:  # a step that verified nothing says nothing of pace
                        # the step's prefill is the pace's prefill rate's (``_prefilled``)
                        took = time.monotonic() - began - self.engine.prefill_s
                        self.pace.step(self._step_tokens, report.sessions, took, report.tokens)
                    if report is not None and self.metrics is not None:
                        self.metrics.step(report)
                else:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                if not self.store_ok:
                    log.info("the draft cache is reachable again")
                self.store_ok, backoff = True, 0.05
            except (StoreUnavailable, OSError) as exc:
                # the cache is unreachable: fail nothing, retry the step after a pause
                if self.store_ok:
                    log.error("the draft cache is unreachable (%s); retrying", exc)
                self.store_error, self.store_ok = str(exc)[:300], False  # the reason first
                self._stopping.wait(backoff)
                backoff = min(1.0, backoff * 2)
            except Exception as exc:  # a bug: fail the sessions in flight, keep serving
                log.exception("verification step failed")
                self._count_failing_step()
                for act in self.engine.sessions:
                    try:
                        self.engine.fail(act, SessionFailed(f"verification step failed: "
                                                            f"{exc!r}"))
                    except Exception:  # one failing fail (a callback) must not end the loop
                        log.exception("failing session %s failed", act.sid)
        self._shut_down()

    @contextlib.contextmanager
    def _watched(self):
        """The loop's work on the device (admitting, a step), timed for ``stuck``; yields its
        start."""
        began = self._step_began = time.monotonic()
        try:
            yield began
        finally:
            self._step_began = None
            if self._said_stuck == began:
                log.info("the stuck verification step returned after %.0f s",
                         time.monotonic() - began)

    def _count_failing_step(self) -> None:
        """A step that raised, or whose every forward raised (a device fault fails each
        session it meets alone): health turns NOT_SERVING at the ``FAILING_STEPS``-th in a
        row."""
        self._failed_steps += 1
        self._failed_at = time.monotonic()
        if self._failed_steps == FAILING_STEPS:
            log.error("%d verification steps in a row failed: health says NOT_SERVING until a "
                      "step succeeds or %.0f s pass without a failure", FAILING_STEPS,
                      FAILING_FOR_S)

    def _shut_down(self) -> None:
        exc = ShuttingDown("the verifier is shutting down; resume the session")
        for act in self.engine.sessions:
            self.engine.abandon(act, exc)  # kept in the cache, resumable
        with self._lock:
            left = list(self._pending) + list(self._tickets.values())
            self._pending.clear()
            self._tickets.clear()
        for t in left:
            self._release_pick(t)
            t.fail(exc)

    def _release_pick(self, t: Ticket) -> None:
        release, t.release_pick = t.release_pick, None
        if release is not None:
            try:
                release()
            except Exception:
                pass

    def _admit(self) -> None:
        """The requests waiting, as many as there are free slots, taken in together
        (``SpecEngine.admit``): their prompts are prefilled by the steps, a budget a step."""
        with self._lock:
            picked = [self._pending.popleft()
                      for _ in range(min(len(self._pending), self.engine.free_slots))]
        if not picked:
            return
        for t in picked:
            t.request.on_tokens = lambda new, t=t: self._on_tokens(t, new)
            if t.request.logprobs is not None:
                t.request.on_logprobs = t.add_logprobs
            if t.request.prompt_logprobs is not None:
                t.request.on_prompt_logprobs = t.set_prompt_logprobs
        got = self.engine.admit([Admission(t.request, t.session_id, t.device) for t in picked])
        unreachable = [(t, g) for t, g in zip(picked, got)
                       if isinstance(g, (StoreUnavailable, OSError))]
        if unreachable:
            with self._lock:  # the cache is down: admitted later
                self._pending.extendleft(reversed([t for t, _ in unreachable]))
        for t, act in zip(picked, got):
            if isinstance(act, (StoreUnavailable, OSError)):
                continue
            if isinstance(act, Exception):
                if not isinstance(act, ConfigError):
                    log.error("admitting session %s failed", t.session_id, exc_info=act)
                self._release_pick(t)
                self._end(t, error=act)
                continue
            self._release_pick(t)
            if self.metrics is not None:
                self.metrics.admitted(len(t.request.prompt_ids))
            act.on_finish = lambda res, t=t: self._end(t, result=res)
            act.on_error = lambda exc, t=t: self._end(t, error=exc)
        if unreachable:
            raise unreachable[0][1]

    def _prefilled(self, tokens: int, seconds: float) -> None:
        self.pace.prefill(tokens, seconds)
        if self.metrics is not None:
            self.metrics.prefilled(seconds)

    def prefilling(self) -> int:
        """Sessions in KV slots still waiting for their prompts' prefill."""
        return len(self.engine.prefilling)

    def _on_tokens(self, t: Ticket, new: list[int]) -> None:
        now = time.monotonic()
        if self.metrics is not None and new:
            since_last = None if t.last_token_at is None else now - t.last_token_at
            self.metrics.tokens(len(new), since_last, now - t.created)
        if new:
            t.last_token_at = now
            self._step_tokens += len(new)
        t.publish(new)

    def _end(self, t: Ticket, result: Result | None = None,
             error: Exception | None = None) -> None:
        with self._lock:
            if self._tickets.get(t.session_id) is t:
                del self._tickets[t.session_id]
        if error is not None:
            if self.metrics is not None:
                self.metrics.failed()
            t.fail(error)
            return
        assert result is not None  # a session ends with a result or an error
        if self.metrics is not None:
            self.metrics.finished(t.device, result.stats, result.finish_reason,
                                  time.monotonic() - t.created, t.earlier_boards)
        t.finish(result)

    def _apply_cancels(self) -> None:
        while True:
            with self._lock:
                if not self._cancels:
                    return
                sid, orphaned, reason = self._cancels.popleft()
                t = self._tickets.get(sid)
                # an orphan cancel is void once a reader follows again, or while a resume's
                # handler is on its way to follow
                if t is None or (orphaned and (t.followers > 0 or t.claims > 0)):
                    continue
                queued = next((t for t in self._pending if t.session_id == sid), None)
                if queued is not None:
                    self._pending.remove(queued)
            if queued is not None:
                self._release_pick(queued)
                self._end(queued, result=Result(list(queued.tokens), Stats(), reason))
            else:
                try:  # the session is ended whatever its own callback raises: no other's
                    self.engine.cancel(sid, reason)
                except Exception:
                    log.exception("ending cancelled session %s failed", sid)
