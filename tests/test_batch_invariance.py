"""Exact by construction: a session's logits have the same bits however its tokens reach the
runner: one at a time, as a draft of any length, as a token tree, in a batch with other
sessions of any lengths, after a prompt prefilled in one piece or in chunks. Compared with
``torch.equal``, never a tolerance, for every dtype edgespec serves as lossless on the devices
present (CUDA where a GPU is, else said in the skip reason).

Putting ``scaled_dot_product_attention`` back in ``TargetRunner._run_layers`` fails this sweep
(checked when the invariant attention went in)."""

from __future__ import annotations

import random

import pytest
import torch

from edgespec.attention import probe_invariance
from edgespec.runner import TargetRunner
from edgespec.tree_verify import DraftTree

VOCAB = 96


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
    return TargetRunner(m, n_slots=slots, max_len=320)


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


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chains_in_ragged_batches_have_the_bits_of_one_at_a_time(hd64_model, dtype, device):
    runner = _runner(hd64_model, dtype, device)
    rng = random.Random(f"chains-{dtype}")
    for batch in (1, 2, 3, 5, 8, 16):
        sessions = [_session(rng) for _ in range(batch)]
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
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
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
                path = [root] + [tree.tokens[i] for i in tree.path_to(node)]
                ref = _one_at_a_time(runner, prompt, path)[-1]
                assert torch.equal(logits[b, node + 1], ref), (dtype, batch, b, node)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_in_chunks_and_long_contexts_keep_the_bits(hd64_model, dtype, device):
    """A prompt prefilled in one piece or in chunks of any size leaves the same keys/values:
    the next forward's logits agree, also past several key blocks (up to the slot's end)."""
    runner = _runner(hd64_model, dtype, device, slots=2)
    rng = random.Random(f"prefill-{dtype}")
    for n in (5, 63, 64, 65, 200, 300):
        prompt = [rng.randrange(VOCAB) for _ in range(n)]
        cont = [rng.randrange(VOCAB) for _ in range(min(8, runner.max_len - n))]
        ref = _one_at_a_time(runner, prompt, cont)
        for chunk in (1, 13, 64, 512):
            s = runner.new_slot()
            runner.prefill(s, prompt, chunk=chunk)
            assert torch.equal(runner.forward([s], [cont])[0], ref), (dtype, n, chunk)
            runner.free_slot(s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_start_probe_passes_here_and_catches_a_shape_dependent_kernel(dtype):
    assert probe_invariance(dtype)
    if dtype == torch.float32:  # MKL's float32 products vary with an odd number of columns
        assert not probe_invariance(dtype, col_tile=1)
