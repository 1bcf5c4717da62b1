"""Per-request speculative-decoding figures, named as vLLM names them.

Acceptance rate = accepted / drafted tokens; mean acceptance length = 1 + accepted / drafts
(a draft is one verification of a non-empty draft; the 1 counts the verifier's own token).
With token trees, drafted tokens count every node verified (the chain's and the branches'),
accepted tokens the accepted path, and ``branch_tokens`` those of it taken from a branch.
``lossless`` is false for a session verified in a lossy mode (``verify``: "loose", FLy's rule, or
"pad", PAD's); ``lenient_tokens`` counts the accepted draft tokens the exact rule would have
rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


def reaching(ending: Sequence[int]) -> list[int]:
    """[#(n > 0), #(n > 1), ...] of lengths counted by their value (``ending[n]``: how many
    are n), as long as the longest counted: position i's count is the lengths of i + 1 or more.
    """
    out, reach = [0] * max(0, len(ending) - 1), 0
    for i in range(len(ending) - 1, 0, -1):
        reach += ending[i]
        out[i - 1] = reach
    return out


@dataclass
class Stats:
    steps: int = 0  # verification forwards this session took part in
    num_drafts: int = 0  # steps with a non-empty draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # accepted draft tokens by their position in the draft, as long as the longest draft:
    # settled from the steps when the session ends (``settle``), not at each step
    accepted_per_pos: list[int] = field(default_factory=list)
    tokens: int = 0  # generated tokens
    prefill_s: float = 0.0
    elapsed_s: float = 0.0
    # where the step time went (summed over steps): waiting for and taking drafts from the store,
    # the target forward + verification, and committing to the store
    take_s: float = 0.0
    forward_s: float = 0.0
    commit_s: float = 0.0
    start: float = 0.0
    lossy: bool = False  # a lossy mode (loose, pad): the output may differ from the target's own
    verify: str = "exact"  # the verification mode: "exact", "loose" or "pad"
    lenient_tokens: int = 0  # accepted draft tokens exact verification would have rejected
    branch_tokens: int = 0  # accepted tokens that came from a tree's branch, not the chain
    head_tokens: int = 0  # tokens the verifier's draft head proposed
    head_accepted: int = 0  # of which accepted
    # tokens the verifier drafted itself for its board's empty drafts (``engine.fill_drafts``),
    # and of which accepted; counted in draft_tokens and accepted_tokens too
    fill_drafts: int = 0  # steps whose draft was the verifier's fill (counted in num_drafts)
    fill_tokens: int = 0
    fill_accepted: int = 0
    stacks: dict[str, int] = field(default_factory=dict)  # --auto: steps per chosen stack
    # the drafter's own share of num_drafts, draft_tokens and accepted_tokens: the verifier's
    # drafts (a head's, a fill's) left out (what its device's acceptance is computed from)
    drafter_drafts: int = 0
    drafter_tokens: int = 0
    drafter_accepted: int = 0

    def __post_init__(self) -> None:
        # the steps since the last ``settle``: drafts by how many of their tokens were
        # accepted, and the longest draft (one list write a step, where counting each accepted
        # position was a loop a session and step: 1% of a 64-session step's host work)
        self._accepted_runs: list[int] = []
        self._deepest = 0

    def record_step(self, drafted: int, accepted: int, from_branch: int = 0) -> None:
        self.steps += 1
        self.branch_tokens += from_branch
        if drafted:
            self.num_drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            if drafted > self._deepest:
                self._deepest = drafted
            runs = self._accepted_runs
            if accepted >= len(runs):
                runs.extend([0] * (accepted + 1 - len(runs)))
            runs[accepted] += 1

    def settle(self) -> None:
        """Count the steps recorded since the last call into ``accepted_per_pos`` (the engine
        calls it when the session ends; ``to_dict`` too): a draft that accepted n tokens adds
        one at each position below n, and the list is as long as the longest draft. (A copy
        by ``dataclasses.replace`` starts with no step recorded: settle before.)"""
        runs = self.__dict__.get("_accepted_runs")  # none in another version's pickle
        if runs is None:
            return
        per_pos = self.accepted_per_pos
        if len(per_pos) < self._deepest:
            per_pos.extend([0] * (self._deepest - len(per_pos)))
        for i, n in enumerate(reaching(runs)):  # the drafts that accepted more than i tokens
            per_pos[i] += n
        runs.clear()

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        decode = self.elapsed_s
        return self.tokens / decode if decode > 0 else 0.0

    def to_dict(self) -> dict:
        self.settle()
        d = asdict(self)
        d.pop("start")
        d.update(acceptance_rate=round(self.acceptance_rate, 4),
                 mean_acceptance_length=round(self.mean_acceptance_length, 4),
                 tokens_per_step=round(self.tokens_per_step, 4),
                 tokens_per_s=round(self.tokens_per_s, 3))
        d["drafted"] = self.draft_tokens
        d["accepted"] = self.accepted_tokens
        d["lossless"] = not d.pop("lossy")
        return d
