"""What a verification step verifies for each session: the proposers' drafts, combined into one
``StepDraft`` per row.

Two sources propose tokens, behind one interface (``Proposer``): the drafter (a board through
the distributed cache, or in process a ``DraftWorker`` thread or ``InlineDrafts``), whose draft
the store hands over as a ``TakenDraft``, and the verifier's own draft head
(``edgespec.heads.proposer.HeadProposer``), which drafted on the device during the previous
step. The drafter's chain is the row's spine and its branches hang from it; the head's proposal
joins as a branch from where it first differs from the spine (``head_branch``), and its own
alternatives, if it has any, as branches beside its tokens. ``--auto`` leaves out the sources a
session's chooser does not pick this step. The store's objects are read, never edited: a
``StepDraft`` is a new, frozen value.

Drafts are trusted here: token ids were checked where they entered (the cache service for a
board's chunks, the local store for the in-process drafter's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import field, replace

from ..config import verifies_trees
from ..protocol.contract import NO_PROPOSAL, Branch, Proposal, TakenDraft
from ..protocol.frozen_value import frozen_value
from ..verify.trees import tree_of_draft
from .generation import ActiveSession
from .stack_choice import accepted_prefix


class DrafterProposer:
    """The drafter's draft as the store gave it."""

    name = "drafter"

    def propose(self, session_id: str, taken: TakenDraft) -> Proposal:
        return Proposal(tuple(taken.tokens), tuple(taken.branches))


class HeadBranch(Branch):
    """A branch the verifier's head drafted (no drafter's store holds it)."""

    __slots__ = ()  # slotted as ``Branch`` is (``frozen_value``): no instance dict


def head_branch(spine: Sequence[int], proposal: Sequence[int]) -> Branch | None:
    """The head's proposal as a branch of a draft whose chain is ``spine``: from the first
    position where they differ (``at`` may be len(spine): it extends the chain); None when
    the chain already holds all of it."""
    at = accepted_prefix(proposal, spine)  # where the two first differ
    if at == len(proposal):
        return None
    return HeadBranch(at, tuple(proposal[at:]))


@frozen_value
class StepDraft:
    """One row of a step: a session's draft as verified (the drafter's chain and branches, the
    head's branch), under the store's ``epoch`` from position ``start``."""

    act: ActiveSession
    epoch: int
    start: int  # position of the first draft token (the session's committed end)
    tokens: tuple[int, ...]  # the chain
    branches: tuple[Branch, ...] = ()  # the drafter's, then the head's (HeadBranches)
    head_offer: tuple[int, ...] = ()  # what the head proposed (what its stats count)
    # what the verifier's fill proposed for an empty board draft (``fill_drafts``): its one
    # HeadBranch, at 0
    fill_offer: tuple[int, ...] = ()
    # --auto: every source's proposal, verified or not (None: the source was not asked)
    offers: Mapping[str, tuple[int, ...] | None] | None = None

    # each figure computed once, when the row is made: a row is read many times a step
    # (functools.cached_property takes a lock on each first read: 10% of a 64-session step)
    branch_tokens: int = field(init=False, repr=False, compare=False)
    """Draft tokens the branches add to the tree (a token two branches share counts once)."""
    drafted: int = field(init=False, repr=False, compare=False)
    """Draft tokens verified: the chain's and the branches'."""
    depth: int = field(init=False, repr=False, compare=False)
    """The draft's longest path: the most draft tokens one accepted path can hold."""
    width: int = field(init=False, repr=False, compare=False)
    """Tokens the row puts in the forward: the session's last token and the draft."""
    _nodes: tuple[Sequence[int], Sequence[int]] | None = field(init=False, repr=False,
                                                               compare=False)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        # set once, here (the class is frozen to the type checker, not at run time)
        if self.branches:
            tree = tree_of_draft(list(self.tokens), list(self.branches))
            self._nodes = (tree.tokens, tree.parents)  # type: ignore[misc]
            drafted = len(tree.tokens)
            depth = max([n] + [b.at + len(b.tokens) for b in self.branches])
            self.depth = depth  # type: ignore[misc]
        else:  # a chain's nodes are made when asked for (a step of chains does not)
            self._nodes = None  # type: ignore[misc]
            drafted = self.depth = n  # type: ignore[misc]
        self.branch_tokens = drafted - n  # type: ignore[misc]
        self.drafted = drafted  # type: ignore[misc]
        self.width = 1 + drafted  # type: ignore[misc]

    def nodes(self) -> tuple[Sequence[int], Sequence[int]]:
        """The row's draft as (tokens, parents): the chain's nodes first, then the branches'
        (``tree_of_draft``); a chain's without building a tree."""
        if self._nodes is None:
            return self.tokens, range(-1, len(self.tokens) - 1)
        return self._nodes

    def kept_branch(self, n: int, branch: Sequence[int]) -> bool:
        """Whether an accepted ``branch`` at ``n`` is one the drafter's draft holds (the store
        finds it there), not the head's own."""
        return any(not isinstance(b, HeadBranch) and b.at == n and
                   tuple(b.tokens[:len(branch)]) == tuple(branch) for b in self.branches)


def drafter_share(draft: StepDraft, n_accepted: int, branch: Sequence[int]) -> tuple[int, int]:
    """(draft tokens the drafter itself proposed in ``draft``, of which the verdict accepted):
    its chain and its own branches, the verifier's (the head's, a fill's: ``HeadBranch``es)
    left out. The verdict accepted ``n_accepted`` chain tokens, then ``branch`` (the drafter's
    when its draft holds that branch there)."""
    if not draft.branches or not any(isinstance(b, HeadBranch) for b in draft.branches):
        return draft.drafted, n_accepted + len(branch)
    own = [b for b in draft.branches if not isinstance(b, HeadBranch)]
    nodes = len(tree_of_draft(list(draft.tokens), own).tokens) if own else len(draft.tokens)
    # of the accepted branch, the longest start one of the drafter's own branches there holds
    # (the head's may go on past the drafter's)
    taken = max([accepted_prefix(b.tokens, branch) for b in own if b.at == n_accepted],
                default=0) if branch else 0
    return nodes, n_accepted + taken


def drafter_row(act: ActiveSession, taken: TakenDraft, drafter: Proposal | None,
                offers: Mapping[str, tuple[int, ...] | None] | None = None) -> StepDraft:
    """A session's row from the drafter's proposal (None: left out this step): its chain, and
    its branches unless the session is verified loosely (loose verification walks chains)."""
    drafter = drafter or NO_PROPOSAL
    branches = drafter.branches if verifies_trees(act.verify) else ()
    return StepDraft(act, taken.epoch, taken.start, drafter.tokens, branches, offers=offers)


def taken_row(act: ActiveSession, taken: TakenDraft) -> StepDraft:
    """``drafter_row`` of the drafter's draft as the store gave it (``DrafterProposer``'s
    proposal), built without the proposal between: a step with no other source."""
    branches = tuple(taken.branches) if taken.branches and verifies_trees(act.verify) else ()
    return StepDraft(act, taken.epoch, taken.start, tuple(taken.tokens), branches)


def with_head(row: StepDraft, head: Proposal | None, room: int) -> StepDraft:
    """``row`` with the head's proposal as branches, within ``room`` draft tokens: its chain
    from where it leaves the row's chain, then its own branches (alternatives to one of its
    chain tokens) each as far as room remains; not for a session verified loosely (chains
    only). A head branch past where the head's chain leaves the row's repeats that chain's
    tokens up to it (the draft tree shares them: ``tree_of_draft``)."""
    head = head or NO_PROPOSAL
    offer = head.tokens[:max(0, room)]
    if not offer or not verifies_trees(row.act.verify):
        return row
    extra = head_branch(row.tokens, offer)
    branches = list(row.branches)
    leaves = len(offer)  # where the head's chain leaves the row's
    if extra is not None:
        branches.append(extra)
        leaves = extra.at
        room -= len(extra.tokens)
    for b in head.branches:
        if not 0 <= b.at < len(offer) or len(b.tokens) > room:
            continue  # hangs from a chain token cut away, or no room
        if b.at < leaves:  # an alternative to a token the row's chain holds
            branches.append(HeadBranch(b.at, b.tokens))
        else:
            branches.append(HeadBranch(leaves, (*offer[leaves:b.at], *b.tokens)))
        room -= len(b.tokens)
    return replace(row, branches=tuple(branches), head_offer=offer)
