"""The start check of the GPU's fused attention kernels: whether ``slot_attention`` gives a
query the same bits alone as among other sessions' longer rows (rows of 5, 9 and 16 tokens:
every query-group program a step runs; rows crossing key 256 and past 2,048 keys), and a tree
node the bits of its chain decoded one token at a time. ``kernel_set`` runs it for each kernel
before serving exactly; the sitting times the kernels that pass it.

It reads the kernel through its module (``fused_attention.slot_attention``), so that a kernel put
in its place is the one probed.
"""

from __future__ import annotations

import torch

from . import fused_attention
from .attention import KEY_BLOCK
from .fused_kernels import FusedStep
from .step_rows import DraftShape, StepRows


def probe_slot_attention(dtype: torch.dtype, device: str | torch.device, n_heads: int,
                         kv_heads: int, head_dim: int, kernel: str = "tiles") -> str | None:
    """Whether ``slot_attention`` gives a query the same bits alone and among other sessions'
    longer rows here, for this head layout, and a tree node the bits of its chain decoded one
    token at a time (None), or what differed. Random keys: three sessions of 5 tokens crossing
    key blocks; three of 16 and of 9 tokens (every query-group program a step runs) crossing
    key 256 and past 2,048 keys; a tree."""
    g = torch.Generator().manual_seed(0)
    B, T, cap = 3, 5, 4 * KEY_BLOCK
    scale = head_dim ** -0.5

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    def attend(q, step, k, v):
        return fused_attention.slot_attention(q, step, k, v, n_heads, kv_heads, head_dim, scale,
                                              kernel=kernel)

    differs = _wide_rows_differ(rand, attend, device, n_heads, kv_heads, head_dim)
    if differs is not None:
        return differs
    k_cache, v_cache = rand(B, kv_heads, cap, head_dim), rand(B, kv_heads, cap, head_dim)
    q = rand(B * T, n_heads * head_dim)
    slots = torch.arange(B, device=device)
    starts = torch.tensor([130, 3, KEY_BLOCK - 2], device=device)
    many = attend(q, FusedStep.chains(slots, starts, T), k_cache, v_cache)
    for b in range(B):
        for t in range(T):
            alone = attend(q[b * T + t:b * T + t + 1],
                           FusedStep.chains(slots[b:b + 1], starts[b:b + 1] + t, 1),
                           k_cache, v_cache)
            if not torch.equal(alone[0], many[b * T + t]):
                return (f"query {t} of a session at {int(starts[b])} keys differs alone and "
                        f"among {B} sessions of {T}")
    # a tree in session 2 (its root block ends two keys in): root, two children, a grandchild
    # of each, built as a step's rows are (``StepRows``: depths and paths on the host)
    st = int(starts[2])
    rows = StepRows.build([2], [st], [0], DraftShape.of([([0] * (T - 1), [-1, -1, 1, 0])]),
                          device, tree=True)
    step = FusedStep.of_tree_rows(rows)
    tree = attend(q[:T], step, k_cache, v_cache)
    depth, path = step.depth.cpu(), step.path.cpu()
    for t in range(T):
        k_chain, v_chain = k_cache.clone(), v_cache.clone()  # the chain's layout
        along = path[0, t, :int(depth[0, t]) + 1].tolist()
        for i, node in enumerate(along):
            k_chain[2, :, st + i], v_chain[2, :, st + i] = k_cache[2, :, st + node], \
                v_cache[2, :, st + node]
        decoded = attend(q[t:t + 1], FusedStep.chains(slots[2:], starts[2:] + len(along) - 1, 1),
                         k_chain, v_chain)
        if not torch.equal(decoded[0], tree[t]):
            return f"tree node {t} differs from its chain decoded one token at a time"
    return None


WIDE_STARTS = (250, 2100, 7)  # a row crossing key 256, one past 2,048 keys, one short
WIDE_TOKENS = (16, 9)  # the widest a graphed step sends, and a common draft's (8 + 1)


def _wide_rows_differ(rand, attend, device, n_heads: int, kv_heads: int,
                      head_dim: int) -> str | None:
    """The wide part of ``probe_slot_attention``: the queries of three sessions' rows of 16 and
    of 9 tokens against the same queries alone (None), or what differed. Every query of the
    short rows; of the row past 2,048 keys, the first and the last of each width (its middle
    ones run in the same programs: each query alone would walk its 2,000 keys again)."""
    B, T = len(WIDE_STARTS), WIDE_TOKENS[0]
    cap = -(-(max(WIDE_STARTS) + T) // KEY_BLOCK) * KEY_BLOCK
    k_cache, v_cache = rand(B, kv_heads, cap, head_dim), rand(B, kv_heads, cap, head_dim)
    q = rand(B, T, n_heads * head_dim)
    slots = torch.arange(B, device=device)
    starts = torch.tensor(WIDE_STARTS, device=device)

    def checked(b: int, width: int) -> list[int]:
        return list(range(width)) if WIDE_STARTS[b] < 1024 else [0, width - 1]

    alone = {(b, t): attend(q[b, t:t + 1], FusedStep.chains(slots[b:b + 1],
                                                           starts[b:b + 1] + t, 1),
                            k_cache, v_cache)[0]
             for b in range(B) for width in WIDE_TOKENS for t in checked(b, width)}
    for width in WIDE_TOKENS:
        many = attend(q[:, :width].reshape(B * width, -1),
                      FusedStep.chains(slots, starts, width), k_cache, v_cache)
        for b in range(B):
            for t in checked(b, width):
                if not torch.equal(alone[b, t], many[b * width + t]):
                    return (f"query {t} of a {width}-token row at {WIDE_STARTS[b]} keys differs "
                            f"alone and among {B} sessions")
    return None

