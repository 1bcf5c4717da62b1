"""Tree proposals (``propose_tree``) of MaG, Cacheback, mag+cacheback, model and llama.cpp
drafters: width 1 is exactly ``propose``; wider trees keep ``propose``'s chain and learned state
and add valid branches; constructed inputs give the expected alternatives."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from edgespec.config import SamplingParams
from edgespec.drafters.base import Branch, Draft
from edgespec.drafters.cacheback import CachebackDrafter
from edgespec.drafters.mag import MaGDrafter, match_branches
from edgespec.drafters.logits_session import BranchPicker
from edgespec.drafters.model import ModelDrafter
from edgespec.drafters.token_choice import processed_scores, softmax
from edgespec.runner.target_runner import TargetRunner

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, seed=3)


def check_tree(draft: Draft, chain: list[int], k: int, width: int) -> None:
    """``draft`` has ``chain`` as its chain and branches that keep the ``Branch`` contract."""
    assert draft.tokens == chain
    assert len(draft.branches) <= max(0, width - 1)
    seen = set()
    for b in draft.branches:
        assert isinstance(b, Branch)
        assert 0 <= b.at < len(chain)
        assert 1 <= len(b.tokens) <= k
        assert all(isinstance(t, int) for t in b.tokens)
        assert b.tokens[0] != chain[b.at]
        assert (b.at, b.tokens[0]) not in seen
        seen.add((b.at, b.tokens[0]))


def learned(drafter):
    """What a drafter has learned, with each leader's recency (so a touched leader shows:
    MaG's stamp of its last use, Cacheback's place in its LRU order)."""
    if isinstance(drafter, MaGDrafter):
        return [(a, dict(e.counts), e.total, e.used)
                for a, e in drafter.bigrams._followers.items()]
    if isinstance(drafter, CachebackDrafter):
        return [list(drafter.table._followers.items()),
                list(drafter.fleet_mirror._followers.items())]
    return None  # model drafters learn nothing


def session_state(s):
    if hasattr(s, "table") and not hasattr(s, "runner"):  # Cacheback: its own table too
        return s.tokens, list(s.table._followers.items())
    return s.tokens


def lockstep(make, prompt: list[int], rng: random.Random, steps: int, params=GREEDY,
             vocab: int = 12) -> int:
    """Two equal drafters, one drafting with ``propose`` and one with ``propose_tree``, take the
    same verifier fixes: the chains, the sessions and what the drafters learn stay equal.
    Returns how many branches were offered."""
    plain, tree = make(), make()
    a, b = plain.open(prompt, params), tree.open(prompt, params)
    offered = 0
    try:
        for _ in range(steps):
            k, width = rng.randint(0, 6), rng.randint(1, 5)
            base = len(a.tokens)
            chain = a.propose(k)
            draft = b.propose_tree(k, width)
            check_tree(draft, chain.tokens, k, width)
            if width <= 1:
                assert draft.branches == []
            offered += len(draft.branches)
            assert session_state(a) == session_state(b)
            assert learned(plain) == learned(tree)
            # the verifier keeps a prefix and sends its own token
            kept = rng.randint(0, len(chain.tokens))
            fix = rng.randrange(vocab)
            for s in (a, b):
                s.rollback(base + kept)
                s.append([fix])
            assert session_state(a) == session_state(b)
            assert learned(plain) == learned(tree)
    finally:
        a.close(), b.close()
    return offered


# -- MaG ------------------------------------------------------------------------------------------

def test_mag_width_one_is_propose_and_trees_keep_the_chain():
    offered = 0
    for seed in range(12):
        rng = random.Random(seed)
        prompt = [rng.randrange(6) for _ in range(rng.randint(1, 80))]
        min_ngram = rng.choice((1, 2))
        offered += lockstep(lambda: MaGDrafter(min_ngram=min_ngram), prompt, rng, 12, vocab=6)
    assert offered > 0  # repetitive input: there were alternatives to offer


def test_mag_branches_offer_the_other_occurrences_most_recent_first():
    seq = [1, 2, 3, 7, 8, 9, 20, 1, 2, 3, 4, 6, 9, 30, 1, 2, 3, 4, 5, 8, 31, 1, 2, 3]
    s = MaGDrafter(tokens_per_match_token=2).open(seq, GREEDY)
    draft = s.propose_tree(4, 3)
    assert draft.tokens == [4, 5, 8, 31]  # the most recent occurrence of 1 2 3
    # the older ones: 1 2 3 4 6 9 30 differs at draft position 1, 1 2 3 7 8 9 20 at 0
    assert draft.branches == [Branch(1, (6, 9, 30)), Branch(0, (7, 8, 9, 20))]
    assert s.tokens == seq + [4, 5, 8, 31]  # branches are not the session's belief
    s2 = MaGDrafter(tokens_per_match_token=2).open(seq, GREEDY)
    assert s2.propose_tree(4, 2).branches == [Branch(1, (6, 9, 30))]  # width - 1 at most


def test_mag_branches_prefer_longer_matches_and_are_not_repeated():
    seq = [1, 2, 3, 70, 71, 0, 2, 3, 50, 51, 1, 2, 3, 60, 61, 7, 2, 3, 40, 41,
           5, 2, 3, 40, 41, 1, 2, 3]
    s = MaGDrafter().open(seq, GREEDY)
    draft = s.propose_tree(2, 8)
    assert draft.tokens == [60, 61]
    # 1 2 3 70 (a 3-token match, older) before 2 3 40 and 2 3 50 (2-token matches); 2 3 40
    # occurs twice and is offered once
    assert draft.branches == [Branch(0, (70, 71)), Branch(0, (40, 41)), Branch(0, (50, 51))]


def test_mag_branches_keep_the_per_match_length_limit():
    arr = np.array([9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 9])  # only "9" matches, once
    # a one-token match drafts at most tokens_per_match_token tokens, its branches too
    assert match_branches(arr, [5, 5], 8, 8, 1, 2, 4) == [Branch(0, (1, 2))]
    assert match_branches(arr, [1, 5], 8, 8, 1, 2, 4) == [Branch(1, (2,))]
    assert match_branches(arr, [1, 2], 8, 8, 1, 2, 4) == []  # the same continuation
    assert match_branches(arr, [], 8, 8, 1, 2, 4) == []


def test_mag_bigram_fallback_offers_the_runner_up_follower():
    d = MaGDrafter(min_ngram=2)
    # 5 -> 6 three times, 5 -> 7 twice (share 0.4 >= 0.5 / 2); 6, 7 -> 0; 0 -> 5
    d.open([5, 6, 0, 5, 6, 0, 5, 6, 0, 5, 7, 0, 5, 7, 0], GREEDY)
    s = d.open([1, 5], GREEDY)
    draft = s.propose_tree(3, 4)
    assert draft.tokens == [6, 0, 5]
    assert draft.branches == [Branch(0, (7,))]
    rare = MaGDrafter(min_ngram=2)
    rare.open([5, 6, 0, 5, 6, 0, 5, 6, 0, 5, 6, 0, 5, 6, 0, 5, 6, 0, 5, 7, 0], GREEDY)
    assert rare.open([1, 5], GREEDY).propose_tree(3, 4).branches == []  # 7's share is 1/7


# -- Cacheback ------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_mag", [False, True])
def test_cacheback_width_one_is_propose_and_trees_keep_the_chain(with_mag):
    offered = 0
    for seed in range(10):
        rng = random.Random(100 + seed)
        # the drafter's own table learned another session first
        history = [rng.randrange(8) for _ in range(60)]
        weak_limit = rng.choice((1, 2))

        def make():
            d = CachebackDrafter(with_mag=with_mag, weak_limit=weak_limit)
            d.table.observe(history)
            d.fleet_mirror.observe(history[::-1])
            return d

        prompt = [rng.randrange(8) for _ in range(rng.randint(1, 30))]
        offered += lockstep(make, prompt, random.Random(seed), 12, vocab=8)
    assert offered > 0


def test_cacheback_branches_take_older_followers_and_chain_on():
    d = CachebackDrafter(weak_limit=1)
    s = d.open([1, 2, 3, 4, 1, 2, 3, 5, 1, 2], GREEDY)
    draft = s.propose_tree(5, 4)
    assert draft.tokens == [3, 5, 1, 2, 3]
    # 1 2 3 was followed by 5 (the chain) and before that by 4, then 1 2 3 again
    assert draft.branches == [Branch(1, (4, 1, 2, 3))]
    assert s.tokens == [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 3]


def test_cacheback_branches_spread_over_positions_then_ranks():
    # 9 was followed by 1, 2, 3 (most recent last); 9 3 by 9
    s = CachebackDrafter(weak_limit=1).open([9, 1, 9, 2, 9, 3, 9], GREEDY)
    draft = s.propose_tree(2, 3)
    assert draft.tokens == [3, 9]
    assert draft.branches == [Branch(0, (2, 9)), Branch(0, (1, 9))]  # next most recent first
    s = CachebackDrafter(weak_limit=1).open([9, 1, 9, 2, 9, 3, 9], GREEDY)
    assert s.propose_tree(2, 2).branches == [Branch(0, (2, 9))]
    # rank 1 at every position before rank 2 anywhere
    # (4 was followed by 7, 8, 6; 4 6 by 9, 5)
    s = CachebackDrafter(weak_limit=1).open([4, 7, 4, 8, 4, 6, 9, 4, 6, 5, 2, 4], GREEDY)
    draft = s.propose_tree(2, 3)
    assert draft.tokens == [6, 5]
    assert draft.branches == [Branch(0, (8, 4)), Branch(1, (9,))]


def test_mag_cacheback_uses_mags_tree_then_cachebacks():
    seq = [1, 2, 3, 7, 8, 9, 20, 1, 2, 3, 4, 6, 9, 30, 1, 2, 3, 4, 5, 8, 31, 1, 2, 3]
    draft = CachebackDrafter(with_mag=True).open(seq, GREEDY).propose_tree(4, 3)
    assert draft.tokens == [4, 5, 8, 31]
    assert draft.branches == [Branch(1, (6, 9, 30)), Branch(0, (7, 8, 9, 20))]
    # no suffix match of two tokens in the session: Cacheback's chain and branches
    d = CachebackDrafter(with_mag=True)
    d.table.observe([1, 2, 3, 4, 1, 2, 3, 5, 1, 2])
    draft = d.open([40, 1, 2, 3], GREEDY).propose_tree(3, 3)
    assert draft.tokens == [5, 1, 2]
    assert draft.branches == [Branch(0, (4, 1, 2))]


# -- model drafters -------------------------------------------------------------------------------

def test_branch_picker_ranks_by_path_probability():
    def probs(*p):
        return np.array(p + (1e-6,) * 4)

    def pick(n):
        p = BranchPicker(n, 0.1)
        p.add(0, probs(0.6, 0.3, 0.08, 0.02), 0)
        p.add(1, probs(0.02, 0.03, 0.0, 0.5, 0.45), 3)
        return p.branches()

    # 0.3 at position 0; 0.6 * 0.45 = 0.27 at position 1; 0.08 is below the cut
    assert pick(1) == [Branch(0, (1,))]
    assert pick(3) == [Branch(0, (1,)), Branch(1, (4,))]
    p = BranchPicker(4, 0.1)  # a sampled token need not be the most likely one
    p.add(0, np.array([0.05, 0, 0, 0, 0, 0.2, 0.65, 0.1]), 5)
    assert p.branches() == [Branch(0, (6,)), Branch(0, (7,))]


@pytest.fixture(scope="module")
def draft_model(tiny_draft_dir):
    from edgespec.models.loading import load_model

    return load_model(str(tiny_draft_dir), dtype="float32")


def _model_drafter(draft_model, **kw):
    return ModelDrafter(TargetRunner(draft_model.model, n_slots=2, max_len=128), **kw)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED])
def test_model_width_one_is_propose_and_trees_keep_the_chain(draft_model, params):
    drafter = _model_drafter(draft_model, min_confidence=0.05, branch_min_prob=0.02)
    offered = lockstep(lambda: drafter, [3, 40, 41, 42, 43], random.Random(7), 8, params,
                       vocab=60)
    assert offered > 0


@pytest.mark.parametrize("params", [GREEDY, SAMPLED])
def test_model_branches_are_the_drafters_next_best_tokens(draft_model, params):
    drafter = _model_drafter(draft_model, min_confidence=0.0, branch_min_prob=0.0)
    prompt = [3, 40, 41, 42, 43]
    s = drafter.open(prompt, params)
    draft = s.propose_tree(1, 3)
    assert s.tokens == prompt + draft.tokens
    with torch.no_grad():
        logits = draft_model.model(torch.tensor([prompt])).logits[0, -1]
    if params.greedy:
        top = torch.topk(logits.softmax(-1), 3).indices.tolist()
        assert draft.tokens == top[:1]
        assert draft.branches == [Branch(0, (t,)) for t in top[1:]]
    else:  # the alternatives come from the distribution the token was sampled from
        q = softmax(processed_scores(logits.numpy(), params))
        others = sorted(((q[t], t) for t in range(len(q)) if t != draft.tokens[0]), reverse=True)
        assert draft.branches == [Branch(0, (t,)) for _, t in others[:2]]
    s.close()
    # a longer draft: branches at the drafted positions, none with improbable tokens
    strict = _model_drafter(draft_model, min_confidence=0.0, branch_min_prob=0.5)
    s = strict.open(prompt, params)
    draft = s.propose_tree(4, 4)
    check_tree(draft, draft.tokens, 4, 4)
    assert all(len(b.tokens) == 1 for b in draft.branches)
    s.close()


@pytest.mark.real_model
@pytest.mark.slow
def test_llamacpp_width_one_is_propose_and_trees_keep_the_chain():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the optional "
                        "extra: pip install \".[llamacpp]\")")
    from edgespec.drafters.llamacpp import LlamaCppDrafter

    drafter = LlamaCppDrafter("default", n_slots=2, max_len=128, n_threads=2,
                              min_confidence=0.05, branch_min_prob=0.02)
    try:
        prompt = [1, 9690, 198, 2683, 314, 253, 2011, 3165, 30]
        for params in (GREEDY, SAMPLED):
            offered = lockstep(lambda: drafter, prompt, random.Random(5), 5, params, vocab=500)
            assert offered > 0
    finally:
        drafter.close()
