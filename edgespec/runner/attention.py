"""Batch-invariant attention: a query's output has the same bits whatever else is in the call.

``torch.nn.functional.scaled_dot_product_attention`` picks its blocking from the call's shapes,
so one query over exactly its n keys and the same query as one row of an 8-query forward over
n + 7 keys (the later ones masked) get different bits (measured on the default model: 5.2e-5 in
float32, 0.44 in bfloat16). Speculative decoding is only lossless if they agree, since a verified
token must see the logits that decoding it alone would.

Here every reduction a query's output goes through has a shape that does not depend on the batch:

- scores: keys @ queries^T as one matrix product per (row, kv head) with the keys as the product's
  rows (a multiple of ``KEY_BLOCK``) and the queries as its columns (padded to a multiple of
  ``col_tile``, at most ``MAX_COLS`` a product), reducing over head_dim only;
- max over the keys: exact in any order; exp: elementwise, every element on the vectorised path
  (``pointwise``);
- values: per key block of ``KEY_BLOCK`` keys, values^T @ probs with a fixed reduction length
  (the block), a ones row appended to the values so the same product also yields the softmax
  denominator; blocks are then summed in order by one running sum (``cumsum``: ``sum`` picks
  its association from the shape): blocks past a query's context add exact zeros.

Measured here (oneDNN bfloat16, MKL float32): every product of these shapes gives each output
element the same bits for any number of rows, batch entries and (for float32) columns in
multiples of 16; ``attention_probe.probe_invariance`` checks that on the machine at hand
before a dtype is served, at every width a call can have, and ``dtype_probe`` takes the first
tile that passes: 1 (no padding: an AVX-512 Xeon's oneDNN and MKL give a column its bits at any
width), 16 to 128, or products of exactly 16 columns (MKL's AVX2 float32 kernel blocks a
product's columns by its own register width and gives the columns of a narrow last block other
bits).

Since a query's output depends neither on the other queries of a call nor on key blocks past its
context, the CPU need not compute what it would throw away: a call of many queries (a prompt's
chunk) runs in pieces of ``QUERY_PIECE`` queries, each over the blocks its queries see
(``_in_query_pieces``), and the runner gives the rows of a step that read far fewer blocks than
another a call of their own (``row_groups``). Same bits, less work.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..config import MAX_TREE_NODES

KEY_BLOCK = 64  # keys per block of the values product: its reduction length
COL_TILE = 16  # query columns are padded to a multiple of this where no smaller tile is exact
MAX_COLS = 256  # at most this many query columns per product (MKL float32 blocks wider ones
# differently); wider calls (a prefill chunk, a long tree of a wide-grouped model) run in pieces
# queries a piece of a long call (a prompt's chunk) on the CPU: see ``_in_query_pieces``
QUERY_PIECE = 64
# the most queries a row of one CPU call holds: a piece, or a token tree's call (its tail keys
# keep it whole: its last token and every node)
CALL_TOKENS = max(QUERY_PIECE, 1 + MAX_TREE_NODES)
# query columns (g x T) from which the CPU's softmax runs in the scores' own layout: the keys
# innermost pays for a few columns (a many-session step), two transposing copies for many
WIDE_COLUMNS = 64
# a call's rows run in groups by the key blocks they read (``row_groups``) where a cut saves
# more than this many row x key-block x query products (a group's calls and its keys' gather
# cost about as many: one token a row needs 32 row-blocks saved, four 8), in at most
# MAX_ROW_GROUPS groups
ROW_GROUP_COST = 32
MAX_ROW_GROUPS = 4
PIECE = 32768  # torch runs a pointwise op on fewer elements on one thread (its grain size)
# calls of at most this many rows read a view of the cache's values through a copy and one
# product: a product a key block costs a few calls' overhead a block, which a lone session's
# decode pays for every block of its context (see ``_value_blocks``)
COPIED_ROWS = 4


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for a pointwise op whose vectorised and scalar code differ in the last bit
    (exp, log, silu), with every element on the vectorised path whatever the shape and the
    thread count. torch runs such an op on k = min(threads, ceil(n / PIECE)) threads, each
    taking ceil(n / k) elements, and hands the last n % 64 (or fewer) elements of each share to
    scalar code; so on CPU the flattened input is padded until every share is a whole number
    of 64 elements."""
    if x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    n = size = flat.numel()
    threads = torch.get_num_threads()
    _warm_pointwise(threads)
    while True:  # grows at most a few times: a share of 64 * k more each time
        k = max(1, min(threads, -(-size // PIECE)))
        padded = -(-size // (64 * k)) * 64 * k
        if padded == size:
            break
        size = padded
    if size != n:
        flat = torch.cat([flat, flat.new_zeros(size - n)])
    return fn(flat)[:n].view(x.shape)


@functools.lru_cache(maxsize=None)
def _warm_pointwise(threads: int) -> None:
    """Run exp, log and silu once over every thread's share at this thread count, before any
    call whose bits count: the first parallel exp of a process at 2 threads sometimes computed
    the second thread's share with other bits than every later call did (the same input; about
    one process in four here, a start probe's first call among them), and a warm-up of that op
    alone stopped it (another op's did not)."""
    x = torch.linspace(0.5, 4.0, 2 * PIECE * max(1, threads))
    for op in (torch.exp, torch.log, torch.nn.functional.silu):
        op(x)


def _by_columns(a: torch.Tensor, b: torch.Tensor, max_cols: int = MAX_COLS) -> torch.Tensor:
    """a @ b with at most ``max_cols`` of b's columns per product."""
    if b.shape[-1] <= max_cols:
        return torch.matmul(a, b)
    return torch.cat([torch.matmul(a, b[..., i:i + max_cols])
                      for i in range(0, b.shape[-1], max_cols)], dim=-1)


def padded_keys(n: int, max_len: int) -> int:
    """The number of key positions a forward over the first ``n`` reads: n rounded up to a
    whole block (``max_len`` is a multiple of KEY_BLOCK)."""
    return min(max_len, -(-n // KEY_BLOCK) * KEY_BLOCK)


@dataclass
class TailKeys:
    """Keys of queries whose own ancestors are stored out of decoding order (a token tree's
    branch nodes): from logical block ``block0`` on, each such query reads the positions
    ``index`` in decoding order; its earlier keys are its row's first 64 * block0 positions
    (the main ``visible`` must hide every later position from it)."""

    rows: torch.Tensor  # [S] long: the query's batch row
    queries: torch.Tensor  # [S] long: the query's index t in its row
    index: torch.Tensor  # [S, TB] long: physical position of logical position 64*block0 + j
    visible: torch.Tensor  # [S, TB] bool
    block0: torch.Tensor  # [S] long: the first logical block read through ``index``
    n_blocks: int  # blocks the sum spans: >= max(block0) + TB / KEY_BLOCK
    # [B, T, n] bool: every key each query of the call attends to, wherever it is stored (the
    # softmax's max and probabilities come from it; ``invariant_attention``'s ``visible`` is
    # what the main value product sums). None: the runner sets it per forward (its n).
    seen: torch.Tensor | None = None


@dataclass(frozen=True)
class RowGroup:
    """Rows of a forward whose attention is a call of their own on the CPU (``row_groups``): a
    row of a long context among short ones would make every row read its blocks. The same bits
    either way: a row's output depends neither on the other rows nor on key blocks past its
    context."""

    rows: torch.Tensor  # [Bg] long, ascending: the group's batch rows
    keys: int  # the keys the group reads: its slots' first ``keys``
    visible: torch.Tensor  # [Bg, T, keys] bool: the group's mask
    ends: list[int] | None  # ``call_ends(visible)``


def row_groups(visible: torch.Tensor) -> tuple[RowGroup, ...]:
    """``visible`` [B, T, n]'s rows grouped by the key blocks each reads (sorted by them, cut
    where a cut saves more than ROW_GROUP_COST row-blocks x queries, at most MAX_ROW_GROUPS
    groups); none where the rows run together. Found once a forward, read by every layer."""
    B, T, n = visible.shape
    if B < 2 or visible.device.type != "cpu":
        return ()
    reach = _reach(visible, 1)  # [B]: one past each row's last key
    # read through NumPy: on the CPU no wait (a step's one host sync stays its verdicts')
    blocks = ((reach + KEY_BLOCK - 1) // KEY_BLOCK).clamp(min=1).numpy().tolist()
    lo_b, hi_b = min(blocks), max(blocks)
    if (hi_b - lo_b) * (B - 1) * T <= ROW_GROUP_COST:  # cannot pay: the usual step
        return ()
    order = sorted(range(B), key=blocks.__getitem__)
    ranked = [blocks[i] for i in order]
    segments = [(0, B)]
    while len(segments) < MAX_ROW_GROUPS:
        best = (ROW_GROUP_COST, -1, -1, -1)
        for lo, hi in segments:  # a cut at i: rows lo..i-1 read ranked[i - 1] blocks, not top
            top = ranked[hi - 1]
            for i in range(lo + 1, hi):
                saved = (i - lo) * (top - ranked[i - 1]) * T
                if ranked[i] != ranked[i - 1] and saved > best[0]:
                    best = (saved, lo, i, hi)
        if best[1] < 0:
            break
        _, lo, i, hi = best
        segments.remove((lo, hi))
        segments += [(lo, i), (i, hi)]
    if len(segments) == 1:
        return ()
    groups = []
    for lo, hi in sorted(segments):
        rows, k = torch.tensor(sorted(order[lo:hi])), min(n, ranked[hi - 1] * KEY_BLOCK)
        seen = visible[:, :, :k].index_select(0, rows)
        groups.append(RowGroup(rows, k, seen, call_ends(seen)))
    return tuple(groups)


def invariant_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        visible: torch.Tensor, col_tile: int = COL_TILE,
                        tail: TailKeys | None = None,
                        products: torch.dtype | None = None,
                        ends: list[int] | None = None, max_cols: int = MAX_COLS
                        ) -> torch.Tensor:
    """Attention of grouped queries over a slot's keys, batch-invariantly.

    q: [B, kvh, g, T, hd] (already scaled and rotated; query head kv * g + j is [:, kv, j]);
    keys: [B, kvh, n, hd]; values: [B, kvh, n, hd + 1], the last column all ones;
    visible: [B, T, n] bool (query t of row b may see key j); n a multiple of KEY_BLOCK;
    ``tail``: the queries that read their last blocks in decoding order (tree branch nodes);
    ``products``: the dtype the two products run in (None: q's; float32 where bfloat16 is
    emulated, ``cpu_kind``: a product of bfloat16 inputs is exact in float32, so only the
    summation order is the kernel's, and MKL's float32 one is fixed);
    ``ends``: ``call_ends(visible)``, from a caller that found it once for many calls with the
    same mask (a forward's layers); None: found here when needed. ``max_cols``: the most query
    columns a product takes (``col_tile``: every product exactly that wide, where a BLAS blocks
    wider ones by their width, ``dtype_probe``).
    Returns [B, T, kvh * g * hd] in q's dtype.
    """
    out_dtype = q.dtype
    if products is not None and products != q.dtype:
        q, keys, values = q.to(products), keys.to(products), values.to(products)
    if tail is not None or q.device.type != "cpu":
        return _attend(q, keys, values, visible, col_tile, tail, max_cols).to(out_dtype)
    if q.shape[3] > QUERY_PIECE:
        return _in_query_pieces(q, keys, values, visible, col_tile,
                                query_ends(visible) if ends is None else ends,
                                max_cols).to(out_dtype)
    return _attend(q, keys, values, visible, col_tile, None, max_cols).to(out_dtype)


def _reach(visible: torch.Tensor, dim: int) -> torch.Tensor:
    """One past the last key ``visible`` [B, T, n] shows, reduced over ``dim`` (1: each row's,
    over its queries; 0: each query's, over the rows); 0 where none. (A bool tensor's any() over
    a dimension that is not the innermost is 10-40x slower on the CPU than a uint8 max.)"""
    seen = visible.view(torch.uint8).amax(dim)  # [*, n]
    last = seen.shape[-1] - seen.flip(-1).argmax(-1)
    return torch.where(seen.amax(-1).bool(), last, 0)


def query_ends(visible: torch.Tensor) -> list[int]:
    """One past the last key each query of ``visible`` [B, T, n] (on the CPU) sees, over every
    row: [T], read through NumPy (no wait: a step's one host sync stays its verdicts')."""
    return _reach(visible, 0).numpy().tolist()


def call_ends(visible: torch.Tensor) -> list[int] | None:
    """``query_ends(visible)`` where a call over it runs in query pieces (on the CPU, more than
    QUERY_PIECE queries), else None: what ``invariant_attention``'s ``ends`` takes."""
    long_call = visible.shape[1] > QUERY_PIECE and visible.device.type == "cpu"
    return query_ends(visible) if long_call else None


def _in_query_pieces(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     visible: torch.Tensor, col_tile: int, ends: list[int],
                     max_cols: int = MAX_COLS) -> torch.Tensor:
    """``_attend`` over QUERY_PIECE queries at a time, each piece reading only the key blocks
    up to the last key one of its queries sees: a prompt's chunk is causal, so its early
    queries skip most of the keys, and each piece's scores stay in the CPU's cache (the default
    model's 2,000-token prompt prefilled 2.4-3.7x faster). The same bits: a
    query's output does not depend on the other queries of the call nor on key blocks past its
    context (the module's invariance, which ``attention_probe`` checks at start). ``ends``:
    ``query_ends(visible)``."""
    B, kvh, g, T, hd = q.shape
    n = keys.shape[2]
    values = values.contiguous()  # once, not a product a key block (or a copy) a piece
    out = []
    for t0 in range(0, T, QUERY_PIECE):
        t1 = min(T, t0 + QUERY_PIECE)
        k = max(KEY_BLOCK, padded_keys(max(ends[t0:t1]), n))
        out.append(_attend(q[:, :, :, t0:t1], keys[:, :, :k], values[:, :, :k],
                           visible[:, t0:t1, :k], col_tile, None, max_cols))
    return torch.cat(out, dim=1)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
            col_tile: int, tail: TailKeys | None, max_cols: int = MAX_COLS) -> torch.Tensor:
    """``invariant_attention`` in the products' dtype, its output [B, T, kvh * g * hd] in
    float32."""
    B, kvh, g, T, hd = q.shape
    n = keys.shape[2]
    nb = n // KEY_BLOCK
    m = g * T
    cols = -(-m // col_tile) * col_tile
    qt = q.permute(0, 1, 4, 2, 3).reshape(B, kvh, hd, m)  # [B, kvh, hd, g*T]
    if cols != m:
        qt = torch.nn.functional.pad(qt, (0, cols - m))
    # the softmax runs on the m query columns alone: each column's max is its own and exp is
    # pointwise, so a column's bits do not depend on the others; the padding columns enter the
    # value product as zeros (its shape, hence each real column's bits, as before)
    scores = _by_columns(keys, qt, max_cols)[..., :m].float()  # [B, kvh, n, m]
    if tail is None:
        # the softmax with the keys innermost ([B, kvh, m, n]) for a few columns (innermost,
        # they made the max and the masking strided, most of a many-session step's attention);
        # in the scores' own layout on the CPU from WIDE_COLUMNS columns on (a prompt's chunk:
        # two transposing copies saved). The max is exact in any order and the rest is
        # pointwise: the same bits either way. The hidden keys are zeroed after the exp, not
        # sent to it as -inf (a vector holding one takes this CPU's exp's slow path: 6-10x with
        # a third of them): a visible key's probability is the same bits, a hidden one's 0,
        # whatever its stale score (NaN and inf included). Only a visible score that is not
        # finite (activations overflowed) gives a NaN of another sign or payload than before:
        # NaN either way.
        inner = m < WIDE_COLUMNS or q.device.type != "cpu"
        if inner:
            scores = scores.transpose(2, 3).contiguous()
        hidden = ~(_row_mask(visible, g) if inner else _column_mask(visible, g))
        top = scores.masked_fill(hidden, float("-inf")).amax(dim=3 if inner else 2,
                                                             keepdim=True)
        # out of place: exp's backward reads its output
        probs = pointwise(torch.exp, scores - top).masked_fill(hidden, 0).to(values.dtype)
        if inner:
            probs = probs.transpose(2, 3)
    else:  # the max and probabilities over every key a query sees; the main sum only ``vis``
        assert tail.seen is not None
        scores = scores.masked_fill(~_column_mask(tail.seen, g), float("-inf"))
        top = scores.amax(dim=2, keepdim=True)
        probs = pointwise(torch.exp, scores - top).to(values.dtype)
        t_probs, t_cols = _tail_probs(probs, tail, g, T, col_tile)
        probs = probs.masked_fill(~_column_mask(visible, g), 0)
    # [B, kvh, n, cols], laid out as the value product has always read it
    probs = torch.nn.functional.pad(probs, (0, cols - m)) if cols != m else probs.contiguous()
    # [B, kvh, nb, hd+1, cols]
    part = _value_blocks(values, probs.view(B, kvh, nb, KEY_BLOCK, cols), max_cols)
    if tail is not None:
        part = _place_tail(part, values, tail, t_probs, t_cols, g, max_cols)
    # in block order, one running sum (cumsum; on CPU it accumulates in float64): sum() would
    # pick its association by the shape
    total = part[..., :m].float().cumsum(dim=2)[:, :, -1]  # [B, kvh, hd + 1, m]
    out = total[:, :, :hd] / total[:, :, hd:]  # [B, kvh, hd, g*T]
    return out.view(B, kvh, hd, g, T).permute(0, 4, 1, 3, 2).reshape(B, T, kvh * g * hd)


def _value_blocks(values: torch.Tensor, probs: torch.Tensor, max_cols: int = MAX_COLS
                  ) -> torch.Tensor:
    """Each key block's values^T @ probs: values [B, kvh, n, hd + 1], probs [B, kvh, nb, KB,
    cols] -> [B, kvh, nb, hd + 1, cols]. One batched product, or, for float32 values on the CPU
    read as a view of the cache by more than COPIED_ROWS rows (a run of slots: its batch dims
    do not fold into one stride, so the one product would first copy them transposed, most of
    a small model's many-session step), one product a block over the view (each the same
    shape: the same bits, checked in the tests). A call of a few rows copies its values and
    runs the one product: on an AVX2 EPYC, one row over 320 / 1,024 / 4,096 keys took 82 / 251 /
    1,052 us that way against 164 / 886 / 5,399 a block at a time (one thread; 64 rows: 15.3
    against 13.5 ms)."""
    B, kvh, nb = probs.shape[:3]
    hd1 = values.shape[-1]
    if values.device.type == "cpu" and values.dtype == torch.float32 and \
            not values.is_contiguous():
        if B <= COPIED_ROWS:
            values = values.contiguous()
        else:
            return torch.stack([_by_columns(values[:, :, j * KEY_BLOCK:(j + 1) * KEY_BLOCK]
                                            .transpose(-1, -2), probs[:, :, j], max_cols)
                                for j in range(nb)], dim=2)
    vt = values.view(B, kvh, nb, KEY_BLOCK, hd1).transpose(-1, -2)  # [B, kvh, nb, hd+1, KB]
    return _by_columns(vt, probs, max_cols)


def _row_mask(visible: torch.Tensor, g: int) -> torch.Tensor:
    """visible [B, T, n] -> [B, 1, g * T, n]: ``_column_mask`` with the keys innermost."""
    B, T, n = visible.shape
    return visible[:, None, None].expand(B, 1, g, T, n).reshape(B, 1, g * T, n)


def _column_mask(visible: torch.Tensor, g: int) -> torch.Tensor:
    """visible [B, T, n] -> [B, 1, n, g * T]: the score columns' layout (query head j of a
    group, token t at column j * T + t)."""
    B, T, n = visible.shape
    return visible.transpose(1, 2)[:, None, :, None, :].expand(B, 1, n, g, T).reshape(
        B, 1, n, g * T)


def _tail_probs(probs: torch.Tensor, tail: TailKeys, g: int, T: int, col_tile: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tail queries' probabilities [S, kvh, TB, ct] (float32 is not needed: the main
    call's, in the values' dtype) at their keys in decoding order, zero where a query sees
    none, its g columns padded to ``col_tile``; and the queries' columns in the main layout
    [S, g]. A probability is the same bits wherever its key is stored: a score reduces over
    head_dim only, the max is exact in any order, exp is pointwise."""
    cols = torch.arange(g, device=probs.device) * T + tail.queries[:, None]  # [S, g]
    picked = probs[tail.rows[:, None, None], :, tail.index[:, :, None], cols[:, None, :]]
    picked = picked.permute(0, 3, 1, 2) * tail.visible[:, None, :, None]  # [S, kvh, TB, g]
    ct = -(-g // col_tile) * col_tile
    if ct != g:
        picked = torch.nn.functional.pad(picked, (0, ct - g))
    return picked, cols


def _place_tail(part: torch.Tensor, values: torch.Tensor, tail: TailKeys, t_probs: torch.Tensor,
                cols: torch.Tensor, g: int, max_cols: int = MAX_COLS) -> torch.Tensor:
    """The tail queries' value blocks, each one product of the same shape as the main call's,
    put at their logical block indices in ``part`` (where the main call left exact zeros)."""
    B, kvh, nb, hd1, n_cols = part.shape
    S, TB = tail.index.shape
    nbt = TB // KEY_BLOCK
    vt = values[tail.rows[:, None], :, tail.index].permute(0, 2, 1, 3).contiguous()
    vt = vt.view(S, kvh, nbt, KEY_BLOCK, hd1).transpose(-1, -2)  # [S, kvh, nbt, hd+1, KB]
    pt = t_probs.reshape(S, kvh, nbt, KEY_BLOCK, -1)
    t_part = _by_columns(vt, pt, max_cols)[..., :g]  # [S, kvh, nbt, hd+1, g]
    if tail.n_blocks > nb:
        part = torch.cat([part, part.new_zeros(B, kvh, tail.n_blocks - nb, hd1, n_cols)], 2)
    blocks = tail.block0[:, None] + torch.arange(nbt, device=part.device)  # [S, nbt]
    part[tail.rows[:, None, None], :, blocks[:, :, None], :, cols[:, None, :]] = \
        t_part.permute(0, 2, 4, 1, 3)  # [S, nbt, g, kvh, hd+1]
    return part
