"""Admission that knows the machine's speed: a new call is admitted only when the verifier's
measured throughput and the work queued ahead of it let it finish within its deadline.

A queue of fixed depth admits the same number of calls on a 2-core Cascade Lake as on a GPU;
there a burst of 200 calls had 6 admitted ones miss their deadline. ``Pace`` learns, from the
steps the scheduler runs, the tokens a session commits a step, a step's time and the sessions
and rows it had, and projects them to the batch a new call would run in (the engine's measured
forward cost, ``fixed + per_token * rows``, scales the step time: a batch of 8 decodes more in
all than the lone session a quiet verifier measured). ``Pace.verdict`` estimates when a new call
would finish:

    finish ~ tokens ahead / rate(n) + its own / session_rate(n) + prefills ahead

where "tokens ahead" is what the queued and running sessions generate before the call gets a
KV slot: none while a slot is free (its tokens come beside theirs, each step one or more for
every session: a batched verifier serves the call at ``session_rate(n)``, n the batch it joins);
else, every slot busy until one frees for it: the running sessions' ends played out, each
freed slot taken by the next queued ticket in order (``tokens_before_a_slot``; each
session's ``max_new_tokens`` less what it has: an upper bound, so the estimate errs towards
refusing).
A call whose estimate exceeds ``SAFETY`` of its deadline is refused at once
(RESOURCE_EXHAUSTED, with a retry-after: the time the work ahead needs to drain that far).
Before the first steps are measured nothing is refused by pace (the queue's depth still is);
a resumed session is never refused by pace (it already counts). The pace is measured only as
steps run: an idle verifier whose last step is more than ``STALE_S`` old admits a call with
nothing ahead of it whatever its estimate, and measures again (after a slow spell, a flood that
left it at 0.2 tokens/s, every call with a 30 s deadline was refused "even alone", and as none
ran, none ever would have been admitted again).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

SAFETY = 0.8  # admit when the estimate is within this share of the deadline
ALPHA = 0.2  # weight of the newest step in the moving averages
MIN_STEPS = 3  # steps measured before pace refuses anything
STALE_S = 15.0  # an idle verifier's pace older than this is measured again by the next call


@dataclass(frozen=True)
class PaceVerdict:
    """Whether a call may be admitted, and the figures the decision read."""

    admit: bool
    estimate_s: float | None  # when it would finish; None: not measured yet
    deadline_s: float | None
    retry_after_s: float = 0.0
    alone_s: float = 0.0  # what it would need with nothing ahead of it
    rate: float = 0.0  # the measured tokens/s the estimate used
    ahead_tokens: int = 0

    def reason(self) -> str:
        deadline = self.deadline_s or 0
        said = (f"a call with a {deadline:.1f} s deadline would finish in about "
                f"{self.estimate_s or 0:.1f} s ({self.ahead_tokens} tokens may come before a "
                f"KV slot is free for it, at the measured {self.rate:.1f} tokens/s, then "
                f"{self.alone_s:.1f} s of its own), past the {SAFETY * deadline:.1f} s "
                f"({SAFETY:.0%} of its deadline) a call is admitted within")
        if self.alone_s > SAFETY * deadline:
            return (f"{said}; even alone it needs about {self.alone_s:.1f} s: ask for fewer "
                    f"tokens or give it a longer deadline")
        return f"{said}; retry after {self.retry_after_s:.1f} s"


class Pace:
    """Moving averages of the verifier's speed, fed by the scheduler thread and read by the
    handler threads."""

    def __init__(self, cost_fit: Callable[[], tuple[float, float] | None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """``cost_fit``: the engine's forward cost model, ``() -> (fixed, per_row) seconds``
        (``draft_planner.ForwardCost.fit``); None: a step costs the same at any batch."""
        self._lock = threading.Lock()
        self._clock = clock
        self.stepped_at = 0.0  # when the last step was measured (``clock``)
        self.cost_fit = cost_fit
        self.rate = 0.0  # committed tokens a second, all sessions together (as measured)
        self.session_rate = 0.0  # committed tokens a second, one session (as measured)
        self.prefill_rate = 0.0  # prompt tokens a second through a prefill
        self.per_session = 0.0  # committed tokens a session a step
        self.step_s = 0.0
        self.sessions = 0.0  # sessions a step had
        self.rows_per_session = 0.0  # forward rows a session a step (1 + its draft)
        self.fit: tuple[float, float] | None = None  # the cost model as of the last step
        self.steps = 0

    def step(self, tokens: int, sessions: int, seconds: float, rows: int = 0) -> None:
        """One verification step committed ``tokens`` over ``sessions`` in ``seconds``, its
        forward over ``rows`` rows (0: not known)."""
        if sessions <= 0 or seconds <= 0:
            return
        fit = self.cost_fit() if self.cost_fit is not None else None  # the engine's thread
        with self._lock:
            self.fit = fit
            self.rate = self._mix(self.rate, tokens / seconds)
            self.session_rate = self._mix(self.session_rate, tokens / sessions / seconds)
            self.per_session = self._mix(self.per_session, tokens / sessions)
            self.step_s = self._mix(self.step_s, seconds)
            self.sessions = self._mix(self.sessions, sessions)
            if rows:
                self.rows_per_session = self._mix(self.rows_per_session, rows / sessions)
            self.steps += 1
            self.stepped_at = self._clock()

    def rates_at(self, batch: float) -> tuple[float, float]:
        """(all sessions', one session's) committed tokens a second with ``batch`` sessions a
        step: the measured step time scaled by the forward cost model from the batch measured
        to ``batch``."""
        with self._lock:
            g, t, n0, rps = self.per_session, self.step_s, self.sessions, self.rows_per_session
            fit = self.fit
        if t <= 0 or g <= 0:
            return 0.0, 0.0
        if fit is not None and n0 > 0:
            fixed, per_row = fit
            rps = rps or 1.0
            t *= (fixed + per_row * batch * rps) / (fixed + per_row * n0 * rps)
        return batch * g / t, g / t

    def prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            with self._lock:
                self.prefill_rate = self._mix(self.prefill_rate, tokens / seconds)

    @staticmethod
    def _mix(old: float, new: float) -> float:
        return new if old == 0 else (1 - ALPHA) * old + ALPHA * new

    def verdict(self, new_tokens: int, ahead_tokens: int, ahead_prompts: int,
                deadline_s: float | None, batch: float | None = None) -> PaceVerdict:
        """Whether a call that may generate ``new_tokens`` finishes within ``deadline_s`` (None:
        no deadline, always admitted) behind ``ahead_tokens`` the batch generates before the
        call gets a slot (0: one is free) and
        ``ahead_prompts`` prompt tokens (its own included) still to prefill, running among
        ``batch`` sessions a step (None: as many as measured)."""
        with self._lock:
            pre, steps, measured = self.prefill_rate, self.steps, self.sessions
            stale = self._clock() - self.stepped_at > STALE_S
        if deadline_s is None or steps < MIN_STEPS:
            return PaceVerdict(True, None, deadline_s)
        rate, single = self.rates_at(batch or measured)
        if rate <= 0 or single <= 0:
            return PaceVerdict(True, None, deadline_s)
        prefill = ahead_prompts / pre if pre > 0 else 0.0
        alone = new_tokens / single
        estimate = ahead_tokens / rate + alone + prefill  # a slot, then its own tokens
        # idle (nothing running or queued: a batch of one, no tokens ahead) since a step long
        # ago: its measure may be a slow spell's, which no step runs to correct
        if estimate <= SAFETY * deadline_s or (stale and batch == 1 and ahead_tokens == 0):
            return PaceVerdict(True, estimate, deadline_s, alone_s=alone, rate=rate,
                               ahead_tokens=ahead_tokens)
        # the work ahead must shrink by what does not fit: at ``rate``, that long; none where the
        # call would not fit even alone (waiting cannot help it)
        retry = 0.0 if alone > SAFETY * deadline_s else max(0.5, estimate - SAFETY * deadline_s)
        return PaceVerdict(False, estimate, deadline_s, retry, alone, rate, ahead_tokens)


def tokens_left(ticket) -> int:
    """Tokens a ticket's session may still generate (an upper bound: its ``max_new_tokens``
    less what it has)."""
    return max(0, ticket.request.max_new_tokens - len(ticket.tokens))


def tokens_before_a_slot(slots: int, running: Sequence[int], queued: Sequence[int]) -> int:
    """Tokens the batch generates before a new call gets one of ``slots`` KV slots, every
    running session a token a step: ``running``, the tokens each running session may still
    generate; ``queued``, each queued ticket's, in queue order. None while a slot is free (the
    call's tokens come beside theirs, in the same steps; ``Pace.verdict`` reads its pace at the
    batch it joins). Else, the running sessions' ends played out, each freed slot taken by the
    next queued ticket in order (queued ones run only once a slot frees, not beside the
    others): the call's slot frees at step t, every slot busy until then, so ``slots * t``."""
    ends = list(running)
    heapq.heapify(ends)
    waiting = deque(queued)
    free = slots - len(ends)
    while free > 0 and waiting:  # a queued ticket not yet moved to a free slot
        heapq.heappush(ends, waiting.popleft())
        free -= 1
    t = 0
    while free <= 0 and ends:
        t = heapq.heappop(ends)  # a slot frees at step t
        if waiting:
            heapq.heappush(ends, t + waiting.popleft())
        else:
            free += 1
    return slots * t


def prompts_ahead(engine, pending: Iterable, request) -> int:
    """Prompt tokens to prefill before ``request``'s first token, its own included: the
    engine's prefill queue's, then the ``pending`` requests' (queued for a slot, in order) and
    ``request``'s, where a prompt the queue would copy (the same tokens as one counted, as
    waiting, running or pending, its logits read by no one, no image) counts once: the queue
    prefills it once (the ``n`` choices of a request arrive as ``n`` tickets)."""
    queue = engine.prefilling
    total = queue.tokens_left  # admitted, their prefill still to come
    seen = queue.shared_keys()
    for r in [*pending, request]:
        key = engine.prefill_key(r)
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        total += len(r.prompt_ids) + len(r.committed)
    return total
