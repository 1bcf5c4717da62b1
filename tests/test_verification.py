"""One verification path on the device: the same verdicts as the per-row rules (exact trees and
chains, loose chains, each row's own settings, on the device or judged on the host), the same
noise integers as the host hash, the keyed sample the host's, and top-k/top-p filtering and the
CPU argmax giving a row its bits whatever the batch, the tie or the NaN. That a step waits for
the device at most once: tests/test_verification_syncs.py."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from reference import trie

from edgespec.config import SamplingParams
from edgespec.verify.keyed_noise import (_MASK64, _signed, gumbel_of_keys, keyed_choice,
                                          position_key, position_keys)
from edgespec.verify.trees import DraftTree
from oracles import verify_tree
from edgespec.verify.verify_step import VerifyBatch, verify_step
from edgespec.verify.target_choice import NUMPY_ARGMAX_FROM, last_argmax

V = 40


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _splitmix_stream(key: int, x: int) -> int:
    """The host hash in plain Python integers: the 64-bit word behind token x's noise."""
    z = ((x + 1) * 0x9E3779B97F4A7C15 + key) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def test_device_noise_uses_the_host_hash_integers():
    seeds, positions = [0, 1, 42, -1, 2 ** 62 + 5], [0, 7, 2 ** 40, 123456]
    keys = position_keys(torch.tensor([[_signed(s)] for s in seeds]), torch.tensor([positions]))
    for i, s in enumerate(seeds):
        for j, p in enumerate(positions):
            ref = _splitmix64(_splitmix64(s & _MASK64) ^ (p & _MASK64))  # in plain integers
            assert keys[i, j].item() == _signed(ref) and position_key(s, p) == ref
    key = position_key(42, 7)
    ids = torch.tensor([0, 1, 5, 49151, 2 ** 20])
    u = (torch.tensor([_splitmix_stream(key, int(x)) >> 11 for x in ids], dtype=torch.float64)
         + 0.5) * 2.0 ** -53
    assert torch.equal(gumbel_of_keys(torch.tensor(_signed(key)), ids), -torch.log(-torch.log(u)))


def _random_tree(rng: random.Random) -> DraftTree:
    """A chain, or a trie of a few random branches (siblings hold distinct tokens)."""
    if rng.random() < 0.3:
        return DraftTree.chain([rng.randrange(V) for _ in range(rng.randint(0, 7))])
    return trie([[rng.randrange(6) for _ in range(rng.randint(1, 5))]
                                    for _ in range(rng.randint(1, 4))])


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=3),
                                    SamplingParams(temperature=0.7, top_k=6, top_p=0.9, seed=9)])
def test_one_call_gives_each_rows_own_verdict(params):
    """Random trees (chains among them) and peaked random logits, verified in one batch: each
    row's verdict is what the per-row rule gives (``verify_tree``)."""
    rng = random.Random(str(params))
    for _ in range(20):
        trees = [_random_tree(rng) for _ in range(rng.randint(1, 9))]
        N = max(len(t) for t in trees)
        logits = torch.randn(len(trees), 1 + N, V) * 3
        starts = [rng.randrange(100) for _ in trees]
        for b, t in enumerate(trees):  # make the drafts right often enough to be accepted
            for i, p in enumerate(t.parents):
                if rng.random() < 0.6:
                    logits[b, p + 1, t.tokens[i]] += 30
        vb = VerifyBatch.build([(t.tokens, t.parents) for t in trees], starts,
                               [params] * len(trees), ["exact"] * len(trees))
        out = verify_step(logits, vb)
        for b, t in enumerate(trees):
            ref = verify_tree(logits[b, :1 + len(t)], t, params, starts[b])
            assert (out.paths[b], out.tokens[b]) == (tuple(ref.path), ref.token)


def _random_chains(rng: random.Random, settings: list[SamplingParams], most: int,
                   min_nodes: int = 0):
    """1-9 random chains of 0-``most`` tokens, a setting each, logits [B, 1 + N, V] (N the
    longest chain, at least ``min_nodes``) that hold each draft token as their peak 7 times in
    10, and random start positions."""
    chains = [DraftTree.chain([rng.randrange(V) for _ in range(rng.randint(0, most))])
              for _ in range(rng.randint(1, 9))]
    params = [rng.choice(settings) for _ in chains]
    N = max(min_nodes, max(len(t) for t in chains))
    logits = torch.randn(len(chains), 1 + N, V) * 3
    for b, t in enumerate(chains):
        for i, p in enumerate(t.parents):
            if rng.random() < 0.7:
                logits[b, p + 1, t.tokens[i]] += 30
    return chains, params, logits, [rng.randrange(100) for _ in chains]


def test_a_batch_of_chains_gives_each_rows_own_verdict():
    """Chains only (a step without trees), greedy, sampled, top-k and top-p rows side by
    side: the batch is verified as chains (a node accepted with every node before it), each
    row's verdict is the per-row rule's, and a proposer sees the same accepted nodes and
    tokens as on the trees' path."""
    settings = [SamplingParams(), SamplingParams(temperature=1.0, seed=3),
                SamplingParams(temperature=0.7, top_k=6, top_p=0.9, seed=9)]
    rng = random.Random("chains")
    seen = []

    def propose(accepted, token):  # what a head would draft from: [B, N] bool, [B] long
        seen.append((accepted.clone(), token.clone()))
        return torch.stack([accepted.sum(1), token], 1)

    for _ in range(30):
        chains, params, logits, starts = _random_chains(rng, settings, 7, min_nodes=1)
        drafts = [(t.tokens, t.parents) for t in chains]
        vb = VerifyBatch.build(drafts, starts, params, ["exact"] * len(chains))
        assert vb.chains
        out = verify_step(logits, vb, propose=propose)
        for b, t in enumerate(chains):
            ref = verify_tree(logits[b, :1 + len(t)], t, params[b], starts[b])
            assert (out.paths[b], out.tokens[b]) == (tuple(ref.path), ref.token)
            assert out.proposals[b] == [len(ref.path), ref.token]
        general = VerifyBatch.build(drafts, starts, params, ["exact"] * len(chains))
        general.chains = False  # the trees' path over the same rows
        again = verify_step(logits, general, propose=propose)
        assert (again.paths, again.tokens, again.lenient) == (out.paths, out.tokens, out.lenient)
        assert torch.equal(seen[-1][0], seen[-2][0]) and torch.equal(seen[-1][1], seen[-2][1])


def test_exact_chains_judged_on_the_host_as_on_the_device():
    """A step of chains without a proposer is judged on the host (the target's choices, then
    NumPy against the host's nodes): the same paths, tokens and flags as the device's rule
    over the same rows, for greedy and sampled rows, empty drafts and a step without any
    draft (logits of one position)."""
    settings = [SamplingParams(), SamplingParams(temperature=1.0, seed=5)]
    rng = random.Random("host chains")
    for trial in range(40):
        # every tenth step: no row drafts (logits of one position)
        chains, params, logits, starts = _random_chains(rng, settings, 0 if trial % 10 == 0 else 6)
        vb = VerifyBatch.build([(t.tokens, t.parents) for t in chains], starts, params,
                               ["exact"] * len(chains))
        assert vb.chains and vb.host_nodes is not None
        host = verify_step(logits, vb)
        device = verify_step(logits, replace(vb, host_nodes=None))
        assert (host.paths, host.tokens, host.lenient) == \
            (device.paths, device.tokens, device.lenient)
        for b, t in enumerate(chains):
            ref = verify_tree(logits[b, :1 + len(t)], t, params[b], starts[b])
            assert (host.paths[b], host.tokens[b]) == (tuple(ref.path), ref.token)


def test_rows_with_their_own_settings_and_modes_in_one_call():
    """Greedy, sampled, top-k, top-p and loose rows side by side: each row's verdict is its own
    rule's (the oracles' ``verify_tree`` for exact rows, ``verify_loose`` for loose chains)."""
    from edgespec.config import LooseParams
    from oracles import verify_loose

    loose = LooseParams(entropy=0.5, window=1)
    settings = [SamplingParams(), SamplingParams(temperature=1.0, seed=5),
                SamplingParams(temperature=0.8, top_k=3, seed=6),
                SamplingParams(temperature=1.2, top_p=0.7, seed=7),
                SamplingParams(temperature=0.9, top_k=50, top_p=0.5, seed=8),
                SamplingParams(temperature=0.7, top_k=1, seed=9)]
    rng = random.Random(1)
    for _ in range(15):
        rows = []
        for p in settings:
            mode = rng.choice(["exact", "exact", "loose"])
            tree = _random_tree(rng) if mode == "exact" else \
                DraftTree.chain([rng.randrange(6) for _ in range(rng.randint(0, 6))])
            rows.append((p, mode, tree))
        N = max(len(t) for _, _, t in rows)
        logits = torch.randn(len(rows), 1 + N, V) * 2
        logits[:, :, :6] += 3  # the drafted ids are likely
        starts = [rng.randrange(50) for _ in rows]
        vb = VerifyBatch.build([(t.tokens, t.parents) for _, _, t in rows], starts,
                               [p for p, _, _ in rows], [m for _, m, _ in rows])
        out = verify_step(logits, vb, loose)
        for b, (p, mode, t) in enumerate(rows):
            if mode == "loose":
                n, token = verify_loose(logits[b, :1 + len(t)], list(t.tokens), p, starts[b],
                                        loose)
                assert (len(out.paths[b]), out.tokens[b]) == (n, token), (b, p)
            else:
                ref = verify_tree(logits[b, :1 + len(t)], t, p, starts[b])
                assert (out.paths[b], out.tokens[b]) == (tuple(ref.path), ref.token), (b, p)


def test_siblings_holding_the_same_token_give_one_path():
    """A malformed tree (an untrusted drafter's: two children of the root with the same token):
    the first of them counts, as in ``verify_tree``, so the accepted nodes stay one path."""
    tree = DraftTree((5, 5, 7, 8), (-1, -1, 0, 1))
    logits = torch.zeros(1, 5, V)
    logits[0, 0, 5] = logits[0, 1, 7] = logits[0, 2, 8] = logits[0, 3, 9] = 10
    vb = VerifyBatch.build([(tree.tokens, tree.parents)], [3], [SamplingParams()], ["exact"])
    out = verify_step(logits, vb)
    ref = verify_tree(logits[0], tree, SamplingParams(), 3)
    assert out.paths == [tuple(ref.path)] == [(0, 2)] and out.tokens == [ref.token]


def test_sampled_choices_equal_the_host_keyed_choice():
    """The keyed sample on the device equals ``keyed_choice`` (the host's) for these seeds, on
    every device present (CUDA where a GPU is)."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, 300, generator=g) * 2
    params = [SamplingParams(temperature=0.9, seed=s) for s in (1, 2, 3, 4, 5, 6)]
    for dev in devices:
        vb = VerifyBatch.build([([], [])] * 6, [10 * b for b in range(6)], params, ["exact"] * 6,
                               dev)
        out = verify_step(logits[:, :1].to(dev), vb)
        for b, p in enumerate(params):
            scores = logits[b, 0] / 0.9
            assert out.tokens[b] == keyed_choice(scores, p.seed, 10 * b), (dev, b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: the GPU sitting runs it"))])
def test_top_p_and_top_k_filtering_gives_a_row_its_bits_in_any_batch(device):
    """The processed distribution a sampled row draws from has the same bits alone and among
    up to 64 x 15 rows, with ties everywhere (scores on a coarse grid, as bfloat16 logits are)
    over a vocabulary of the 8B model's size: the sort is stable and a lone row is scanned the
    way many are."""
    V = 128256
    rows, cols = (64, 15) if device == "cuda" else (16, 8)  # the CPU sorts this much slowly
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(rows, cols, V, generator=g) * 8).round() / 4  # many exact ties
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=[0, 50][b % 2], seed=b)
              for b in range(rows)]
    from edgespec.verify.target_choice import filter_scores

    def scores(rows: int, cols: int) -> torch.Tensor:
        vb = VerifyBatch.build([([], [])] * rows, [0] * rows, params[:rows], ["exact"] * rows,
                               device)
        return filter_scores(logits[:rows, :cols].to(device), vb).cpu()

    full = scores(rows, cols)
    for r, c in ((1, 1), (1, 7), (2, 1), (8, 5), (rows, 1)):
        assert torch.equal(scores(r, c), full[:r, :c]), (r, c)


def test_top_p_cuts_tied_scores_together_whatever_their_ids():
    """Tied scores stay or go together, so the cut does not depend on the order a sort gives
    tied ids: shuffling the vocabulary shuffles the decisions, and a tie run that straddles the
    top_p mass is kept whole. The drafter's NumPy rule makes the same cut."""
    from edgespec.drafters.token_choice import processed_scores
    from edgespec.verify.target_choice import top_p_drop

    g = torch.Generator().manual_seed(9)
    scores = (torch.randn(16, 4000, generator=g) * 6).round() / 4  # runs of equal scores
    top_p = torch.full((16,), 0.8)
    drop = top_p_drop(scores, top_p)
    perm = torch.randperm(4000, generator=g)
    assert torch.equal(top_p_drop(scores[:, perm], top_p), drop[:, perm])
    for row, d in zip(scores, drop):
        kept_min = row[~d].min()
        assert not d[row == kept_min].any()  # the lowest kept score's ties are all kept
        probs = row.softmax(-1)
        assert probs[row > kept_min].sum() < 0.8 <= probs[row >= kept_min].sum() + 1e-6
        numpy_kept = processed_scores(row.numpy(), SamplingParams(temperature=1.0, top_p=0.8))
        assert torch.equal(torch.from_numpy(numpy_kept > float("-inf")), ~d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_argmax_is_torchs_on_ties_nans_and_infinities(dtype):
    """``last_argmax`` (NumPy's on the CPU) picks torch.argmax's index: the first of tied
    largest values, +0 and -0 tied, a NaN as the largest, rows all -inf, wide vocabularies."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-3, 4, (40, 3, 257), generator=g).to(dtype)  # many ties
    x[0, 0] = float("-inf")
    x[1, 0, 5] = x[1, 0, 9] = float("nan")
    x[2, 1] = 0.0
    x[2, 1, 3] = -0.0
    x[3, 2, 100] = float("inf")
    x[3, 2, 50] = float("inf")
    wide = torch.randn(2, 5, 49152, generator=g).to(dtype)
    assert x[:, :, ::2].numel() >= NUMPY_ARGMAX_FROM  # every case below takes NumPy's way
    for t in (x, wide, x[:, 1], x[:, :, ::2]):  # and a non-contiguous view
        got = last_argmax(t)
        assert got.dtype == torch.long and torch.equal(got, t.argmax(-1))
