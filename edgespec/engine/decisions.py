"""What a verification step decided for one session: its ``Verdict`` as the store takes it,
cut where the output ends (a stop token, the length limit), beside the row it decided on.

The verification step yields one ``Decision`` per row (``scoring.row_decisions``): the
``Verdict`` (``edgespec.protocol.contract``: the accepted chain tokens, an accepted branch, the
target's own token) cut once where the session's output ends (``decide``), with what committing
it needs here, the accepted path's nodes (a tree's keys and values are moved into place at
commit, so verification changes nothing) and which of them only a lossy rule kept. That same
verdict goes to the store and is applied.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import field, replace

from ..protocol.contract import Verdict
from ..protocol.frozen_value import frozen_value
from ..protocol.token_logprob import TokenLogprob
from .generation import ActiveSession
from .proposals import StepDraft


@frozen_value
class Decision:
    """A row's verdict, as the store will take it, beside the draft it decided on, with the
    accepted path (moved into place by ``StepCommit._place`` before the store's commit), its
    lossy-kept flags, and the tokens it adds to the output (``new``: the accepted chain
    tokens, the branch's, the verdict's token)."""

    draft: StepDraft
    verdict: Verdict
    path: tuple[int, ...] = ()  # the accepted nodes, root to leaf (node indices of the row)
    lenient: tuple[int, ...] = ()  # along the path: 1 where only a lossy rule kept the node
    new: list[int] = field(default_factory=list, hash=False)
    # with the session's ``Request.logprobs``: ``new``'s logprobs, one a token (else empty)
    logprobs: tuple[TokenLogprob, ...] = field(default=(), hash=False)

    @property
    def act(self) -> ActiveSession:
        return self.draft.act

    @property
    def accepted(self) -> int:
        return self.verdict.n_accepted + len(self.verdict.branch)


def decide(draft: StepDraft, v: Verdict, room: int, stop_ids: Set[int],
           path: tuple[int, ...] = (), lenient: tuple[int, ...] = ()) -> Decision:
    """``v`` cut to the session's output: at most ``room`` tokens, ending at the first stop
    token (finish reason "stop"), or at the limit ("length"). A cut inside the accepted run
    makes its last kept token the verdict's token (a draft token the draft holds). ``path``
    (the accepted nodes) and ``lenient`` (1 where only a lossy rule kept a node) travel with
    it."""
    new = list(draft.tokens[:v.n_accepted])
    if v.branch:
        new.extend(v.branch)
    new.append(v.token)
    finish = ""
    if stop_ids and not stop_ids.isdisjoint(new[:room]):
        for i, tok in enumerate(new[:room]):
            if tok in stop_ids:
                new, finish = new[:i + 1], "stop"
                break
    if not finish and len(new) >= room:
        new, finish = new[:room], "length"
    if not finish and not v.finish_reason and (v.branch or not v.own_branch):
        # nothing cut: the verdict as verification gave it
        return Decision(draft, v, path, lenient, new)
    n = min(v.n_accepted, len(new) - 1)
    branch = tuple(new[v.n_accepted:len(new) - 1])
    return Decision(draft, replace(v, n_accepted=n, branch=branch, token=new[-1],
                                   finish_reason=finish,
                                   own_branch=v.own_branch and bool(branch)), path, lenient,
                    new)
