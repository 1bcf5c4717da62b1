"""How fast the cache checks a board's refused chunks (``RefusalPace``, a token bucket), kept
per board across its streams (``RefusalPaces``). A refusal cost ~90 us of the server's CPU, most
of them a Redis script's round trip: a board flooding refusals at 10,000 a second took 93% of a
core and doubled everyone's latency. Past the pace, an Attach stream is read more slowly (its
reader waits: gRPC's flow control holds the board back) and ``PushDraft`` refuses unchecked.
An honest board's refusals are a fix's stale chunks, a few a session-step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

REFUSALS_PER_S = 512.0  # a board's refusals checked a second, after a burst
REFUSAL_BURST = 2048.0
MAX_REFUSAL_WAIT_S = 5.0  # the debt one message may run up (300,000 chunks in one: not 10 min)
MAX_PACES = 4096  # boards' paces kept (the oldest forgotten first), as the metrics' labels


class RefusalPace:
    """A token bucket of a board's refusals: ``after(n)`` counts n more and says how long to
    hold the board back (0: not at all). A message's refusals owe at most ``max_wait_s`` (one
    of 300,000 chunks, the ones past a message's 256 refused without a look, would otherwise
    hold its stream ten minutes)."""

    def __init__(self, rate: float = REFUSALS_PER_S, burst: float = REFUSAL_BURST,
                 clock: Callable[[], float] = time.monotonic,
                 max_wait_s: float = MAX_REFUSAL_WAIT_S):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.most_owed = rate * max_wait_s
        self.allowance, self.at = burst, clock()
        self.held = 0  # the times it has asked for a wait

    def after(self, refused: int) -> float:
        now = self.clock()
        self.allowance = min(self.burst, self.allowance + (now - self.at) * self.rate)
        self.at = now
        self.allowance = max(self.allowance - refused, -self.most_owed)
        if self.allowance >= 0:
            return 0.0
        self.held += 1
        return -self.allowance / self.rate


class RefusalPaces:
    """Each board's pace, by its device id, outliving its streams (a board that attaches again
    starts where it left, not with a fresh burst). ``make``: a new board's pace."""

    def __init__(self, make: Callable[[], RefusalPace] = RefusalPace):
        self.make = make
        self._paces: dict[str, RefusalPace] = {}
        self._lock = threading.Lock()

    def of(self, key: str) -> RefusalPace:
        with self._lock:
            return self._of(key)

    def _of(self, key: str) -> RefusalPace:  # the lock held
        pace = self._paces.get(key)
        if pace is None:
            if len(self._paces) >= MAX_PACES:
                del self._paces[next(iter(self._paces))]
            pace = self._paces[key] = self.make()
        return pace

    def after(self, key: str, refused: int) -> tuple[float, bool]:
        """(how long to hold ``key``'s board back, whether this is the first time it is)."""
        with self._lock:
            pace = self._of(key)
            wait = pace.after(refused)
            return wait, wait > 0 and pace.held == 1
