"""A simulated device's compute: its drafter drafts ``slowdown`` times slower than it does here
(each proposal is followed by (slowdown - 1) times its own duration asleep), or, for a device
with a published speed, no faster than ``tokens_per_s`` (each proposal of n tokens, branches
included, takes at least n / tokens_per_s). The drafting loop drafts outside its lock, so fixes
and commits still reach the agent meanwhile, as on a slow board."""

from __future__ import annotations

import functools
import time

from edgespec.config import ConfigError, SamplingParams
from edgespec.drafters import Drafter, DraftSession

from .device_profiles import extra_compute_s


class SlowedDrafter(Drafter):
    """``inner`` with every proposal slowed down ``slowdown`` times, or paced to at most
    ``tokens_per_s`` (the rest delegated)."""

    def __init__(self, inner: Drafter, slowdown: float, tokens_per_s: float | None = None):
        if not slowdown >= 1:
            raise ConfigError(f"compute_slowdown must be >= 1, got {slowdown!r}")
        if tokens_per_s is not None and not tokens_per_s > 0:
            raise ConfigError(f"tokens_per_s must be > 0, got {tokens_per_s!r}")
        self.inner, self.slowdown, self.tokens_per_s = inner, slowdown, tokens_per_s
        self.slower_than_published = 0  # proposals this machine drafted slower than the pace
        self.name, self.wait_ms = inner.name, inner.wait_ms
        self.uses_fleet = inner.uses_fleet

    def use_fleet(self, fleet) -> None:
        self.inner.use_fleet(fleet)

    def open(self, tokens: list[int], params: SamplingParams) -> DraftSession:
        session = self.inner.open(tokens, params)
        # the drafting loop calls propose_tree only (a width of 1 is propose's chain, and a
        # drafter's propose_tree may call its own propose: slowing both would count it twice)
        session.propose_tree = self._slowed(session.propose_tree)  # type: ignore[method-assign]
        return session

    def _slowed(self, propose):
        @functools.wraps(propose)
        def slowed(*args, **kwargs):
            began = time.perf_counter()
            out = propose(*args, **kwargs)
            took = time.perf_counter() - began
            n = len(out.tokens) + sum(len(b.tokens) for b in out.branches)
            if self.tokens_per_s and n and took > n / self.tokens_per_s:
                self.slower_than_published += 1
            time.sleep(extra_compute_s(self.slowdown, took, n, self.tokens_per_s))
            return out

        return slowed

    def snapshot(self):
        return self.inner.snapshot()

    def restore(self, state) -> None:
        self.inner.restore(state)
