"""Exact by construction: a session's logits have the same bits however its tokens reach the
runner: one at a time, as a draft of any length, as a token tree, in a batch with other
sessions of any lengths, after a prompt prefilled in one piece or in chunks. Compared with
``torch.equal``, never a tolerance, for every dtype edgespec serves as lossless on the devices
present: on CPU float32 and bfloat16 where this CPU serves it; on CUDA, wherever a GPU is and
whatever the host CPU, float32 and bfloat16, each either served and swept or asserted to be
refused with its message.

Putting ``scaled_dot_product_attention`` back in ``EagerLayers.run``, or sending a lone
row through the linear layers as it is (or, on CUDA, a call that is not padded to whole tiles),
fails this sweep (checked when each fix went in); the start probes are shown to catch all three
in ``test_invariance_probes``."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from invariance_models import NO_CUDA, VOCAB, build_hd64_model, runner_in as _runner
from reference import path_to

from edgespec.runner.dtype_probe import exact_here
from edgespec.runner.target_runner import TargetRunner
from edgespec.verify.trees import DraftTree

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier

CASES = [pytest.param("cpu", "float32", id="cpu-float32"),
         pytest.param("cpu", "bfloat16", id="cpu-bfloat16", marks=pytest.mark.skipif(
             not exact_here("bfloat16"), reason="this CPU does not serve bfloat16 (refused)")),
         pytest.param("cuda", "float32", id="cuda-float32", marks=NO_CUDA),
         pytest.param("cuda", "bfloat16", id="cuda-bfloat16", marks=NO_CUDA)]


@pytest.fixture(scope="module")
def hd64_model():
    return build_hd64_model()


def _emulated_bf16_runner(model, slots: int) -> TargetRunner:
    """A bfloat16 runner with the kernels chosen where oneDNN emulates bfloat16."""
    import copy

    from edgespec.runner import dtype_probe
    from edgespec.runner.cpu_kind import cpu_kind

    emulated = dataclasses.replace(cpu_kind(), flags=("avx2", "avx512f", "avx512_vnni"))
    assert not emulated.bf16_native
    m = copy.deepcopy(model).to(dtype=torch.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dtype_probe, "cpu_kind", lambda: emulated)
        dtype_probe._attention_kernel.cache_clear()
        runner = TargetRunner(m, n_slots=slots, max_len=300)
    dtype_probe._attention_kernel.cache_clear()
    assert runner.attention_products == torch.float32
    return runner


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


@pytest.fixture(params=[1, 2, 5, 8], ids=lambda n: f"{n}threads")
def threads(request):
    """torch's thread count: it decides where each thread's share of a pointwise op ends (5
    threads once left silu's last elements of a share to scalar code)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("device,dtype", CASES)
def test_chains_in_ragged_batches_have_the_bits_of_one_at_a_time(hd64_model, dtype, device,
                                                                 threads):
    if device == "cuda" and threads != 2:
        pytest.skip("torch's CPU thread count does not reach CUDA kernels: one count is enough")
    runner = _runner(hd64_model, dtype, device)
    if runner is None:
        return
    _sweep_ragged_chains(runner, random.Random(f"chains-{dtype}-{threads}"), dtype)


EMULATED = pytest.param("cpu", "emulated-bfloat16", id="cpu-emulated-bfloat16",
                        marks=pytest.mark.skipif(not exact_here("bfloat16"),
                                                 reason="this CPU does not serve bfloat16"))


@pytest.mark.parametrize("device,dtype", CASES[:2] + [EMULATED])
def test_a_long_context_among_short_ones_attends_apart_with_the_bits_of_one_at_a_time(
        hd64_model, dtype, device, monkeypatch):
    """On the CPU the rows of a step that read far fewer key blocks than another run their
    attention in groups of their own (``row_groups``): each row's logits the bits of decoding
    it alone, for a long context among short ones and two groups of each; also with the
    kernels of a CPU that emulates bfloat16 (float32 attention products)."""
    runner = _emulated_bf16_runner(hd64_model, 16) if dtype == "emulated-bfloat16" \
        else _runner(hd64_model, dtype, device)
    grouped = []
    attend = runner.eager.grouped_attention
    monkeypatch.setattr(runner.eager, "grouped_attention",
                        lambda *a: grouped.append(len(a[3])) or attend(*a))
    rng = random.Random(f"row-groups-{dtype}")
    for lengths in ([7, 270, 12, 3, 30, 9, 18, 5], [20, 200, 15, 210, 30, 100, 25, 120, 10]):
        sessions = [([rng.randrange(VOCAB) for _ in range(n)],
                     [rng.randrange(VOCAB) for _ in range(rng.randint(4, 9))]) for n in lengths]
        refs = [_one_at_a_time(runner, p, c) for p, c in sessions]
        slots = [runner.new_slot() for _ in sessions]
        for s, (p, _) in zip(slots, sessions):
            runner.prefill(s, p)
        grouped.clear()
        logits = runner.forward(slots, [c for _, c in sessions])
        assert grouped and min(grouped) > 1  # every layer's attention ran in groups
        for b, ((_, c), ref) in enumerate(zip(sessions, refs)):
            assert torch.equal(logits[b, :len(c)], ref), (dtype, lengths, b)
        for s in slots:
            runner.free_slot(s)


def test_row_groups_cover_every_row_once_and_reach_each_rows_keys():
    from edgespec.runner.attention import KEY_BLOCK, MAX_ROW_GROUPS, row_groups

    def plan(reach: list[int], n: int = 1024, queries: int = 1):
        visible = (torch.arange(n)[None, None, :] < torch.tensor(reach)[:, None, None]) \
            .expand(-1, queries, -1)
        return [(group.rows.tolist(), group.keys) for group in row_groups(visible)]

    assert plan([100] * 16) == [] and plan([1000]) == []  # uniform, or one row: together
    assert plan([60, 130]) == []  # a cut would save less than its calls cost
    assert plan([60] * 16 + [1000]) == [(list(range(16)), KEY_BLOCK), ([16], 1024)]
    assert plan([60] * 10 + [130]) == []  # 10 rows x 2 blocks: not at one token a row...
    assert len(plan([60] * 10 + [130], queries=4)) == 2  # ... at four
    rng = random.Random(5)
    for _ in range(200):
        reach = [rng.choice([0, 1, 64, 65, 200, 700, 1024]) for _ in range(rng.randint(2, 40))]
        groups = plan(reach)
        assert len(groups) <= MAX_ROW_GROUPS
        if groups:
            rows = sorted(r for g, _ in groups for r in g)
            assert rows == list(range(len(reach)))
            assert all(k % KEY_BLOCK == 0 and k >= max(reach[r] for r in g) and k <= 1024
                       for g, k in groups)
            assert all(g == sorted(g) for g, _ in groups)


@pytest.mark.skipif(not exact_here("bfloat16"), reason="this CPU does not serve bfloat16")
def test_the_emulated_bfloat16_kernels_keep_ragged_batches_exact_at_8_threads(hd64_model):
    """The kernels a CPU that emulates bfloat16 gets (float32 attention products), swept on any
    CPU whose linears serve bfloat16 (under ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI`` the plain
    bfloat16 sweep runs them too: ``test_isa_settings``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        runner = _emulated_bf16_runner(hd64_model, 16)
        _sweep_ragged_chains(runner, random.Random("chains-emulated"), "bfloat16-emulated")
    finally:
        torch.set_num_threads(before)


def _sweep_ragged_chains(runner: TargetRunner, rng: random.Random, dtype: str) -> None:
    """Batches of 1..16 sessions of random prompts and drafts, in shuffled slots, each row's
    logits against decoding it alone."""
    for batch in (1, 2, 3, 5, 8, 16):
        sessions = [_session(rng) for _ in range(batch)]
        if batch == 16:  # the widest call: 9-token drafts for every session
            sessions = [(p, c + [rng.randrange(VOCAB) for _ in range(9 - len(c))])
                        for p, c in sessions]
        refs = [_one_at_a_time(runner, p, c) for p, c in sessions]
        slots = [runner.new_slot() for _ in sessions]
        rng.shuffle(slots)  # non-contiguous slots: the gathering read path
        for s, (p, _) in zip(slots, sessions):
            chunk = rng.choice([1, 7, 64, 512])
            # a token a forward (decoding's shape) for prompts of up to 32 tokens; beyond, 3 (a
            # 150-token prompt one token at a time cost half the sweep's time)
            runner.prefill(s, p, chunk=3 if chunk == 1 and len(p) > 32 else chunk)
        logits = runner.forward(slots, [c for _, c in sessions])  # [B, T_max, V]
        for b, ((_, c), ref) in enumerate(zip(sessions, refs)):
            assert torch.equal(logits[b, :len(c)], ref), (dtype, batch, b)
        for s in slots:
            runner.free_slot(s)


@pytest.mark.parametrize("device,dtype", CASES)
def test_trees_mixed_with_chains_have_the_bits_of_one_at_a_time(hd64_model, dtype, device):
    """Each row is a tree: the session's continuation as its spine plus random branches (a
    chain row has none); every spine node's logits equal decoding the spine alone, and a
    branch node's equal decoding its own path (its keys, stored out of decoding order, are read
    in decoding order: ``attention.TailKeys``)."""
    runner = _runner(hd64_model, dtype, device)
    if runner is None:
        return
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


@pytest.mark.parametrize("device,dtype", CASES)
def test_prefill_in_chunks_and_long_contexts_keep_the_bits(hd64_model, dtype, device):
    """A prompt prefilled in one piece or in chunks of any size leaves the same keys/values:
    the next forward's logits agree, also past several key blocks (up to the slot's end)."""
    runner = _runner(hd64_model, dtype, device, slots=2)
    if runner is None:
        return
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


@pytest.mark.parametrize("device,dtype", CASES)
def test_prompts_prefilled_together_keep_the_bits_each_gets_alone(hd64_model, dtype, device):
    """The prefill queue (``engine.prefill_queue`` over ``TargetRunner.prefill_parts``):
    prompts of ragged lengths, cut at its chunk's multiples, several a forward in groups cut by
    the forward's row budget, over one step or several, leave each slot the keys/values of its
    prompt prefilled alone."""
    from edgespec.drafters.adaptive import DraftLength
    from edgespec.engine.generation import ActiveSession, Request
    from edgespec.engine.prefill_queue import PrefillQueue

    runner = _runner(hd64_model, dtype, device)
    if runner is None:
        return
    rng = random.Random(f"prefill-many-{dtype}")
    for rows, chunk, budget in ((runner.max_rows, 512, None), (150, 64, 100), (40, 13, None)):
        runner.prefill_rows = rows
        sessions = [_session(rng, max_prompt=200) for _ in range(7)]
        refs = [_one_at_a_time(runner, p, c) for p, c in sessions]
        slots = [runner.new_slot() for _ in sessions]
        rng.shuffle(slots)
        queue = PrefillQueue(runner, chunk)
        for s, (p, _) in zip(slots, sessions):
            queue.add(ActiveSession(f"s{s}", Request(p + [0], 1), s, DraftLength(1)), p)
        for _ in range(100):  # steps
            if not len(queue):
                break
            assert not queue.advance(budget).failed
        assert len(queue) == 0
        assert [runner.cache.lengths[s] for s in slots] == [len(p) for p, _ in sessions]
        logits = runner.forward(slots, [c for _, c in sessions])  # [B, T_max, V]
        for b, ((_, c), ref) in enumerate(zip(sessions, refs)):
            assert torch.equal(logits[b, :len(c)], ref), (dtype, rows, chunk, b)
        for s in slots:
            runner.free_slot(s)
