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
(the last tests)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F
from reference import path_to

from edgespec.config import ConfigError
from edgespec.runner.attention import probe_invariance
from edgespec.runner.dtype_probe import (exact_here, first_varying_count, probe_input,
                                         probe_row_counts)
from edgespec.runner.linear import Linear
from edgespec.runner.target_runner import TargetRunner
from edgespec.verify.trees import DraftTree

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier

VOCAB = 96


NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                             reason="no CUDA device here: the CUDA sweep runs on a GPU machine")
CASES = [pytest.param("cpu", "float32", id="cpu-float32"),
         pytest.param("cpu", "bfloat16", id="cpu-bfloat16", marks=pytest.mark.skipif(
             not exact_here("bfloat16"), reason="this CPU does not serve bfloat16 (refused)")),
         pytest.param("cuda", "float32", id="cuda-float32", marks=NO_CUDA),
         pytest.param("cuda", "bfloat16", id="cuda-bfloat16", marks=NO_CUDA)]


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


def _runner(model, dtype: str, device: str, slots: int = 16) -> TargetRunner | None:
    """The runner in ``dtype`` on ``device``; None where that dtype is not served on a GPU, after
    asserting that the runner refuses it and says why (a CPU dtype this CPU refuses is skipped
    by its mark)."""
    import copy

    m = copy.deepcopy(model).to(device=device, dtype=getattr(torch, dtype))
    if device == "cuda" and not exact_here(dtype, "cuda"):
        with pytest.raises(ConfigError, match="not batch-invariant"):
            TargetRunner(m, n_slots=slots, max_len=300)
        return None
    return TargetRunner(m, n_slots=slots, max_len=300)  # not a whole number of key blocks


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


def test_the_attention_probe_catches_a_shape_dependent_kernel(monkeypatch):
    import torch.nn.functional as F

    import edgespec.runner.attention as attention

    assert probe_invariance(torch.float32)

    def sdpa(q, keys, values, visible, col_tile=16, tail=None, products=None):
        B, kvh, g, T, hd = q.shape
        out = F.scaled_dot_product_attention(q.reshape(B, kvh * g, T, hd), keys,
                                             values[..., :hd], attn_mask=visible[:, None],
                                             enable_gqa=True, scale=1.0)
        return out.transpose(1, 2).reshape(B, T, kvh * g * hd)

    monkeypatch.setattr(attention, "invariant_attention", sdpa)
    assert not probe_invariance(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_attention_reads_a_view_of_the_cache_with_the_bits_of_a_copy(dtype):
    """A run of slots is read as a view of the cache (its rows not contiguous: a value
    product a key block, for float32), other slots gathered into a copy (one product): every
    output the same bits."""
    from edgespec.runner.attention import invariant_attention

    g = torch.Generator().manual_seed(1)
    B, kvh, grp, T, hd, n, max_len = 5, 2, 3, 4, 64, 192, 512
    keys = torch.randn(B, kvh, max_len, hd, generator=g).to(dtype)
    values = torch.cat([torch.randn(B, kvh, max_len, hd, generator=g),
                        torch.ones(B, kvh, max_len, 1)], -1).to(dtype)
    q = torch.randn(B, kvh, grp, T, hd, generator=g).to(dtype)
    ctx = torch.tensor([10, 70, 130, 150, 185])
    visible = torch.arange(n)[None, None, :] <= (ctx[:, None] + torch.arange(T))[:, :, None]
    view_k, view_v = keys[:, :, :n], values[:, :, :n]
    assert not view_v.is_contiguous()
    from_view = invariant_attention(q, view_k, view_v, visible)
    from_copy = invariant_attention(q, view_k.contiguous(), view_v.contiguous(), visible)
    assert torch.equal(from_view, from_copy)
    assert torch.equal(from_view[1:2], invariant_attention(q[1:2], view_k[1:2], view_v[1:2],
                                                           visible[1:2]))


@pytest.mark.parametrize("dtype,products", [(torch.float32, None), (torch.bfloat16, None),
                                            (torch.bfloat16, torch.float32)], ids=str)
def test_a_long_call_in_query_pieces_has_the_bits_of_one_call(monkeypatch, dtype, products):
    """On the CPU a call of many queries (a prompt's chunk) runs QUERY_PIECE queries at a time,
    each piece over the key blocks its queries see, its softmax in the scores' layout: every
    output the bits of the whole call at once with the keys innermost, for ragged rows of a
    prefill group (a short row's padding queries too), a fully hidden query, and a piece that
    ends mid-block."""
    import edgespec.runner.attention as attention

    g = torch.Generator().manual_seed(2)
    B, kvh, grp, T, hd, n = 2, 2, 3, 150, 64, 384
    keys = torch.randn(B, kvh, n, hd, generator=g).to(dtype)
    values = torch.cat([torch.randn(B, kvh, n, hd, generator=g),
                        torch.ones(B, kvh, n, 1)], -1).to(dtype)
    q = torch.randn(B, kvh, grp, T, hd, generator=g).to(dtype)
    starts = torch.tensor([0, 200])
    visible = torch.arange(n)[None, None, :] <= (starts[:, None] + torch.arange(T))[:, :, None]
    visible[0, 70] = False  # a query that sees no key: NaN either way, in its own column
    pieces = attention.invariant_attention(q, keys, values, visible, products=products)
    monkeypatch.setattr(attention, "QUERY_PIECE", 10 ** 6)
    monkeypatch.setattr(attention, "WIDE_COLUMNS", 10 ** 6)  # the softmax keys innermost
    whole = attention.invariant_attention(q, keys, values, visible, products=products)
    assert pieces.dtype == whole.dtype == dtype and pieces.shape == (B, T, kvh * grp * hd)
    seen = visible.any(-1)  # [B, T]
    assert torch.equal(pieces[seen], whole[seen])
    assert torch.isnan(pieces[~seen]).all() and torch.isnan(whole[~seen]).all()


def _lone_row_in_halves(self: Linear, x: torch.Tensor) -> torch.Tensor:
    """A linear path whose lone row sums its input in two halves, another order than a call of
    more rows takes: what the packed kernel's single-row path did on the CPUs where it was found,
    made here whatever this CPU's own kernels do (oneDNN capped at AVX2 gives a lone row a
    many-row call's bits)."""
    if x.numel() != x.shape[-1]:
        return self._apply(x)
    w, half = self.weight, x.shape[-1] // 2
    out = F.linear(x[..., :half], w[:, :half]) + F.linear(x[..., half:], w[:, half:])
    return out if self.bias is None else out + self.bias


def _down_projection() -> Linear:
    g = torch.Generator().manual_seed(0)
    return Linear(torch.randn(576, 1536, generator=g) * 0.05)  # the default model's down shape


def test_the_linear_probe_catches_a_lone_row_path(monkeypatch):
    """The start check's sweep (``first_varying_count`` over the CPU's row counts) finds a lone
    row summed in another order at one row, and nothing once a lone row goes as two."""
    lin = _down_projection()
    x, counts = probe_input(64, 1536, lin.weight), probe_row_counts("cpu", 64)
    assert first_varying_count(lin, x, counts) is None
    monkeypatch.setattr(Linear, "__call__", _lone_row_in_halves)
    assert first_varying_count(lin, x, counts) == 1


def test_the_linear_probe_catches_this_cpus_own_lone_row_path(monkeypatch):
    """Where this CPU's packed kernel gives a lone row other bits than the same row among two
    (AVX-512 and AMX oneDNN did), the sweep finds that path, called as it is, at one row."""
    lin = _down_projection()
    x, counts = probe_input(64, 1536, lin.weight), probe_row_counts("cpu", 64)
    if torch.equal(lin._apply(x[:1]), lin._apply(x[:2])[:1]):
        pytest.skip("this CPU's kernels give a lone row a two-row call's bits: nothing to find")
    monkeypatch.setattr(Linear, "__call__", Linear._apply)  # a lone row as it is
    assert first_varying_count(lin, x, counts) == 1


# -- the linear layer's row tiles and the start check over the served model's shapes ------------

# the shapes whose rows cuBLAS gave other bits by row count on an H200 (bfloat16: the 1.7B down
# projection, the 8B o and down projections), and the default model's down projection; on the
# CPU only the default model's shapes (a 14336-wide product swept 300 times costs minutes there)
GPU_SHAPES = [(8192, 2048), (4096, 4096), (14336, 4096), (1536, 576)]
TILED_CASES = [pytest.param("cpu", "float32", shape, id=f"cpu-float32-{shape[0]}-{shape[1]}")
               for shape in ((1536, 576), (576, 1536))] + \
              [pytest.param("cuda", dtype, shape, id=f"cuda-{dtype}-{shape[0]}-{shape[1]}",
                            marks=NO_CUDA)
               for dtype in ("float32", "bfloat16") for shape in GPU_SHAPES]
DEVICE_CASES = [pytest.param("cpu", "float32", id="cpu-float32"),
                pytest.param("cuda", "float32", id="cuda-float32", marks=NO_CUDA),
                pytest.param("cuda", "bfloat16", id="cuda-bfloat16", marks=NO_CUDA)]


def _varying(lin: Linear, max_rows: int = 300) -> int | None:
    w = lin.weight
    return first_varying_count(lin, probe_input(max_rows, w.shape[1], w),
                               list(range(1, max_rows + 1)))


@pytest.mark.parametrize("device,dtype,shape", TILED_CASES)
def test_row_tiles_give_every_row_the_bits_of_a_full_call(device, dtype, shape):
    """Rows in fixed 128-row tiles, each call padded: a row's bits do not depend on the call's row
    count (1..300, three tiles) or its place in it. On CUDA the shapes whose rows cuBLAS gave
    other bits by row count on an H200; on the CPU the default model's, the tiled path running
    through plain ``F.linear`` (MKL's float32 sgemm, not row-invariant on its own: next test)."""
    k, n = shape
    g = torch.Generator().manual_seed(k + n)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device=device, dtype=getattr(torch, dtype))
    assert _varying(Linear(w, pack=False, tiled=True)) is None


@pytest.mark.parametrize("device,dtype", DEVICE_CASES)
def test_without_row_tiles_the_sweep_fails(device, dtype):
    """The mutation check: the same sweep over plain calls (padding switched off) finds a row
    count that changes a row's bits: on CUDA (cuBLAS, measured in bfloat16 and float32 on an
    H200) and on this CPU in float32 (MKL's sgemm)."""
    shape = (8192, 2048) if device == "cuda" else (1536, 576)
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(shape[1], shape[0], generator=g) * 0.02).to(device=device,
                                                                  dtype=getattr(torch, dtype))
    assert _varying(Linear(w, pack=False, tiled=False)) is not None


def test_the_start_check_names_the_linear_layer_and_the_row_count(hd64_model, monkeypatch):
    """A linear path that gives a lone row other bits (summed in another order, as the packed
    kernel's single-row path did) is refused at start, naming the layer, its shape and the row
    count."""
    monkeypatch.setattr(Linear, "__call__", _lone_row_in_halves)
    with pytest.raises(ConfigError, match=r"linear layer \w+ \(\d+ -> \d+\) is not batch-invariant "
                                          r"here: a call of 1 rows gives a row other bits"):
        _runner(hd64_model, "float32", "cpu")


def test_the_start_check_covers_the_row_wise_norm(hd64_model, monkeypatch):
    """A norm whose result depends on how many rows share the call is refused at start."""
    def norm_by_row_count(self, x, w):
        return w * x * (1 + 1e-3 * x.shape[0])

    monkeypatch.setattr(TargetRunner, "_rms", norm_by_row_count)
    with pytest.raises(ConfigError, match="the RMS norm is not batch-invariant here"):
        _runner(hd64_model, "float32", "cpu")


@pytest.mark.parametrize("device,max_rows", [("cpu", 1040), ("cuda", 1040), ("cuda", 300)])
def test_start_check_row_counts(device, max_rows):
    """On CUDA every count up to two tiles (every padding of a first and a second tile) and the
    most rows a forward sends; on CPU the counts where oneDNN's blocking changes, and about the
    row spans' floor and lower ceiling, up to 129."""
    counts = probe_row_counts(device, max_rows)
    assert counts == sorted(set(counts))
    if device == "cuda":
        assert counts == [*range(1, 257), max_rows]
    else:
        assert {1, 2, 3, 15, 16, 17, 39, 40, 41, 63, 64, 65, 95, 96, 97, 127, 128} <= \
            set(counts) and counts[-1] == 129
        assert len(counts) < 30


def test_the_cuda_norm_path_is_row_invariant_and_agrees_with_the_mean(hd64_model):
    """On CUDA the RMS norm sums a row's squares through a row-tiled product with ones (torch's
    reduction kernels give 1..15 rows wider blocks than 16 and more): the same path, run here,
    gives every row its bits whatever the row count, and agrees with the plain mean to float32
    rounding."""
    runner = _runner(hd64_model, "float32", "cpu")
    x = probe_input(300, runner.embed.shape[1], runner.embed)
    plain = runner._rms(x, runner.norm)
    runner._row_sum = Linear(torch.ones(1, x.shape[1]), pack=False, tiled=True)
    assert first_varying_count(lambda t: runner._rms(t, runner.norm), x,
                               list(range(1, 300))) is None
    torch.testing.assert_close(runner._rms(x, runner.norm), plain)


def test_the_probes_run_at_the_thread_count_in_force(monkeypatch):
    """A kernel that is invariant at 2 threads and not at 8 is refused at 8: the probes' results
    are kept per thread count (the start check once ran at one count and served another)."""
    import edgespec.runner.attention as attention
    from edgespec.runner import dtype_probe

    real = attention.probe_invariance
    monkeypatch.setattr(attention, "probe_invariance",
                        lambda *a, **k: torch.get_num_threads() != 8 and real(*a, **k))
    dtype_probe._attention_kernel.cache_clear()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert exact_here("float32")
        torch.set_num_threads(8)
        assert not exact_here("float32")
        with pytest.raises(ConfigError, match="not batch-invariant on this cpu at 8 threads"):
            dtype_probe.resolve_dtype("float32")
    finally:
        torch.set_num_threads(before)
        dtype_probe._attention_kernel.cache_clear()


def test_emulated_bfloat16_gets_float32_attention_products(monkeypatch):
    """Where bfloat16 is emulated (no AVX-512 BF16 nor AMX, or oneDNN capped below them) the
    attention kernel runs its products in float32; natively it keeps bfloat16's."""
    from edgespec.runner import dtype_probe
    from edgespec.runner.cpu_kind import cpu_kind

    kind = cpu_kind()
    for flags, cap, native in ((("avx512f", "avx512_vnni"), "", False),
                               (("avx512f", "avx512_bf16"), "", True),
                               (("avx512f", "avx512_bf16", "amx_bf16"), "AVX512_CORE_VNNI", False),
                               (("avx512f", "amx_bf16"), "AVX512_CORE_AMX", True)):
        fake = dataclasses.replace(kind, flags=flags, onednn_cap=cap)
        assert fake.bf16_native is native
        assert ("bfloat16 native" if native else "bfloat16 emulated") in fake.describe()
        monkeypatch.setattr(dtype_probe, "cpu_kind", lambda fake=fake: fake)
        dtype_probe._attention_kernel.cache_clear()
        kernel = dtype_probe.attention_kernel(torch.bfloat16, "cpu", 3, 3, 64)
        if kernel is not None and not native:  # None: this oneDNN has no bfloat16 at all
            assert kernel.products == torch.float32
        elif kernel is not None:  # native: its own products first, float32 if they fail
            assert kernel.products in (None, torch.float32)
    dtype_probe._attention_kernel.cache_clear()


def test_auto_takes_the_measured_faster_exact_dtype(monkeypatch, caplog):
    """``auto`` serves bfloat16 only where it is exact and measured faster than float32 (by the
    margin), says what it measured, and float32 where bfloat16 is refused."""
    import logging

    from edgespec.runner import dtype_probe

    if not exact_here("bfloat16"):
        assert dtype_probe.resolve_dtype("auto") == "float32"
        return
    for bf16_ms, chosen in ((0.05, "bfloat16"), (0.2, "float32"), (0.099, "float32")):
        dtype_probe.memo_path().unlink(missing_ok=True)  # measured again (see below)
        monkeypatch.setattr(dtype_probe, "linear_costs_ms",
                            lambda dts, device="cpu", b=bf16_ms:
                            [b if dt == torch.bfloat16 else 0.1 for dt in dts])
        with caplog.at_level(logging.INFO, logger="edgespec.dtype"):
            caplog.clear()
            assert dtype_probe.resolve_dtype("auto") == chosen
        assert f"dtype auto: {chosen}" in caplog.text
        assert f"bfloat16 {bf16_ms:.3f} ms" in caplog.text
        assert "this CPU: " in caplog.text
    monkeypatch.setattr(dtype_probe, "exact_here", lambda name, device="cpu": name == "float32")
    assert dtype_probe.resolve_dtype("auto") == "float32"
    assert dtype_probe.choose_auto().refused == ("bfloat16",)


def test_auto_measures_again_a_choice_another_measure_made(monkeypatch):
    """A choice remembered from another measure (the one linear read from the cache every call,
    which chose float32 where bfloat16's forward was faster) is not reused: the setting's key
    names what was measured, and the new measure's choice is kept beside the old entry."""
    import json

    from edgespec.runner import dtype_probe
    from edgespec.runner.cpu_kind import cpu_kind
    from edgespec.runner.dtype_memo import setting_key

    if not exact_here("bfloat16"):
        pytest.skip("bfloat16 is not exact here: auto has one candidate and measures nothing")
    old = setting_key("cpu", cpu_kind().describe(), ["bfloat16", "float32"])
    dtype_probe.memo_path().parent.mkdir(parents=True, exist_ok=True)
    dtype_probe.memo_path().write_text(json.dumps(
        {old: {"dtype": "float32", "cost_ms": {"bfloat16": 0.66, "float32": 0.62}}}))
    monkeypatch.setattr(dtype_probe, "linear_costs_ms",
                        lambda dts, device="cpu": [5.5 if dt == torch.bfloat16 else 9.0
                                                   for dt in dts])
    choice = dtype_probe.choose_auto()
    assert choice.dtype == "bfloat16" and not choice.remembered
    assert dtype_probe.COST_PROBE in choice.reason()
    table = json.loads(dtype_probe.memo_path().read_text())
    assert table[old]["dtype"] == "float32"
    [new_key] = [k for k in table if k != old]
    assert new_key.endswith(dtype_probe.COST_PROBE) and table[new_key]["dtype"] == "bfloat16"


def test_auto_measures_once_a_setting_and_every_run_serves_that_choice(monkeypatch, caplog):
    """Two runs of one command could choose differently where the two dtypes are close (both
    exact: a seeded request answered with other tokens): the first measurement of a setting is
    kept in the cache folder and reused, said in the log; deleting the file measures again, and
    a file that cannot be read is measured past."""
    import logging

    from edgespec.runner import dtype_probe

    if not exact_here("bfloat16"):
        pytest.skip("bfloat16 is not exact here: auto has one candidate and measures nothing")
    calls = []

    def costs(bf16_ms):
        def cost(dts, device="cpu"):
            calls.extend(dts)
            return [bf16_ms if dt == torch.bfloat16 else 0.1 for dt in dts]
        monkeypatch.setattr(dtype_probe, "linear_costs_ms", cost)

    costs(0.05)
    assert dtype_probe.choose_auto().dtype == "bfloat16" and len(calls) == 2
    assert dtype_probe.memo_path().exists()
    costs(0.5)  # the moment's load would now choose float32
    with caplog.at_level(logging.INFO, logger="edgespec.dtype"):
        assert dtype_probe.resolve_dtype("auto") == "bfloat16"
    assert len(calls) == 2 and "remembered from" in caplog.text and "measured" in caplog.text
    dtype_probe.memo_path().write_text("{not json")
    assert dtype_probe.choose_auto().dtype == "float32" and len(calls) == 4
    dtype_probe.memo_path().unlink()
    costs(0.05)
    assert dtype_probe.choose_auto().dtype == "bfloat16" and len(calls) == 6
