"""The fused slot attention (``edgespec.runner.fused_attention``) and its start probe: each
query over its slot's prefix and its tree path (against plain torch in float32), for every
kernel (tiles, rows, split, chunks, split-decode) and head layout; a row's bits, whatever else
the call holds (alone, among longer rows, as a tree node against its chain, in a wider cache);
the probe catching an attention whose bits vary. On a CPU under Triton's interpreter
(tests/triton_on_cpu.py); on a GPU, compiled. The other fused kernels:
tests/test_fused_kernels.py."""

from __future__ import annotations

import pytest
import torch

from triton_on_cpu import DEV, DTYPES, _rand, require_triton

require_triton()
from edgespec.runner import fused_attention as fa  # noqa: E402
from edgespec.runner import fused_attention_probe as fap  # noqa: E402
from edgespec.runner import fused_kernels as fk  # noqa: E402
from edgespec.runner.step_rows import DraftShape, StepRows  # noqa: E402


def _cache(slots, kvh, cap, hd, dtype, seed):
    return (_rand(slots, kvh, cap, hd, dtype=dtype, seed=seed),
            _rand(slots, kvh, cap, hd, dtype=dtype, seed=seed + 1))


def _attention_ref(q, k_cache, v_cache, slot, keys, group, scale):
    """One query [nh, hd] over its keys at positions ``keys`` of slot ``slot`` (float32)."""
    k = k_cache[slot][:, keys].float()  # [kvh, n, hd]
    v = v_cache[slot][:, keys].float()
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    probs = torch.softmax((k @ q.float()[:, :, None])[..., 0] * scale, -1)  # [nh, n]
    return (probs[:, None, :] @ v)[:, 0]


def _tree_step(slots, starts, parents_per_row):
    """A fused step of trees built as the runner builds one (``StepRows``, then
    ``FusedStep.of_tree_rows``), from each row's parent of every row (row 0 the root, -1)."""
    drafts = [([0] * (len(p) - 1), [q - 1 for q in p[1:]]) for p in parents_per_row]
    rows = StepRows.build(slots, starts, [0] * len(slots), DraftShape.of(drafts), DEV, tree=True)
    return fk.FusedStep.of_tree_rows(rows)


def _along(parents, t):
    """The rows from the root down to row t (the reference: walked up its parents)."""
    chain = [t]
    while parents[chain[0]] >= 0:
        chain.insert(0, parents[chain[0]])
    return chain


# (q heads, kv heads, head size): a group of 2 (8 queries a tile), 3 (5 a tile, one row of the
# 16 idle), 1 (16 a tile) and 8 (2 a tile)
LAYOUTS = [(4, 2, 16), (6, 2, 16), (2, 2, 32), (8, 1, 16)]


@pytest.mark.parametrize("kernel,layout", [("tiles", x) for x in LAYOUTS]
                         + [("rows", x) for x in LAYOUTS[:2]]  # rows: one program a head
                         + [("split", x) for x in LAYOUTS[1:3]])  # its wider tile
@pytest.mark.parametrize("dtype", DTYPES)
def test_slot_attention_reads_each_query_s_prefix_and_path(kernel, layout, dtype):
    nh, kvh, hd = layout
    k_cache, v_cache = _cache(4, kvh, 256, hd, dtype, 5)
    T = 7  # more queries than one tile holds for every group but 1
    slots, starts = [2, 0, 3], [70, 5, 126]  # crossing key blocks
    # row 0: a tree of three leaves stored out of decoding order; row 1: a chain; row 2: a
    # root with six children
    parents = [[-1, 0, 0, 1, 2, 3, 1], list(range(-1, T - 1)), [-1] + [0] * 6]
    step = _tree_step(slots, starts, parents)
    assert step.width == T
    B = len(slots)
    q = _rand(B * T, nh * hd, dtype=dtype, seed=7)
    out = fa.slot_attention(q, step, k_cache, v_cache, nh, kvh, hd, 0.25, kernel=kernel)
    assert out.shape == (fk.padded_rows(B * T), nh * hd)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b in range(B):
        for t in range(T):
            st = starts[b]
            keys = list(range(st)) + [st + u for u in _along(parents[b], t)]
            ref = _attention_ref(q[b * T + t].view(nh, hd), k_cache, v_cache, slots[b],
                                 torch.tensor(keys, device=DEV), nh // kvh, 0.25)
            torch.testing.assert_close(out[b * T + t].float().view(nh, hd), ref, rtol=tol,
                                       atol=tol)


def _three_sessions(layout, keys: int, starts: list[int], seed: int):
    """Three slots of ``keys`` random keys and values, float32 (bfloat16 outputs would hide a
    last-bit difference in the sums), 6 queries a session [18, nh hd], the slots and the rows'
    starts on the device."""
    nh, kvh, hd = layout
    k_cache, v_cache = _cache(3, kvh, keys, hd, torch.float32, seed)
    q = _rand(18, nh * hd, dtype=torch.float32, seed=seed + 1)
    return (k_cache, v_cache, q, torch.tensor([0, 1, 2], device=DEV),
            torch.tensor(starts, device=DEV))


def _split_bits_or_refused(same: bool, layout) -> None:
    """A row that split and chunks gave other bits: never under the interpreter (the design's
    claim); on a GPU that is the sitting's question (its attention stage records the answer),
    and where they differ the start probe must refuse ``split-decode`` for the layout, so that
    no runner serves a row's bits that depend on the step's width."""
    if same:
        return
    assert DEV == "cuda", "split and chunks gave other bits under the interpreter"
    nh, kvh, hd = layout
    assert fap.probe_slot_attention(torch.float32, DEV, nh, kvh, hd,
                                    kernel="split-decode") is not None, \
        "split and chunks differ here, and the start probe would serve split-decode"


@pytest.mark.parametrize("kernel", fa.ATTENTION_KERNELS)
@pytest.mark.parametrize("layout,tree_at", [(LAYOUTS[0], 130), (LAYOUTS[1], 62)])
def test_slot_attention_row_bits_do_not_depend_on_the_call(kernel, layout, tree_at):
    """A query alone, and the same query among other sessions' longer rows, get the same bits;
    a tree node gets the bits of the chain root -> ... -> node stored in decoding order."""
    nh, kvh, hd = layout
    k_cache, v_cache, q, slots, starts = _three_sessions(layout, 256, [tree_at, 3, 64], 11)
    T = 6

    def attend(q, step, k=k_cache, v=v_cache):
        return fa.slot_attention(q, step, k, v, nh, kvh, hd, 0.25, kernel=kernel)

    many = attend(q, fk.FusedStep.chains(slots, starts, T))
    for b in range(3):
        for t in range(T):
            one = fk.FusedStep.chains(slots[b:b + 1], starts[b:b + 1] + t, 1)
            same = torch.equal(attend(q[b * T + t:b * T + t + 1], one)[0], many[b * T + t])
            if kernel == "split-decode":  # alone: split; among wider rows: chunks
                _split_bits_or_refused(same, layout)
            else:
                assert same
    # a tree whose nodes hang off different ancestors, each node against its chain (from a
    # root at 62, the chains of nodes two deep start in the next key block)
    parents = [-1, 0, 0, 2, 1, 3]
    tree = attend(q[:T], _tree_step([0], [tree_at], [parents]))
    st = tree_at
    for t in range(T):
        along = _along(parents, t)
        chain_k, chain_v = k_cache.clone(), v_cache.clone()  # the chain's layout
        for i, node in enumerate(along):
            chain_k[0, :, st + i], chain_v[0, :, st + i] = k_cache[0, :, st + node], \
                v_cache[0, :, st + node]
        chain = attend(q[t:t + 1], fk.FusedStep.chains(slots[:1], starts[:1] + len(along) - 1,
                                                       1), chain_k, chain_v)
        if kernel == "split-decode":  # the tree: chunks; its chain decoded: split
            _split_bits_or_refused(torch.equal(tree[t], chain[0]), layout)
        else:
            assert torch.equal(tree[t], chain[0])


@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[1]])
def test_the_chunks_kernel_gives_the_split_kernel_s_bits_in_one_program(layout):
    """The chunks kernel (the tiles' grid: one program walks a row's key chunks in turn, each
    merged into the running state as the split kernel's merge does) gives every row the split
    kernel's bits (chunk programs in parallel, merged by a second kernel, in wider tiles):
    chains crossing chunks 1 and 2 and within chunk 0, and a tree rooted below a chunk's end.
    Then a runner may take either by the step (the GPU sitting times both); on a GPU where
    they differ, the start probe refuses split-decode."""
    nh, kvh, hd = layout
    k_cache, v_cache, q, slots, starts = _three_sessions(layout, 640, [253, 509, 40], 31)
    T = 6

    def both(q, step):
        return [fa.slot_attention(q, step, k_cache, v_cache, nh, kvh, hd, 0.25, kernel=kernel)
                for kernel in ("chunks", "split")]

    chunks, split = both(q, fk.FusedStep.chains(slots, starts, T))
    _split_bits_or_refused(torch.equal(chunks[:3 * T], split[:3 * T]), layout)
    for b in range(3):
        st = int(starts[b])
        ref = _attention_ref(q[b * T + T - 1].view(nh, hd), k_cache, v_cache, b,
                             torch.arange(st + T, device=DEV), nh // kvh, 0.25)
        torch.testing.assert_close(chunks[b * T + T - 1].view(nh, hd), ref, rtol=1e-5,
                                   atol=1e-5)
    tree_chunks, tree_split = both(q[:T], _tree_step([0], [254], [[-1, 0, 0, 2, 1, 3]]))
    _split_bits_or_refused(torch.equal(tree_chunks[:T], tree_split[:T]), layout)


def test_split_decode_runs_the_split_kernel_for_one_token_a_row_and_chunks_for_wider(
        monkeypatch):
    """``split-decode`` takes the kernel by the call's width: one token a row (decode) through
    the split kernel and its merge, a wider call through chunks (no merge kernel), each with
    that kernel's bits (its row-bits test above holds the two to each other)."""
    nh, kvh, hd = LAYOUTS[0]
    k_cache, v_cache, q, slots, starts = _three_sessions(LAYOUTS[0], 640, [253, 509, 40], 41)
    merges = []
    merge = fa._merge_splits_kernel

    class Spy:
        def __getitem__(self, grid):
            merges.append(grid)
            return merge[grid]

    monkeypatch.setattr(fa, "_merge_splits_kernel", Spy())

    def attend(q, step, kernel):
        return fa.slot_attention(q, step, k_cache, v_cache, nh, kvh, hd, 0.25, kernel=kernel)

    one = fk.FusedStep.chains(slots, starts, 1)
    decode = attend(q[:3], one, "split-decode")
    assert len(merges) == 1
    assert torch.equal(decode[:3], attend(q[:3], one, "split")[:3])
    wide = fk.FusedStep.chains(slots, starts, 6)
    merges.clear()
    got = attend(q, wide, "split-decode")
    assert merges == []
    assert torch.equal(got[:18], attend(q, wide, "chunks")[:18])


@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[1]])
def test_the_split_kernel_sums_fixed_key_chunks_whatever_the_call(layout):
    """The split kernel over slots of 600 keys (three chunks of 256): each query against the
    float32 reference, alone and among other sessions' rows, as a tree node against its chain,
    and with the same bits in a cache of more chunks (a grid of more programs)."""
    nh, kvh, hd = layout
    dtype = torch.float32
    # rows crossing chunks 1 and 2, and one within chunk 0
    k_cache, v_cache, q, slots, starts = _three_sessions(layout, 640, [253, 509, 40], 21)
    T = 6

    def attend(q, step, k=k_cache, v=v_cache):
        return fa.slot_attention(q, step, k, v, nh, kvh, hd, 0.25, kernel="split")

    many = attend(q, fk.FusedStep.chains(slots, starts, T))
    for b in range(3):
        for t in range(T):
            st = int(starts[b])
            ref = _attention_ref(q[b * T + t].view(nh, hd), k_cache, v_cache, b,
                                 torch.arange(st + t + 1, device=DEV), nh // kvh, 0.25)
            torch.testing.assert_close(many[b * T + t].view(nh, hd), ref, rtol=1e-5, atol=1e-5)
            one = fk.FusedStep.chains(slots[b:b + 1], starts[b:b + 1] + t, 1)
            assert torch.equal(attend(q[b * T + t:b * T + t + 1], one)[0], many[b * T + t])
    bounded = attend(q, fk.FusedStep.chains(slots, starts, T, keys=int(starts.max()) + T))
    assert torch.equal(bounded[:3 * T], many[:3 * T])  # the grid sized by the longest row
    wider_k, wider_v = _cache(3, kvh, 1280, hd, dtype, 23)  # 5 chunks: more programs, idle
    wider_k[:, :, :640], wider_v[:, :, :640] = k_cache, v_cache
    wide = attend(q, fk.FusedStep.chains(slots, starts, T), wider_k, wider_v)
    assert torch.equal(wide[:3 * T], many[:3 * T])
    # a tree rooted just below a chunk's end: its nodes' paths cross into the next chunk
    parents = [-1, 0, 0, 2, 1, 3]
    tree = attend(q[:T], _tree_step([0], [254], [parents]))
    for t in range(T):
        along = _along(parents, t)
        chain_k, chain_v = k_cache.clone(), v_cache.clone()  # the chain's layout
        for i, node in enumerate(along):
            chain_k[0, :, 254 + i], chain_v[0, :, 254 + i] = k_cache[0, :, 254 + node], \
                v_cache[0, :, 254 + node]
        chain = attend(q[t:t + 1], fk.FusedStep.chains(slots[:1], torch.tensor(
            [254 + len(along) - 1], device=DEV), 1), chain_k, chain_v)
        assert torch.equal(tree[t], chain[0])


def test_the_tiles_kernel_passes_the_start_probe():
    """(The split kernel's probe takes 40 s under the interpreter: the GPU sitting runs it;
    test_the_split_kernel_sums_fixed_key_chunks_whatever_the_call holds its bits here.)"""
    assert fap.probe_slot_attention(torch.float32, DEV, 4, 2, 16, kernel="tiles") is None


@pytest.mark.parametrize("varies,says", [
    (lambda start, width: width > 9, "query 0 of a 16-token row at 250 keys"),
    (lambda start, width: width > 1 and start > 2048, "query 0 of a 16-token row at 2100 keys"),
    (lambda start, width: width > 1 and start < 256 < start + width,
     "query 0 of a 16-token row at 250 keys")])
def test_the_start_probe_covers_wide_rows_long_slots_and_rows_crossing_256(monkeypatch,
                                                                            varies, says):
    """The probe catches an attention whose bits would change only in rows of more than 9
    tokens, past 2,048 keys, or crossing key 256 (the tiles kernel as it is passes it:
    test_the_tiles_kernel_passes_the_start_probe)."""
    real = fa.slot_attention

    def attention(q, step, *a, **kw):  # a row's outputs nudged where ``varies`` says
        out = real(q, step, *a, **kw).clone()
        for b, start in enumerate(step.starts.tolist()):
            if varies(start, step.width):
                out[b * step.width:(b + 1) * step.width] *= 1 + 2 ** -10
        return out

    monkeypatch.setattr(fa, "slot_attention", attention)
    differs = fap.probe_slot_attention(torch.float32, DEV, 4, 2, 16, kernel="tiles")
    assert differs is not None and says in differs


def test_an_unknown_attention_kernel_is_refused():
    k_cache, v_cache = _cache(1, 1, 64, 16, torch.float32, 0)
    step = fk.FusedStep.chains(torch.tensor([0], device=DEV), torch.tensor([3], device=DEV), 1)
    with pytest.raises(ValueError, match="attention kernel must be one of"):
        fa.slot_attention(_rand(1, 16), step, k_cache, v_cache, 1, 1, 16, 0.25, kernel="flash")
