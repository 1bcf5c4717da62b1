"""The fused runner's attention over KV slots: fixed-config Triton kernels, one contract.

Each query of a step attends over its own slot: the slot's first ``start`` positions, then its
own ancestors among the step's rows (a chain's earlier tokens, a tree node's path from the
root), read in decoding order, so a tree node gets the bits of the chain root -> ... -> node
decoded one token at a time. Lengths and paths are device data (no host sync, one graph for
every length).

- ``"tiles"`` (the default): one program per (session, kv head, chunk of queries); its tile's
  rows are the queries' q heads that share the kv head (GQA), so each key and value block is
  read once for up to ``BLOCK_M`` rows and both products run as ``tl.dot``. The blocks of the
  slot's prefix are read once for every row; from the block holding the step's first row on, a
  tree's queries whose paths differ need different keys in the same lanes, so the program
  makes one pass per distinct path there (deepest query first; a chain needs one pass), each
  updating only the rows whose path it covers.
- ``"rows"``: one program per (query, q head), keys summed elementwise in float32. Re-reads
  every key block for every query and head (the first GPU sitting's kernel; kept as the
  fallback where the tiles' probe fails, and for comparison).
- ``"split"``: the tiles over fixed chunks of ``SPLIT_KEYS`` keys at absolute positions, a
  program per chunk, each chunk's softmax state from scratch, merged in chunk order by a second
  kernel (``_merge_state``): decode over a long slot spreads over the chip.
- ``"chunks"``: the tiles' grid doing the split kernel's arithmetic, each program walking its
  rows' chunks in turn (from scratch, merged in order by the same ``_merge_state``): the split
  kernel's bits where a tile product's element does not depend on the tile's rows (the start
  probe proves each kernel; the sitting compares the two), so a runner could take either by
  the step, split for decode over long slots and chunks for wide steps, without a row's bits
  moving.
- ``"split-decode"``: split for a call of one token a row (decode: the long slot spread over
  the chip), chunks for a wider one. One kernel's bits only where chunks gives split's, which
  is what its start probe checks (a query alone runs split, the same query in a wider call
  chunks). Not chosen by any runner unless asked for: the GPU sitting times it against tiles.

Batch invariance is structural in both: a row's keys sit in the lanes of their logical
position (blocks of ``KEY_BLOCK`` from position 0, whatever else is in the call), every shape
is a compile-time constant of the model, the number of tokens is not specialised on, and rows
a pass does not cover are left untouched (``tl.where``, not arithmetic with zeros). For the
tiles this also rests on a product's output element being computed the same way wherever its
row sits in the tile: ``fused_attention_probe`` proves it on the device at start.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import KEY_BLOCK
from .fused_kernels import FusedStep, padded_rows

ATTENTION_KERNELS = ("tiles", "rows", "split", "chunks", "split-decode")
PROBE_ORDER = ATTENTION_KERNELS[:4]  # tried in turn when none is asked for: not split-decode
TILE_ROWS_MIN = 16  # tl.dot's smallest tile side
SPLIT_KEYS = 256  # the split kernel's chunk of keys, at absolute positions (KEY_BLOCK multiple)
SPLIT_QUERIES = 16  # the queries a split program holds where its tile allows (a graphed row's)
SPLIT_TILE_MAX = 64  # the split kernel's tile rows at most


@triton.jit
def _attend_block(q, k, v, offs, n, active, acc, top, denom, scale, PREC: tl.constexpr):
    """One block of keys k and values v [BLOCK_N, HD] at positions ``offs`` into the running
    softmax (acc [BLOCK_M, HD], top, denom [BLOCK_M]) of the rows ``active``, each seeing its
    positions < n; the other rows' state comes back as it was."""
    scores = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # [BLOCK_M, BLOCK_N]
    scores = tl.where(active[:, None] & (offs[None, :] < n[:, None]), scores, float("-inf"))
    new_top = tl.where(active, tl.maximum(top, tl.max(scores, axis=1)), 0.0)
    keep = tl.exp(tl.where(active, top, 0.0) - new_top)
    p = tl.exp(scores - new_top[:, None])
    pv = tl.dot(p.to(v.dtype), v, input_precision=PREC)  # [BLOCK_M, HD]
    acc = tl.where(active[:, None], acc * keep[:, None] + pv, acc)
    denom = tl.where(active, denom * keep + tl.sum(p, axis=1), denom)
    top = tl.where(active, new_top, top)
    return acc, top, denom


@triton.jit
def _chunk_state(q, k_base, v_base, ks_pos, vs_pos, depth_ptr, path_ptr, b, T, t0, r, qt, d,
                 live, n, start, depth, lo, hi, scale, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, HD: tl.constexpr, QPP: tl.constexpr,
                 PREC: tl.constexpr):
    """The softmax state (acc [BLOCK_M, HD], top, denom [BLOCK_M]) of the tile's rows over
    their keys at logical positions [lo, hi), from scratch."""
    acc = tl.zeros([BLOCK_M, HD], tl.float32)
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    # the blocks below the one holding ``start`` hold the slot's prefix alone: every row's,
    # read once for all of them
    shared = (start // BLOCK_N) * BLOCK_N
    for block in range(lo, tl.minimum(shared, hi), BLOCK_N):
        offs = block + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs[:, None] * ks_pos + d[None, :])
        v = tl.load(v_base + offs[:, None] * vs_pos + d[None, :])
        acc, top, denom = _attend_block(q, k, v, offs, n, live, acc, top, denom, scale, PREC)
    # from there on, one pass per distinct path, the deepest-numbered query first; a pass
    # reads its keys along ref's path and updates the rows it covers: ref and its ancestors
    done = r < 0
    for s in range(QPP):
        ref = t0 + QPP - 1 - s
        has_ref = ref < T
        ref_row = b * T + ref
        ref_depth = tl.load(depth_ptr + ref_row, mask=has_ref, other=0)
        at = tl.load(path_ptr + ref_row * T + depth, mask=live & has_ref & (depth <= ref_depth),
                     other=-1)
        cover = live & (~done) & (at == qt)
        n_ref = tl.max(tl.where(cover, n, 0), axis=0)  # 0: nothing left to cover here
        for block in range(tl.maximum(shared, lo), tl.minimum(n_ref, hi), BLOCK_N):
            offs = block + tl.arange(0, BLOCK_N)
            have = offs < n_ref
            on_path = offs >= start
            step_row = tl.load(path_ptr + ref_row * T + (offs - start), mask=have & on_path,
                               other=0)
            where = tl.where(on_path, start + step_row, offs)
            k = tl.load(k_base + where[:, None] * ks_pos + d[None, :], mask=have[:, None],
                        other=0.0)
            v = tl.load(v_base + where[:, None] * vs_pos + d[None, :], mask=have[:, None],
                        other=0.0)
            acc, top, denom = _attend_block(q, k, v, offs, n, cover & (block < n), acc, top,
                                            denom, scale, PREC)
        done = done | cover
    return acc, top, denom


@triton.jit
def _merge_state(acc, top, denom, s_acc, s_top, s_den):
    """A chunk's softmax state (s_*) merged into the running one: the split kernel's merge and
    the chunks kernel's, the same arithmetic in both."""
    new_top = tl.maximum(top, s_top)
    keep, take = tl.exp(top - new_top), tl.exp(s_top - new_top)
    acc = acc * keep[:, None] + s_acc * take[:, None]
    denom = denom * keep + s_den * take
    return acc, new_top, denom


@triton.jit(do_not_specialize=["T", "NS"])
def _tile_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, start_ptr, depth_ptr,
                           path_ptr, T, out_ptr, scale,
                           ks_slot, ks_head, ks_pos, vs_slot, vs_head, vs_pos,
                           part_acc_ptr, part_top_ptr, part_den_ptr, NS,
                           NH: tl.constexpr, GROUP: tl.constexpr, HD: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                           SPLIT: tl.constexpr, CHUNKED: tl.constexpr):
    """SPLIT 0: every key of the rows in one running softmax, the outputs into out_ptr. SPLIT >
    0, not CHUNKED: the keys at logical positions [split SPLIT, (split + 1) SPLIT) only
    (program_id(2) = chunk of queries x NS + split), the partial softmax state of each row with
    keys there into part_*[(row NH + head) NS + split] (``_merge_splits_kernel`` merges them).
    SPLIT > 0, CHUNKED: every chunk of SPLIT keys in turn, each from scratch and merged into the
    running state in chunk order as the merge kernel does (the split kernel's arithmetic in one
    program), the outputs into out_ptr."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    QPP: tl.constexpr = BLOCK_M // GROUP  # queries a program holds
    if SPLIT > 0 and not CHUNKED:
        t0 = (tl.program_id(2) // NS) * QPP
        split = tl.program_id(2) % NS
        lo = split * SPLIT
        hi = lo + SPLIT
    else:
        t0 = tl.program_id(2) * QPP
        split = 0
        lo = 0
        hi = SPLIT if CHUNKED else 1 << 30
    r = tl.arange(0, BLOCK_M)
    qt = t0 + r // GROUP  # each tile row's query and q head
    live = (r < QPP * GROUP) & (qt < T)
    head = kvh * GROUP + r % GROUP
    row = b * T + qt
    d = tl.arange(0, HD)
    slot = tl.load(slot_ptr + b)
    start = tl.load(start_ptr + b)
    depth = tl.load(depth_ptr + row, mask=live, other=0)
    n = start + depth + 1  # keys each row sees
    q = tl.load(q_ptr + row[:, None] * (NH * HD) + head[:, None] * HD + d[None, :],
                mask=live[:, None], other=0.0)  # [BLOCK_M, HD]
    k_base = k_cache_ptr + slot * ks_slot + kvh * ks_head
    v_base = v_cache_ptr + slot * vs_slot + kvh * vs_head
    acc, top, denom = _chunk_state(q, k_base, v_base, ks_pos, vs_pos, depth_ptr, path_ptr, b,
                                   T, t0, r, qt, d, live, n, start, depth, lo, hi, scale,
                                   BLOCK_M, BLOCK_N, HD, QPP, PREC)
    if CHUNKED:  # the chunks past the first, each merged for the rows with keys in it
        for c in range(SPLIT, tl.max(tl.where(live, n, 0), axis=0), SPLIT):
            s_acc, s_top, s_den = _chunk_state(q, k_base, v_base, ks_pos, vs_pos, depth_ptr,
                                               path_ptr, b, T, t0, r, qt, d, live, n, start,
                                               depth, c, c + SPLIT, scale, BLOCK_M, BLOCK_N,
                                               HD, QPP, PREC)
            # idle tile rows (no query) carry -inf tops: zeros there keep the merge finite
            m_acc, m_top, m_den = _merge_state(acc, tl.where(live, top, 0.0), denom, s_acc,
                                               tl.where(live, s_top, 0.0), s_den)
            has = live & (c < n)
            acc = tl.where(has[:, None], m_acc, acc)
            top = tl.where(has, m_top, top)
            denom = tl.where(has, m_den, denom)
    if SPLIT > 0 and not CHUNKED:
        has = live & (lo < n)  # the rows with keys in this split
        at = (row.to(tl.int64) * NH + head) * NS + split  # int64: a long cache's partials
        tl.store(part_acc_ptr + at[:, None] * HD + d[None, :], acc, mask=has[:, None])
        tl.store(part_top_ptr + at, top, mask=has)
        tl.store(part_den_ptr + at, denom, mask=has)
    else:
        out = acc / tl.where(live, denom, 1.0)[:, None]
        tl.store(out_ptr + row[:, None] * (NH * HD) + head[:, None] * HD + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit(do_not_specialize=["T", "NS"])
def _merge_splits_kernel(part_acc_ptr, part_top_ptr, part_den_ptr, start_ptr, depth_ptr, T, NS,
                         out_ptr, NH: tl.constexpr, NH_P2: tl.constexpr, HD: tl.constexpr,
                         SPLIT: tl.constexpr):
    """One row, all its q heads: each head's splits' partial softmax states merged in split
    order (the first as it is, then each of the others into the running state), divided by
    their sum."""
    row = tl.program_id(0)
    n = tl.load(start_ptr + row // T) + tl.load(depth_ptr + row) + 1
    h = tl.arange(0, NH_P2)
    heads = h < NH
    d = tl.arange(0, HD)
    at = (row.to(tl.int64) * NH + h) * NS  # [NH_P2]: each head's first split
    acc = tl.load(part_acc_ptr + at[:, None] * HD + d[None, :], mask=heads[:, None], other=0.0)
    top = tl.load(part_top_ptr + at, mask=heads, other=0.0)
    denom = tl.load(part_den_ptr + at, mask=heads, other=1.0)
    for s in range(1, tl.cdiv(n, SPLIT)):  # every split below n holds keys of this row
        s_top = tl.load(part_top_ptr + at + s, mask=heads, other=0.0)
        s_acc = tl.load(part_acc_ptr + (at + s)[:, None] * HD + d[None, :], mask=heads[:, None],
                        other=0.0)
        s_den = tl.load(part_den_ptr + at + s, mask=heads, other=1.0)
        acc, top, denom = _merge_state(acc, top, denom, s_acc, s_top, s_den)
    tl.store(out_ptr + row * (NH * HD) + h[:, None] * HD + d[None, :],
             (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=heads[:, None])


@triton.jit(do_not_specialize=["T"])
def _row_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, start_ptr, depth_ptr,
                          path_ptr, T, out_ptr, scale,
                          ks_slot, ks_head, ks_pos, vs_slot, vs_head, vs_pos,
                          NH: tl.constexpr, GROUP: tl.constexpr, HD: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    row = tl.program_id(0)  # b * T + t
    head = tl.program_id(1)
    b = row // T
    kvh = head // GROUP
    slot = tl.load(slot_ptr + b)
    start = tl.load(start_ptr + b)
    n = start + tl.load(depth_ptr + row) + 1  # keys seen: the slot's prefix, then the path
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + row * (NH * HD) + head * HD + d).to(tl.float32)
    k_base = k_cache_ptr + slot * ks_slot + kvh * ks_head
    v_base = v_cache_ptr + slot * vs_slot + kvh * vs_head
    top = tl.full([1], float("-inf"), tl.float32)
    denom = tl.zeros([1], tl.float32)
    acc = tl.zeros([HD], tl.float32)
    for block in range(0, n, BLOCK_N):  # this query's own keys, in order from position 0
        offs = block + tl.arange(0, BLOCK_N)
        seen = offs < n
        on_path = offs >= start
        step_row = tl.load(path_ptr + row * T + (offs - start), mask=seen & on_path, other=0)
        where = tl.where(on_path, start + step_row, offs)
        k = tl.load(k_base + where[:, None] * ks_pos + d[None, :], mask=seen[:, None],
                    other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale  # [BLOCK_N]
        scores = tl.where(seen, scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, axis=0))
        keep = tl.exp(top - new_top)
        p = tl.exp(scores - new_top)
        denom = denom * keep + tl.sum(p, axis=0)
        v = tl.load(v_base + where[:, None] * vs_pos + d[None, :], mask=seen[:, None],
                    other=0.0).to(tl.float32)
        acc = acc * keep + tl.sum(p[:, None] * v, axis=0)
        top = new_top
    tl.store(out_ptr + row * (NH * HD) + head * HD + d,
             (acc / denom).to(out_ptr.dtype.element_ty))


def supports_tiles(head_dim: int) -> bool:
    """Whether the tiles kernel serves this head size (``tl.dot`` needs 16 and more)."""
    return head_dim >= TILE_ROWS_MIN


def tile_rows(n_heads: int, kv_heads: int) -> int:
    """Rows of the tiles kernel's tile for this head layout: q heads of one kv head, whole
    queries, at least ``TILE_ROWS_MIN``."""
    group = n_heads // kv_heads
    return max(TILE_ROWS_MIN, triton.next_power_of_2(group))


def split_tile_rows(n_heads: int, kv_heads: int) -> int:
    """Rows of the split kernel's tile: the q heads of one kv head for ``SPLIT_QUERIES`` queries
    (a graphed row's, read in one program: a key chunk read once for all of them), at most
    ``SPLIT_TILE_MAX``; one constant per model, so a row's bits do not depend on the step."""
    group = n_heads // kv_heads
    return max(tile_rows(n_heads, kv_heads),
               min(SPLIT_TILE_MAX, triton.next_power_of_2(SPLIT_QUERIES * group)))


def slot_attention(q: torch.Tensor, step: FusedStep, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, n_heads: int, kv_heads: int, head_dim: int,
                   scale: float, out: torch.Tensor | None = None,
                   kernel: str = "tiles", warps: int | None = None) -> torch.Tensor:
    """Rotated queries [>=R, nh hd] (R = B T rows of ``step``) attend over their slots' keys
    k_cache / v_cache [slots, kvh, positions, >=hd] (written for this step already): row b's
    query t sees positions < start[b], then the rows path[b, t, 0..depth[b, t]] of its own
    step, stored at start[b] + that row. Returns [padded_rows(R), nh hd] (rows past R not
    written). ``kernel``: one of ``ATTENTION_KERNELS`` (``split``: the tiles over fixed chunks
    of ``SPLIT_KEYS`` keys, merged in chunk order; ``split-decode``: split for one token a
    row, else chunks); ``warps``: Triton's warps a program
    (default 4 for heads of 128 and more, else 2; the sitting times others)."""
    R = step.rows
    if kernel == "split-decode":  # by the call's width, a graph bucket's a constant
        kernel = "split" if step.width == 1 else "chunks"
    if out is None:
        out = torch.empty(padded_rows(R), n_heads * head_dim, dtype=q.dtype, device=q.device)
    group = n_heads // kv_heads
    warps = warps or (4 if head_dim >= 128 else 2)
    strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    args = (q, k_cache, v_cache, step.slots, step.starts, step.depth, step.path, step.width,
            out, scale, *strides)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    if kernel == "tiles":
        block_m = tile_rows(n_heads, kv_heads)
        grid = (step.batch, kv_heads, triton.cdiv(step.width, block_m // group))
        _tile_attention_kernel[grid](
            *args, out, out, out, 1, NH=n_heads, GROUP=group, HD=head_dim, BLOCK_M=block_m,
            BLOCK_N=KEY_BLOCK, PREC=prec, SPLIT=0, CHUNKED=False, num_warps=warps)
    elif kernel == "split":
        # a program per (session, kv head, chunk of queries, chunk of SPLIT_KEYS keys), as many
        # key chunks as the step's longest row needs where the host knows it, else as the
        # cache holds (a graph's grid is fixed): those past a row's keys store nothing, and the
        # merge reads a row's own chunks only, so the count never changes a row's bits
        block_m = split_tile_rows(n_heads, kv_heads)
        n_splits = triton.cdiv(min(step.keys or k_cache.shape[2], k_cache.shape[2]),
                               SPLIT_KEYS)
        parts = R * n_heads * n_splits
        acc = torch.empty(parts * head_dim, dtype=torch.float32, device=q.device)
        top = torch.empty(parts, dtype=torch.float32, device=q.device)
        den = torch.empty(parts, dtype=torch.float32, device=q.device)
        grid = (step.batch, kv_heads, triton.cdiv(step.width, block_m // group) * n_splits)
        _tile_attention_kernel[grid](
            *args, acc, top, den, n_splits, NH=n_heads, GROUP=group, HD=head_dim,
            BLOCK_M=block_m, BLOCK_N=KEY_BLOCK, PREC=prec, SPLIT=SPLIT_KEYS, CHUNKED=False,
            num_warps=warps)
        _merge_splits_kernel[(R,)](
            acc, top, den, step.starts, step.depth, step.width, n_splits, out, NH=n_heads,
            NH_P2=triton.next_power_of_2(n_heads), HD=head_dim, SPLIT=SPLIT_KEYS,
            num_warps=4 if n_heads * head_dim >= 2048 else 1)
    elif kernel == "chunks":  # the tiles' grid, the split kernel's arithmetic
        block_m = tile_rows(n_heads, kv_heads)
        grid = (step.batch, kv_heads, triton.cdiv(step.width, block_m // group))
        _tile_attention_kernel[grid](
            *args, out, out, out, 1, NH=n_heads, GROUP=group, HD=head_dim, BLOCK_M=block_m,
            BLOCK_N=KEY_BLOCK, PREC=prec, SPLIT=SPLIT_KEYS, CHUNKED=True, num_warps=warps)
    elif kernel == "rows":
        _row_attention_kernel[(R, n_heads)](
            *args, NH=n_heads, GROUP=group, HD=head_dim, BLOCK_N=KEY_BLOCK, num_warps=warps)
    else:
        raise ValueError(f"attention kernel must be one of {ATTENTION_KERNELS}, not {kernel!r}")
    return out
