"""Exact by construction: a session's logits have the same bits however its tokens reach the
runner: one at a time, as a draft of any length, as a token tree, in a batch with other
sessions of any lengths, after a prompt prefilled in one piece or in chunks. Compared with
``torch.equal``, never a tolerance, for every dtype edgespec serves as lossless on the devices
present (CUDA where a GPU is, else said in the skip reason).

Putting ``scaled_dot_product_attention`` back in ``TargetRunner._run_layers``, or sending a lone
row through the linear layers as it is, fails this sweep (checked when each fix went in); the
start probes are shown to catch both (the last tests)."""

from __future__ import annotations

import random

import pytest
import torch
from reference import path_to

from edgespec.runner.attention import probe_invariance
from edgespec.runner.dtype_probe import exact_here, linear_rows_exact
from edgespec.runner.linear import Linear
from edgespec.runner.target_runner import TargetRunner
from edgespec.verify.trees import DraftTree

VOCAB = 96


DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not exact_here("bfloat16"), reason="bfloat16 is not exact on this machine: never served"))]


def _devices() -> list:
    cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="no CUDA device here: the CUDA sweep runs on a GPU machine")
    return ["cpu", pytest.param("cuda", marks=cuda)]


@pytest.fixture(scope="module")
def hd64_model():
    """A two-layer Llama with the default model's widths (hidden 576, 9 heads of 64 in 3 kv
    groups, MLP 1536: a lone row once summed the 1536-wide down projection in another order),
    random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=1024, initializer_range=0.1,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def _runner(model, dtype: str, device: str, slots: int = 16) -> TargetRunner:
    import copy

    m = copy.deepcopy(model).to(device=device, dtype=getattr(torch, dtype))
    return TargetRunner(m, n_slots=slots, max_len=300)  # not a whole number of key blocks


def _one_at_a_time(runner: TargetRunner, prompt: list[int], cont: list[int]) -> torch.Tensor:
    """The reference: the prompt prefilled in one piece, then each continuation token decoded
    alone. Returns [len(cont), V]: the logits after each continuation token."""
    s = runner.new_slot()
    runner.prefill(s, prompt, chunk=len(prompt))
    out = []
    for i, t in enumerate(cont):
        out.append(runner.forward([s], [[t]])[0, 0])
        runner.commit(s, len(prompt) + i + 1)
    runner.free_slot(s)
    return torch.stack(out)


def _session(rng: random.Random, max_prompt: int = 150) -> tuple[list[int], list[int]]:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, max_prompt))]
    return prompt, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]


@pytest.fixture(params=[2, 5, 8], ids=lambda n: f"{n}threads")
def threads(request):
    """torch's thread count: it decides where each thread's share of a pointwise op ends (5
    threads once left silu's last elements of a share to scalar code)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_chains_in_ragged_batches_have_the_bits_of_one_at_a_time(hd64_model, dtype, device,
                                                                 threads):
    runner = _runner(hd64_model, dtype, device)
    rng = random.Random(f"chains-{dtype}-{threads}")
    for batch in (1, 2, 3, 5, 8, 16):
        sessions = [_session(rng) for _ in range(batch)]
        if batch == 16:  # the widest call: 9-token drafts for every session
            sessions = [(p, c + [rng.randrange(VOCAB) for _ in range(9 - len(c))])
                        for p, c in sessions]
        refs = [_one_at_a_time(runner, p, c) for p, c in sessions]
        slots = [runner.new_slot() for _ in sessions]
        rng.shuffle(slots)  # non-contiguous slots: the gathering read path
        for s, (p, _) in zip(slots, sessions):
            runner.prefill(s, p, chunk=rng.choice([1, 7, 64, 512]))
        logits = runner.forward(slots, [c for _, c in sessions])  # [B, T_max, V]
        for b, ((_, c), ref) in enumerate(zip(sessions, refs)):
            assert torch.equal(logits[b, :len(c)], ref), (dtype, batch, b)
        for s in slots:
            runner.free_slot(s)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_trees_mixed_with_chains_have_the_bits_of_one_at_a_time(hd64_model, dtype, device):
    """Each row is a tree: the session's continuation as its spine plus random branches (a
    chain row has none); every spine node's logits equal decoding the spine alone, and a
    branch node's equal decoding its own path (its keys, stored out of decoding order, are read
    in decoding order: ``attention.TailKeys``)."""
    runner = _runner(hd64_model, dtype, device)
    rng = random.Random(f"trees-{dtype}")
    for batch in (1, 4, 11):
        rows = []
        for _ in range(batch):
            prompt, cont = _session(rng)
            tokens, parents = list(cont[1:]), list(range(-1, len(cont) - 2))
            for _ in range(rng.choice([0, 0, 2, 5, 12])):  # branches off any node
                parents.append(rng.randrange(-1, len(tokens)))
                tokens.append(rng.randrange(VOCAB))
            rows.append((prompt, cont[0], DraftTree(tuple(tokens), tuple(parents))))
        slots = [runner.new_slot() for _ in rows]
        for s, (p, _, _) in zip(slots, rows):
            runner.prefill(s, p)
        logits = runner.forward_tree(slots, [root for _, root, _ in rows],
                                     [t for _, _, t in rows])  # [B, 1 + N_max, V]
        for s in slots:
            runner.free_slot(s)
        for b, (prompt, root, tree) in enumerate(rows):
            for node in range(-1, len(tree)):
                path = [root] + [tree.tokens[i] for i in path_to(tree, node)]
                ref = _one_at_a_time(runner, prompt, path)[-1]
                assert torch.equal(logits[b, node + 1], ref), (dtype, batch, b, node)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_in_chunks_and_long_contexts_keep_the_bits(hd64_model, dtype, device):
    """A prompt prefilled in one piece or in chunks of any size leaves the same keys/values:
    the next forward's logits agree, also past several key blocks (up to the slot's end)."""
    runner = _runner(hd64_model, dtype, device, slots=2)
    rng = random.Random(f"prefill-{dtype}")
    for n in (5, 63, 64, 65, 200, 290):
        prompt = [rng.randrange(VOCAB) for _ in range(n)]
        cont = [rng.randrange(VOCAB) for _ in range(min(8, runner.max_len - n))]
        ref = _one_at_a_time(runner, prompt, cont)
        for chunk in (1, 13, 64, 512):
            s = runner.new_slot()
            runner.prefill(s, prompt, chunk=chunk)
            assert torch.equal(runner.forward([s], [cont])[0], ref), (dtype, n, chunk)
            runner.free_slot(s)


def test_the_attention_probe_catches_a_shape_dependent_kernel(monkeypatch):
    import torch.nn.functional as F

    import edgespec.runner.attention as attention

    assert probe_invariance(torch.float32)

    def sdpa(q, keys, values, visible, col_tile=16, tail=None):
        B, kvh, g, T, hd = q.shape
        out = F.scaled_dot_product_attention(q.reshape(B, kvh * g, T, hd), keys,
                                             values[..., :hd], attn_mask=visible[:, None],
                                             enable_gqa=True, scale=1.0)
        return out.transpose(1, 2).reshape(B, T, kvh * g * hd)

    monkeypatch.setattr(attention, "invariant_attention", sdpa)
    assert not probe_invariance(torch.float32)


def test_the_linear_probe_catches_a_lone_row_path(monkeypatch):
    g = torch.Generator().manual_seed(0)
    lin = Linear(torch.randn(576, 1536, generator=g) * 0.05)  # the default model's down shape
    assert linear_rows_exact(lin, rows=64)
    monkeypatch.setattr(Linear, "__call__", Linear._apply)  # a lone row as it is
    assert not linear_rows_exact(lin, rows=64)
