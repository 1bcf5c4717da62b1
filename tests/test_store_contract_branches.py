"""The session protocol's rules for token trees' branches, held against both stores (the
in-process and the Redis one, embedded and external; ``tests/store_sides``): branches kept are
alternatives to kept tokens, cut and bounded, taken within the budget, kept ahead by a held
commit and dropped by a fix; a verdict that takes a branch is a fix carrying its tokens, refused
when the draft does not hold it, unless the branch is the verifier's own."""

from __future__ import annotations

import pytest
from store_sides import PROMPT, commit, new, side, take  # noqa: F401

from edgespec.protocol.contract import (MAX_BRANCH_TOKENS, MAX_BRANCHES, Branch, Verdict)


def test_branches_kept_are_alternatives_to_kept_tokens_cut_and_bounded(side):
    new(side)
    long = tuple(range(20, 20 + MAX_BRANCH_TOKENS + 3))
    kept = side.push("s", 0, 3, [10, 11, 12], window=2, branches=[
        Branch(0, long),  # cut to MAX_BRANCH_TOKENS
        Branch(1, (11, 30)),  # the chain's own token: not an alternative
        Branch(0, (20, 99)),  # repeats the first branch's alternative at 0
        Branch(2, (31,)),  # an alternative to a token the window dropped
        Branch(1, (32,)), Branch(5, (33,)), Branch(0, ())])
    assert kept == 2
    t = take(side, k=8, budget=64)
    assert t.branches == [Branch(0, long[:MAX_BRANCH_TOKENS]), Branch(1, (32,))]
    many = [Branch(0, (40 + i,)) for i in range(MAX_BRANCHES + 4)]
    side.push("s", 0, 5, [13], branches=[Branch(0, (50,))])
    side.push("s", 0, 6, [14], branches=many)
    assert len(take(side, budget=64).branches) == MAX_BRANCHES


def test_branches_are_taken_within_the_budget_and_the_taken_chain(side):
    new(side)
    side.push("s", 0, 3, [10, 11, 12, 13], branches=[Branch(0, (20, 21, 22)),
                                                      Branch(2, (23,)), Branch(3, (24,))])
    assert take(side, k=3, budget=4).branches == [Branch(0, (20, 21, 22)), Branch(2, (23,))]
    assert take(side, k=3, budget=2).branches == [Branch(0, (20, 21))]
    assert take(side, k=3, budget=0).branches == []
    assert take(side, k=1, budget=8).branches == [Branch(0, (20, 21, 22))]


def test_a_held_commit_keeps_the_branches_ahead_and_a_fix_drops_them(side):
    new(side)
    side.push("s", 0, 3, [10, 11, 12, 13], branches=[Branch(0, (20,)), Branch(3, (25,))])
    [out] = commit(side, Verdict("s", 0, 3, 1, 11))  # 10 accepted, 11 the draft's: held
    assert out.fix is None
    t = take(side, budget=8)
    assert (t.start, t.tokens, t.branches) == (5, [12, 13], [Branch(1, (25,))])
    [out] = commit(side, Verdict("s", 0, 5, 0, 99))
    assert out.fix is not None and take(side, budget=8).branches == []


def test_a_draft_committed_to_its_end_leaves_no_branch_for_a_later_draft(side):
    """A held commit keeps only the branches ahead of it, so a draft used up holds none: the
    fix that follows (on an empty draft, where the Redis store drops nothing) leaves the next
    epoch's draft without branches of the old one, and all the room for its own (a branch
    left behind would take a place of the MAX_BRANCHES a draft keeps, unseen by any take)."""
    new(side)
    side.push("s", 0, 3, [10, 11, 12], branches=[Branch(0, (20,)), Branch(2, (22,))])
    assert commit(side, Verdict("s", 0, 3, 1, 11))[0].fix is None  # draft [12], branch at 5
    assert take(side, budget=8).branches == [Branch(0, (22,))]
    assert commit(side, Verdict("s", 0, 5, 0, 12))[0].fix is None  # the draft used up
    t = take(side, budget=8)
    assert (t.start, t.tokens, t.branches) == (6, [], [])
    [out] = commit(side, Verdict("s", 0, 6, 0, 99))
    assert out.fix is not None and out.fix.epoch == 1
    assert side.push("s", 1, 7, [40, 41]) == 2
    t = take(side, budget=8)
    assert (t.epoch, t.start, t.tokens, t.branches) == (1, 7, [40, 41], [])
    assert side.tokens("s") == [1, 2, 3, 10, 11, 12, 99]
    many = [Branch(0, (60 + i,)) for i in range(MAX_BRANCHES)]
    assert side.push("s", 1, 9, [42], branches=many) == 1
    t = take(side, budget=64)
    assert t.tokens == [40, 41, 42] and len(t.branches) == MAX_BRANCHES


def test_a_verdict_that_takes_a_branch_is_a_fix_carrying_its_tokens(side):
    new(side)
    side.push("s", 0, 3, [10, 11, 12], branches=[Branch(1, (20, 21, 22))])
    [out] = commit(side, Verdict("s", 0, 3, 1, 7, branch=(20, 21)))
    assert out.fix is not None and (out.fix.epoch, out.fix.position, out.fix.tokens) == \
        (1, 4, (20, 21, 7))
    assert side.tokens("s") == [1, 2, 3, 10, 20, 21, 7]
    assert side.fixes("s") == [(1, 4, (20, 21, 7))]
    t = take(side, budget=8)
    assert (t.epoch, t.tokens, t.branches) == (1, [], [])


@pytest.mark.parametrize("verdict", [Verdict("s", 0, 3, 1, 7, branch=(21,)),
                                     Verdict("s", 0, 3, 0, 7, branch=(20,)),
                                     Verdict("s", 0, 3, 1, 7, branch=(20, 21, 22, 23))],
                         ids=["other tokens", "other position", "longer than held"])
def test_a_verdict_that_takes_a_branch_the_draft_does_not_hold_is_refused(side, verdict):
    new(side)
    side.push("s", 0, 3, [10, 11, 12], branches=[Branch(1, (20, 21, 22))])
    [out] = commit(side, verdict)
    assert not out.ok and out.fix is None
    assert side.tokens("s") == PROMPT
    assert take(side, budget=8).branches == [Branch(1, (20, 21, 22))]


@pytest.mark.parametrize("n, branch", [(1, (30, 31)), (3, (40, 41)), (0, (50,))],
                         ids=["inside the draft", "past the draft's end", "at its first token"])
def test_the_verifiers_own_branch_is_committed_as_a_fix(side, n, branch):
    """A draft head's proposal (own_branch) is no branch of the draft: committed all the same,
    as a fix carrying its tokens, wherever it starts within or right after the draft."""
    new(side)
    side.push("s", 0, 3, [10, 11, 12], branches=[Branch(1, (20, 21))])
    [out] = commit(side, Verdict("s", 0, 3, n, 7, branch=branch, own_branch=True))
    assert out.fix is not None and (out.fix.epoch, out.fix.position, out.fix.tokens) == \
        (1, 3 + n, (*branch, 7))
    assert side.tokens("s") == [1, 2, 3, *[10, 11, 12][:n], *branch, 7]
    t = take(side, budget=8)
    assert (t.epoch, t.tokens, t.branches) == (1, [], [])


def test_branches_are_capped_before_the_window_cuts_the_chunk(side):
    """More candidate branches than a draft keeps, some at tokens the window drops: both stores
    cap the chunk's branches first, then keep those of kept tokens."""
    new(side)
    many = [Branch(2, (40 + i,)) for i in range(MAX_BRANCHES)] + [Branch(0, (60,))]
    assert side.push("s", 0, 3, [10, 11, 12], window=2, branches=many) == 2
    assert take(side, budget=64).branches == []  # the cap kept only alternatives to token 2
