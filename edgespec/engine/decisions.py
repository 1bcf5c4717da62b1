"""What a verification step decided for one session: its ``Verdict`` as the store takes it,
cut where the output ends (a stop token, the length limit), beside the row it decided on.

The verification step yields one ``Verdict`` per row (``edgespec.protocol.contract``): the
accepted chain tokens, an accepted branch, the target's own token. ``decide`` cuts it once
where the session's output ends, and that same verdict goes to the store and is applied.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

from ..protocol.contract import Verdict
from .generation import ActiveSession
from .proposals import StepDraft


@dataclass(frozen=True)
class Decision:
    """A row's verdict, as the store will take it, beside the draft it decided on."""

    draft: StepDraft
    verdict: Verdict

    @property
    def act(self) -> ActiveSession:
        return self.draft.act

    @property
    def new(self) -> list[int]:
        """The tokens the verdict adds to the output."""
        v = self.verdict
        return [*self.draft.tokens[:v.n_accepted], *v.branch, v.token]

    @property
    def accepted(self) -> int:
        return self.verdict.n_accepted + len(self.verdict.branch)


def decide(draft: StepDraft, v: Verdict, room: int, stop_ids: Collection[int]) -> Decision:
    """``v`` cut to the session's output: at most ``room`` tokens, ending at the first stop
    token (finish reason "stop"), or at the limit ("length"). A cut inside the accepted run
    makes its last kept token the verdict's token (a draft token the draft holds)."""
    new = [*draft.tokens[:v.n_accepted], *v.branch, v.token]
    finish = ""
    for i, tok in enumerate(new[:room]):
        if tok in stop_ids:
            new, finish = new[:i + 1], "stop"
            break
    else:
        if len(new) >= room:
            new, finish = new[:room], "length"
    n = min(v.n_accepted, len(new) - 1)
    branch = tuple(new[v.n_accepted:len(new) - 1])
    return Decision(draft, replace(v, n_accepted=n, branch=branch, token=new[-1],
                                   finish_reason=finish,
                                   own_branch=v.own_branch and bool(branch)))
