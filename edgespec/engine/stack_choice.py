"""``--drafter auto``: each session's choice of which draft sources a step verifies, by the
expected latency per token that the session's own measurements give (after HSD, Mohri et al.).

The sources a verifier can use for a session are its drafter's drafts (an in-process drafter's,
or the edge board's) and its draft head's; a stack is a subset of them (both: the head's draft
is a branch of the drafter's tree). HSD's model of a hierarchy's latency is, per step,
(verification cost + drafting cost) / (tokens a step commits); here every level is verified by
the target directly (a flat hierarchy), which makes the optimum a minimum over the 2^sources
stacks, found exactly each step:

    latency(S) = (fixed + per_token * (1 + sum of S's draft widths) + cost of S's drafting)
                 / (1 + E[accepted tokens of S])

``fixed`` and ``per_token`` are the verifier's measured forward cost (``ForwardCost``); the
cost of S's drafting is the head's measured drafting time shared by the batch's sessions (a
drafter's work happens off the verification path). When no session of a batch chooses the
head, it drafts only every 8th step (``heads.proposer.PROBE_EVERY``), to keep measuring it.
E[accepted] of every stack is measured on every step its sources proposed, chosen or not: what a
proposal would have had accepted is its common prefix with the tokens the step committed (the
target's choices are fixed by position-keyed noise, so this holds for sampling too). The choice
changes only what is verified, so every stack is lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations

SOURCES = ("drafter", "head")
DECAY = 0.85  # per step: recent steps weigh most


def stack_name(stack: Sequence[str]) -> str:
    return "+".join(stack) or "none"


def accepted_prefix(proposal: Sequence[int], committed: Sequence[int]) -> int:
    """Tokens of ``proposal`` the step would have accepted: its common prefix with the tokens
    it committed (cut at the proposal's length)."""
    n = 0
    while n < len(proposal) and n < len(committed) and proposal[n] == committed[n]:
        n += 1
    return n


class _Mean:
    def __init__(self, prior: float, weight: float = 2.0):
        self.total, self.weight = prior * weight, weight

    @property
    def value(self) -> float:
        return self.total / self.weight

    def add(self, x: float) -> None:
        self.total = DECAY * self.total + x
        self.weight = DECAY * self.weight + 1


class StackChooser:
    """One session's measurements and choice."""

    def __init__(self, sources: Sequence[str] = SOURCES):
        self.sources = tuple(sources)
        self.stacks = [s for n in range(len(self.sources) + 1)
                       for s in combinations(self.sources, n)]
        # optimistic priors: every source is tried before the measurements speak
        self.gain = {s: _Mean(1.0 if s else 0.0) for s in self.stacks}
        self.chosen: dict[str, int] = {}  # stack name -> steps
        self.last: tuple[str, ...] = ()  # the latest choice

    def choose(self, offered: dict[str, int], fixed: float, per_token: float,
               costs: dict[str, float] | None = None) -> tuple[str, ...]:
        """The stack to verify this step among the sources that offered tokens (``offered``:
        source -> draft tokens it offers now; ``costs``: source -> seconds a step of its
        drafting costs this session, 0 when not given)."""
        best = self.best(offered, fixed, per_token, costs or {})
        name = stack_name(best)
        self.chosen[name] = self.chosen.get(name, 0) + 1
        self.last = best
        return best

    def wants(self, source: str, width: int, fixed: float, per_token: float,
              costs: dict[str, float]) -> bool:
        """Whether the best stack would hold ``source`` if every source offered ``width``
        tokens (whether a source that drafts at a cost should draft for the next step)."""
        return source in self.best({s: width for s in self.sources}, fixed, per_token, costs)

    def best(self, offered: dict[str, int], fixed: float, per_token: float,
             costs: dict[str, float]) -> tuple[str, ...]:
        best: tuple[str, ...] = ()
        best_latency = float("inf")
        for stack in self.stacks:
            if any(offered.get(s, 0) == 0 for s in stack):
                continue
            width = sum(offered[s] for s in stack)
            cost = fixed + per_token * (1 + width) + sum(costs.get(s, 0.0) for s in stack)
            latency = cost / (1 + self.gain[stack].value)
            if latency < best_latency - 1e-12:
                best, best_latency = stack, latency
        return best

    def observe(self, proposals: dict[str, Sequence[int] | None],
                committed: Sequence[int]) -> None:
        """A step's proposals (verified or not) against what it committed; a source that was
        not asked this step (None) leaves the stacks holding it unmeasured."""
        got = {s: accepted_prefix(proposals.get(s) or (), committed) for s in self.sources}
        for stack in self.stacks:
            if any(proposals.get(s, ()) is None for s in stack):
                continue
            self.gain[stack].add(max((got[s] for s in stack), default=0))
