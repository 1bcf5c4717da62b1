"""A step's rows from the proposers' drafts (``engine.proposals``: a drafter's branches kept for
exact sessions only, a head's alternatives joining the tree within the room) and the one cut a
verdict gets where the output ends (``engine.decisions``), on hand-made drafts and verdicts."""

from __future__ import annotations

import pytest

from edgespec.drafters.adaptive import DraftLength
from edgespec.engine.decisions import decide
from edgespec.engine.generation import ActiveSession, Request
from edgespec.engine.proposals import (DrafterProposer, HeadBranch, StepDraft, drafter_row,
                                       with_head)
from edgespec.protocol.contract import Branch, Proposal, TakenDraft, Verdict

START = 10


def _session(verify: str = "exact") -> ActiveSession:
    act = ActiveSession("s", Request([1, 2, 3], max_new_tokens=50), 0, DraftLength(4))
    act.verify = verify
    return act


def _row(tokens, branches=(), verify="exact") -> StepDraft:
    return StepDraft(_session(verify), 3, START, tuple(tokens), tuple(branches))


# -- propose --------------------------------------------------------------------------------------
def test_the_drafter_row_keeps_branches_for_exact_sessions_only():
    taken = TakenDraft(3, START, [5, 6, 7], [Branch(1, (9, 9))])
    proposal = DrafterProposer().propose("s", taken)
    assert proposal == Proposal((5, 6, 7), (Branch(1, (9, 9)),))
    exact = drafter_row(_session("exact"), taken, proposal)
    loose = drafter_row(_session("loose"), taken, proposal)
    assert (exact.tokens, exact.branches, exact.epoch, exact.start) == \
        ((5, 6, 7), (Branch(1, (9, 9)),), 3, START)
    assert (loose.tokens, loose.branches) == ((5, 6, 7), ())
    assert exact.width == 1 + 3 + 2 and loose.width == 1 + 3
    assert drafter_row(_session(), taken, None).tokens == ()  # left out by --auto


def test_the_heads_alternatives_join_the_tree_within_the_room():
    row = _row([5, 6, 7])
    alts = (Branch(0, (4,)), Branch(1, (6,)), Branch(2, (3,)))  # beside head tokens 5, 8, 9
    joined = with_head(row, Proposal((5, 8, 9), alts), room=10)
    assert joined.branches == (HeadBranch(1, (8, 9)), HeadBranch(0, (4,)), HeadBranch(1, (6,)),
                               HeadBranch(1, (8, 3)))
    tokens, parents = joined.nodes()  # 6 is the chain's own node; 8 is shared by two branches
    assert list(tokens) == [5, 6, 7, 8, 9, 4, 3] and list(parents) == [-1, 0, 1, 0, 3, -1, 3]
    assert joined.branch_tokens == 4 and joined.drafted == 7 and joined.width == 8
    cut = with_head(row, Proposal((5, 8, 9), alts), room=3)
    assert cut.branches == (HeadBranch(1, (8, 9)), HeadBranch(0, (4,)))
    short = with_head(row, Proposal((5, 8, 9), alts), room=1)  # only (5,): the chain has it
    assert short.branches == (HeadBranch(0, (4,)),) and short.head_offer == (5,)
    alone = with_head(_row([]), Proposal((5, 8), (Branch(1, (2,)),)), room=10)
    assert alone.branches == (HeadBranch(0, (5, 8)), HeadBranch(0, (5, 2)))
    assert alone.nodes() == ((5, 8, 2), (-1, 0, 0))
    loose = _row([5, 6, 7], verify="loose")
    assert with_head(loose, Proposal((4,), (Branch(0, (3,)),)), room=10) is loose


def test_the_heads_proposal_joins_as_a_branch_where_it_leaves_the_chain():
    row = _row([5, 6, 7])
    joined = with_head(row, Proposal((5, 8, 9)), room=10)
    assert joined.branches == (HeadBranch(1, (8, 9)),) and joined.head_offer == (5, 8, 9)
    assert not joined.kept_branch(1, (8, 9))  # the head's own: the store does not hold it
    held = with_head(row, Proposal((5, 6)), room=10)  # the chain already holds it
    assert held.branches == () and held.head_offer == (5, 6)
    assert with_head(row, Proposal((4, 4, 4)), room=2).branches == (HeadBranch(0, (4, 4)),)
    assert with_head(row, Proposal((4,)), room=0) is row
    assert with_head(row, None, room=10) is row
    loose = _row([5, 6, 7], verify="loose")
    assert with_head(loose, Proposal((4,)), room=10) is loose  # loose rows stay chains


def test_a_drafters_branch_is_kept_and_the_heads_is_not():
    row = _row([5, 6], [Branch(1, (8, 2))])
    assert row.kept_branch(1, (8,)) and row.kept_branch(1, (8, 2))
    assert not row.kept_branch(0, (8,)) and not row.kept_branch(1, (9,))


# -- decide ---------------------------------------------------------------------------------------
def _verdict(n, token, branch=(), own=False) -> Verdict:
    return Verdict("s", 3, START, n, token, branch=tuple(branch), own_branch=own)


def test_a_verdict_inside_the_output_is_taken_as_it_is():
    row = _row([5, 6, 7])
    d = decide(row, _verdict(2, 9), room=50, stop_ids={0})
    assert d.verdict == _verdict(2, 9) and d.new == [5, 6, 9] and d.accepted == 2


@pytest.mark.parametrize("room, stops, n, token, finish", [
    (50, {6}, 1, 6, "stop"),  # a stop token inside the accepted run ends it there
    (50, {9}, 2, 9, "stop"),  # the target's own token is a stop token
    (2, set(), 1, 6, "length"),  # the limit falls inside the accepted run
    (3, set(), 2, 9, "length"),  # the limit falls on the target's token
])
def test_a_verdict_is_cut_once_where_the_output_ends(room, stops, n, token, finish):
    d = decide(_row([5, 6, 7]), _verdict(2, 9), room, stops)
    assert (d.verdict.n_accepted, d.verdict.token, d.verdict.finish_reason) == (n, token, finish)
    assert d.new == [5, 6, 9][:n] + [token] and d.verdict.end == START + n + 1


def test_a_cut_inside_a_branch_keeps_the_branchs_head_and_its_owner():
    row = _row([5, 6], [HeadBranch(1, (8, 2, 4))])
    d = decide(row, _verdict(1, 7, branch=(8, 2, 4), own=True), room=3, stop_ids=set())
    assert d.verdict == Verdict("s", 3, START, 1, 2, "length", branch=(8,), own_branch=True)
    cut = decide(row, _verdict(1, 7, branch=(8, 2, 4), own=True), room=1, stop_ids=set())
    assert cut.verdict == Verdict("s", 3, START, 0, 5, "length")  # no branch left to own
