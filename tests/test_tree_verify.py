"""Token trees: the tree forward against chains, tree verification against the chain verifiers,
whole generations through trees against target-only decoding, compaction of the accepted path,
and refusal of malformed trees."""

import random

import pytest
import torch
from conftest import hf_greedy, make_tiny_model

from edgespec.config import EngineConfig, SamplingParams
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.models.loading import load_model
from edgespec.runner.target_runner import TargetRunner
from reference import path_to, process_logits, step_tree, trie

from edgespec.verify.keyed_noise import keyed_choice
from oracles import filtered_logits, verify_greedy, verify_keyed
from edgespec.verify.trees import DraftTree
from oracles import TreeVerdict, verify_tree

PROMPTS = [
    [1, 10, 11, 12, 13, 10, 11, 12, 13, 10],
    [1, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61],
    [1, 30, 31, 30, 31, 30],
]
SEEDED = [SamplingParams(temperature=1.0, seed=5),
          SamplingParams(temperature=0.7, top_k=10, top_p=0.9, seed=2 ** 62 + 3)]


@pytest.fixture(scope="module")
def runner(tiny):
    return TargetRunner(tiny.model, n_slots=4, max_len=128)


def _prefilled(runner, prompt):
    slot = runner.new_slot()
    runner.prefill(slot, prompt[:-1])
    return slot


# -- the tree's shape -----------------------------------------------------------------------------
def test_tree_helpers():
    tree = trie([[5, 6, 7], [5, 8], [9], [5, 6, 4]])
    assert tree.tokens == (5, 6, 7, 8, 9, 4) and tree.parents == (-1, 0, 1, 0, -1, 1)
    assert tree.depths() == [1, 2, 3, 2, 1, 3]
    assert tree.children() == {-1: [0, 4], 0: [1, 3], 1: [2, 5]}
    assert path_to(tree, 5) == [0, 1, 5] and path_to(tree, -1) == []
    chain = DraftTree.chain([3, 4, 5])
    assert chain.parents == (-1, 0, 1) and chain.depths() == [1, 2, 3]
    assert len(DraftTree.chain([])) == 0


@pytest.mark.parametrize("tokens, parents, match", [
    ([1, 2], [-1], "one parent per token"),
    ([1, 2], [-1, 1], r"parents\[1\]"),  # its own parent
    ([1, 2], [-1, 2], r"parents\[1\]"),  # a later node
    ([1, 2], [-2, 0], r"parents\[0\]"),
    ([1, 2], [0, -1], r"parents\[0\]"),  # the first node can only hang from the root
    ([1, 2], [-1, 0.5], r"parents\[1\]"),
    ([1, 2], [-1, True], r"parents\[1\]"),
    ([1, -3], [-1, 0], r"tokens\[1\]"),
    ([1, "a"], [-1, 0], r"tokens\[1\]"),
    ([1, None], [-1, 0], r"tokens\[1\]"),
])
def test_malformed_trees_are_refused(tokens, parents, match):
    with pytest.raises(ValueError, match=match):
        DraftTree(tokens, parents)


def test_a_runner_refuses_a_malformed_call_and_moves_nothing(tiny, runner):
    vocab = tiny.model.config.vocab_size
    # the runner trusts its trees' ids: they are checked once, where drafts enter (the stores)
    slot = _prefilled(runner, PROMPTS[0])
    try:
        with pytest.raises(ValueError, match="one root and one tree per slot"):
            runner.forward_tree([slot], [5, 6], [DraftTree.chain([1])])
        with pytest.raises(ValueError, match="increasing"):
            runner.compact(slot, [2, 1])
        assert runner.cache.lengths[slot] == len(PROMPTS[0]) - 1  # nothing moved
        with pytest.raises(ValueError, match=r"logits \[3, V\]"):
            verify_tree(torch.zeros(2, vocab), DraftTree.chain([1, 2]), SamplingParams(), 5)
    finally:
        runner.free_slot(slot)


def test_paths_of_many_slots_move_into_place_in_one_call_as_one_at_a_time(tiny):
    """``compact_many`` over three slots (two paths off the chain, one along it) leaves every
    slot's keys, values and length as ``compact`` one slot at a time does; a malformed path is
    refused alone, its slot untouched."""
    tree = DraftTree((5, 6, 7, 8, 9), (-1, 0, -1, 2, 3))
    paths = [[2, 3, 4], [0, 1], [2, 3]]

    def scored():
        r = TargetRunner(tiny.model, n_slots=4, max_len=128)
        slots = [_prefilled(r, p) for p in PROMPTS]
        r.forward_tree(slots, [p[-1] for p in PROMPTS], [tree] * 3)
        return r, slots

    one, slots = scored()
    for slot, path in zip(slots, paths):
        one.compact(slot, path)
    many, slots2 = scored()
    bad = many.new_slot()
    many.prefill(bad, [1, 2, 3])
    errors = many.compact_many([*zip(slots2, paths), (bad, [3, 1])])
    assert errors[:3] == [None] * 3 and isinstance(errors[3], ValueError)
    assert many.cache.lengths[bad] == 3
    twice = many.compact_many([(bad, [0]), (bad, [0])])  # one slot placed twice in one call
    assert twice[0] is None and isinstance(twice[1], ValueError)
    assert many.cache.lengths[bad] == 5
    for slot, slot2 in zip(slots, slots2):
        assert one.cache.lengths[slot] == many.cache.lengths[slot2]
        n = one.cache.lengths[slot]
        for a, b in zip(one.cache.k + one.cache.v, many.cache.k + many.cache.v):
            assert torch.equal(a[slot, :, :n], b[slot2, :, :n])


# -- verification maths ---------------------------------------------------------------------------
def test_a_chain_as_a_tree_gives_the_chain_verdict():
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    V = 20
    for trial in range(300):
        T = rng.randrange(0, 6)
        logits = torch.randn(T + 1, V, generator=g) * 3
        start = rng.randrange(1, 1000)
        params = SEEDED[trial % 2] if trial % 3 else SamplingParams()
        if params.greedy:
            target = logits.argmax(-1).tolist()
        else:
            scores = filtered_logits(logits, params)
            target = [keyed_choice(scores[i], params.seed, start + i) for i in range(T + 1)]
        # follow the target for a while, then (maybe) go wrong
        cut = rng.randrange(0, T + 1)
        draft = target[:cut] + [rng.randrange(V) for _ in range(T - cut)]
        if params.greedy:
            n, token = verify_greedy(target, draft)
        else:
            n, token = verify_keyed(filtered_logits(logits, params), draft, params.seed, start)
        got = verify_tree(logits, DraftTree.chain(draft), params, start)
        assert got == TreeVerdict(list(range(n)), draft[:n], token)


def test_the_walk_takes_the_branch_the_target_chooses():
    V = 10
    logits = torch.full((8, V), -5.0)
    # rows: root, then nodes 0..6 of the tree below; the target's argmax in each row
    for row, best in enumerate([3, 9, 4, 0, 1, 6, 2, 8]):
        logits[row, best] = 5.0
    #   root -> 3 (node 0) -> 4 (node 1)
    #        -> 3 (node 2, a duplicate: never reached, the first child wins)
    #        -> 7 (node 3)
    #   node 0 -> 4 (node 4) -> 6 (node 5) -> 2 (node 6)
    tree = DraftTree([3, 4, 3, 7, 4, 6, 2], [-1, 0, -1, -1, 0, 4, 5])
    # argmax after node 0 is 9: neither child (4, 4) matches, so the walk stops there
    assert verify_tree(logits, tree, SamplingParams(), 10) == TreeVerdict([0], [3], 9)
    logits[1, 9], logits[1, 4] = -5.0, 5.0  # now node 0's target is 4: node 1 (the first 4)
    assert verify_tree(logits, tree, SamplingParams(), 10) == TreeVerdict([0, 1], [3, 4], 4)
    assert verify_tree(logits, DraftTree([], []), SamplingParams(), 10) == TreeVerdict([], [], 3)


# -- the tree forward -----------------------------------------------------------------------------
BRANCHES = [[40, 41, 42], [40, 43], [50, 51, 52, 53], [50, 51, 60], [70]]


def test_tree_logits_are_each_branchs_chain_logits(runner):
    prompt = list(range(10, 30))
    tree = trie(BRANCHES)
    s, c = _prefilled(runner, prompt), _prefilled(runner, prompt)
    try:
        out = runner.forward_tree([s], [prompt[-1]], [tree])[0]
        assert out.shape == (1 + len(tree), runner.vocab_size)
        assert runner.cache.lengths[s] == len(prompt) - 1  # the pointer stays at the root
        for leaf in range(len(tree)):
            path = path_to(tree, leaf)
            chain = runner.forward([c], [[prompt[-1]] + [tree.tokens[i] for i in path]])[0]
            rows = out[[0] + [1 + i for i in path]]
            assert torch.allclose(rows, chain, atol=1e-5)
            assert torch.equal(rows.argmax(-1), chain.argmax(-1))
    finally:
        runner.free_slot(s)
        runner.free_slot(c)


def test_batched_tree_forward_equals_one_by_one(runner):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (5, 17, 9)]
    trees = [trie(BRANCHES), DraftTree([], []),
             trie([[7, 8], [7, 9, 10, 11, 12, 13, 14], [6]])]
    alone = []
    for p, t in zip(prompts, trees):
        s = _prefilled(runner, p)
        alone.append(runner.forward_tree([s], [p[-1]], [t])[0])
        runner.free_slot(s)
    slots = [_prefilled(runner, p) for p in prompts]
    order = [2, 0, 1]  # not an ascending run of slots: the gathering read path
    try:
        batch = runner.forward_tree([slots[i] for i in order], [prompts[i][-1] for i in order],
                                    [trees[i] for i in order])
        for b, i in enumerate(order):
            n = 1 + len(trees[i])
            assert torch.allclose(batch[b, :n], alone[i], atol=1e-5)
            assert torch.equal(batch[b, :n].argmax(-1), alone[i].argmax(-1))
    finally:
        for s in slots:
            runner.free_slot(s)


def test_compaction_leaves_the_kv_a_chain_decode_of_the_path_leaves(tiny, runner):
    """A path through a branch: the verdict is decoding's, and after compaction the slot holds
    bit for bit what decoding the same tokens one at a time leaves (the branch's keys were
    computed with its ancestors read in decoding order), so the next logits agree exactly."""
    prompt = PROMPTS[1]
    ref = hf_greedy(tiny.model, prompt, 5)
    assert len(ref) == 5
    wrong = [(t + 1) % runner.vocab_size for t in ref]
    # the accepted branch leaves the chain at depth 3 and comes last: its nodes must move
    tree = trie([[ref[0], ref[1], wrong[2]], [ref[0], wrong[1]],
                                    [ref[0], ref[1], ref[2], ref[3]]])
    s, c = _prefilled(runner, prompt), _prefilled(runner, prompt)
    try:
        verdict = step_tree(runner, s, prompt[-1], tree, SamplingParams())
        assert verdict.path == [0, 1, 4, 5]
        assert verdict.tokens == ref[:4] and verdict.token == ref[4]
        for i, t in enumerate([prompt[-1]] + ref[:4]):
            runner.forward([c], [[t]])
            runner.commit(c, len(prompt) + i)
        n = runner.cache.lengths[s]
        assert n == runner.cache.lengths[c] == len(prompt) + 4
        for cache in runner.cache.k + runner.cache.v:
            assert torch.equal(cache[s, :, :n], cache[c, :, :n])
        nxt = [ref[4], 20, 21]
        assert torch.equal(runner.forward([s], [nxt])[0], runner.forward([c], [nxt])[0])
    finally:
        runner.free_slot(s)
        runner.free_slot(c)


# -- whole generations through trees --------------------------------------------------------------
def propose_tree(rng: random.Random, ref: list[int], pos: int, vocab: int) -> DraftTree:
    """2-3 branches of depth 1-4 after ``pos`` tokens of the reference continuation ``ref``:
    usually one follows ``ref``, the others leave it at a random depth; some steps have no
    correct branch at all."""
    def wrong_at(i: int) -> int:
        while True:
            t = rng.randrange(vocab)
            if pos + i >= len(ref) or t != ref[pos + i]:
                return t

    right = ref[pos:pos + rng.randint(1, 4)]
    branches = [right] if right and rng.random() < 0.75 else []
    while len(branches) < rng.randint(2, 3):
        depth = rng.randint(1, 4)
        shared = rng.randint(0, min(len(right), depth - 1))
        branch = right[:shared] + [wrong_at(shared)]
        branch += [rng.randrange(vocab) for _ in range(depth - len(branch))]
        branches.append(branch)
    rng.shuffle(branches)
    return trie(branches)


def decode_with_trees(runner, prompt, n, params, propose, stop=()):
    """Generate up to n tokens, each step verifying the tree ``propose(tokens so far)``.
    Returns (output, accepted draft tokens, steps)."""
    slot = _prefilled(runner, prompt)
    out, accepted, steps, root = [], 0, 0, prompt[-1]
    try:
        while len(out) < n:
            verdict = step_tree(runner, slot, root, propose(len(out)), params)
            steps += 1
            accepted += verdict.n_accepted
            for t in verdict.tokens + [verdict.token]:
                out.append(t)
                if t in stop or len(out) == n:
                    return out, accepted, steps
            root = verdict.token
    finally:
        runner.free_slot(slot)
    return out, accepted, steps


@pytest.mark.parametrize("model", ["tiny", "looping"])
def test_greedy_through_trees_equals_transformers_greedy(request, model):
    hf = request.getfixturevalue(model).model
    runner = TargetRunner(hf, n_slots=2, max_len=128)
    rng = random.Random(7)
    total_steps = total_out = 0
    for prompt in PROMPTS:
        ref = hf_greedy(hf, prompt, 40)
        out, accepted, steps = decode_with_trees(
            runner, prompt, 40, SamplingParams(),
            lambda pos: propose_tree(rng, ref, pos, runner.vocab_size), stop={2})
        assert out == ref
        total_steps, total_out = total_steps + steps, total_out + len(out)
    assert total_steps < 0.7 * total_out  # the trees' correct branches were really accepted


@pytest.mark.parametrize("params", SEEDED, ids=["plain", "filtered"])
def test_seeded_sampling_through_trees_equals_target_only(runner, params):
    with SpecEngine(runner, None, EngineConfig(), stop_ids=set()) as engine:
        refs = [engine.generate(Request(p, 24, params)).token_ids for p in PROMPTS]
    assert len({t for r in refs for t in r}) > 10  # really sampled
    rng = random.Random(11)
    accepted = 0
    for prompt, ref in zip(PROMPTS, refs):
        out, acc, _ = decode_with_trees(
            runner, prompt, 24, params,
            lambda pos: propose_tree(rng, ref, pos, runner.vocab_size))
        assert out == ref
        accepted += acc
    assert accepted > 12


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    return load_model(str(make_tiny_model(tmp_path_factory.mktemp("tree-sv"), seed=3, vocab=8,
                                          init_range=0.1))).model


def _tv(counts: dict, probs: dict, n: int) -> float:
    keys = set(counts) | set(probs)
    return 0.5 * sum(abs(counts.get(k, 0) / n - probs.get(k, 0.0)) for k in keys)


def test_sampled_tree_verification_follows_the_target_distribution(small_vocab):
    """Over many seeds, the first two emitted tokens are distributed as target-only sampling's
    (transformers' logits, processed), whichever nodes the tree offers. The seeds are fixed, so
    the check is deterministic; the bound is several times the expected sampling error."""
    params = dict(temperature=0.9, top_k=6)
    runner = TargetRunner(small_vocab, n_slots=1, max_len=64)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    with torch.no_grad():
        first = small_vocab(torch.tensor([prompt])).logits[0, -1:]
        p1 = process_logits(first, SamplingParams(**params))[0].tolist()
        second = {x: process_logits(small_vocab(torch.tensor([prompt + [x]])).logits[0, -1:],
                                    SamplingParams(**params))[0].tolist() for x in range(8)}
    # every token under the root; every token under three of them; one deeper chain
    top3 = sorted(range(8), key=lambda x: -p1[x])[:3]
    branches = [[x] for x in range(8)] + [[x, y] for x in top3 for y in range(8)]
    branches.append([top3[0], top3[0], 4, 5])
    tree = trie(branches)
    slot = _prefilled(runner, prompt)
    logits = runner.forward_tree([slot], [prompt[-1]], [tree])[0]
    start = len(prompt)
    n = 4000
    c1, c2 = {}, {}
    for seed in range(n):
        v = verify_tree(logits, tree, SamplingParams(**params, seed=seed), start)
        # every token hangs from the root, so the first is always accepted and the second is
        # either accepted too (under top3) or the token emitted after a leaf
        x, y = (v.tokens + [v.token])[:2]
        c1[x] = c1.get(x, 0) + 1
        c2[x, y] = c2.get((x, y), 0) + 1
    assert sum(c1.get(x, 0) for x in range(8) if p1[x] == 0) == 0  # top-k respected
    assert _tv(c1, dict(enumerate(p1)), n) < 0.05
    pj = {(x, y): p1[x] * second[x][y] for x in range(8) for y in range(8)}
    assert _tv(c2, pj, n) < 0.1
