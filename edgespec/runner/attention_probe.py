"""The start check of the CPU's and a GPU's torch attention path: whether
``attention.invariant_attention`` gives a query the same bits alone as inside a wider, longer
call, on the machine at hand, for a model's head layout, at every width a CPU call can have.
``dtype_probe`` runs it for each candidate tile before a dtype is served as lossless.

It reads the kernel through its module (``attention.invariant_attention``), so that a kernel
put in its place is the one probed.
"""

from __future__ import annotations

import torch

from . import attention
from .attention import CALL_TOKENS, COL_TILE, KEY_BLOCK, MAX_COLS, padded_keys


def probe_invariance(dtype: torch.dtype, device: str | torch.device = "cpu",
                     col_tile: int = COL_TILE, kv_heads: int = 2, group: int = 3,
                     head_dim: int = 64, products: torch.dtype | None = None,
                     max_cols: int = MAX_COLS) -> bool:
    """Whether ``invariant_attention`` gives a query the same bits alone and inside a wider,
    longer call on this machine, in ``dtype``, for a model's head layout (kv heads, query heads
    per kv head, head size), and on a CPU at every width a call can have
    (``_every_width_agrees``): a few tenths of a second, run before a dtype is served as
    lossless. ``col_tile``, ``max_cols``: as ``invariant_attention`` takes them."""
    g = torch.Generator().manual_seed(0)
    kvh, grp, hd, n_big = kv_heads, group, head_dim, 4 * KEY_BLOCK

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)

    keys = rand(3, kvh, n_big, hd)
    values = torch.cat([rand(3, kvh, n_big, hd),
                        torch.ones(3, kvh, n_big, 1, dtype=dtype, device=device)], -1)
    q = rand(3, kvh, grp, 7, hd)
    pos = torch.arange(n_big, device=device)
    ctx = torch.tensor([70, 130, 200], device=device)  # row b's query t sits at ctx[b] + t
    visible = pos[None, None, :] <= (ctx[:, None] + torch.arange(7, device=device))[:, :, None]
    def attend(*args):
        return attention.invariant_attention(*args, col_tile, products=products, max_cols=max_cols)

    wide = attend(q, keys, values, visible)
    long_q = rand(1, kvh, grp, 150, hd)  # a prefill chunk: products of MAX_COLS columns
    long_vis = pos[None, None, :] <= (50 + torch.arange(150, device=device))[None, :, None]
    long_out = attend(long_q, keys[:1], values[:1], long_vis)
    for t in range(150):  # each query alone: its key blocks and columns differ
        n = padded_keys(51 + t, n_big)
        alone = attend(long_q[:, :, :, t:t + 1], keys[:1, :, :n], values[:1, :, :n],
                       long_vis[:, t:t + 1, :n])
        if not torch.equal(alone[0, 0], long_out[0, t]):
            return False
    for b in range(3):
        for t in (0, 3, 6):
            n = padded_keys(int(ctx[b]) + t + 1, n_big)
            alone = attend(q[b:b + 1, :, :, t:t + 1], keys[b:b + 1, :, :n],
                           values[b:b + 1, :, :n], visible[b:b + 1, t:t + 1, :n])
            if not torch.equal(alone[0, 0], wide[b, t]):
                return False
    if torch.device(device).type != "cpu":  # a GPU's torch path: the calls above, as before
        return True
    return _every_width_agrees(attend, long_q[:, :, :, :CALL_TOKENS], keys[:2], values[:2], pos)


def _every_width_agrees(attend, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        pos: torch.Tensor) -> bool:
    """Whether a query's bits are the same alone as at every place of a two-row call of every
    width a CPU call can have (1 to CALL_TOKENS queries a row: a longer call runs in pieces of
    QUERY_PIECE, and a tree's call with out-of-order keys, one piece, holds at most 1 +
    MAX_TREE_NODES tokens). A product's columns are the call's
    g x T queries, padded to the tile, and a BLAS kernel blocks them by its own register width:
    MKL's AVX2 float32 kernel gave the columns of a last block of 8 (of 80 = 3 x 24 + 8: 25
    tokens of a 3-query group) other bits than the same query alone, at a 16-column tile, which
    the wide and long calls above did not reach. q: [1, kvh, g, CALL_TOKENS, hd]."""
    ctx = torch.tensor([60, 100], device=pos.device)  # row b's query t sits at ctx[b] + t
    n_big = keys.shape[2]
    alone: dict[tuple[int, int], torch.Tensor] = {}
    for T in range(1, q.shape[3] + 1):
        rows = q[:, :, :, :T].expand(2, -1, -1, -1, -1)
        visible = pos[None, None, :] <= (ctx[:, None] + torch.arange(T, device=pos.device)
                                         )[:, :, None]
        out = attend(rows, keys, values, visible)
        for b in range(2):
            for t in range(T):
                if (b, t) not in alone:
                    n = padded_keys(int(ctx[b]) + t + 1, n_big)
                    alone[b, t] = attend(q[:, :, :, t:t + 1], keys[b:b + 1, :, :n],
                                         values[b:b + 1, :, :n], visible[b:b + 1, t:t + 1, :n]
                                         )[0, 0]
                if not torch.equal(alone[b, t], out[b, t]):
                    return False
    return True
