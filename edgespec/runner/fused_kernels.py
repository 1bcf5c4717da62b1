"""The runner's fused, fixed-config Triton kernels for the GPU: one launch per job of a layer.

On a GPU the runner's eager layer launched about 72 kernels (norms through padded products,
``F.pad`` before each linear, rotary in ten pieces, attention in twenty); here a layer is nine
launches: four cuBLAS products (``Linear.tiles``), four of these kernels and the attention
(``fused_attention``).

- ``add_rms_norm``: residual add (in place) then RMS norm, written into a linear's staging buffer
  of whole 128-row tiles, so no ``F.pad`` runs (a product's rows never meet: what the padding
  rows hold reaches no real row);
- ``rope_write_kv``: rotary on q and k, k and v written into their KV slots;
- ``silu_mul``: SiLU(gate) x up into the down projection's staging buffer;
- ``FusedStep``: a step's slots, starts, depths and tree paths as every kernel reads them.

Batch invariance (a row's bits do not depend on what else is in the call) is structural: one
program per row (norm, SiLU, rotary: all its heads at once), every block shape a compile-time
constant of the model, reductions over fixed shapes in a fixed order, and no integer that
varies with the batch is specialised on (``do_not_specialize``), so every call runs the same
binary. The start check and the GPU sweep prove it on the device. With ``TRITON_INTERPRET=1``
they run on CPU tensors (tests).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

TILE_ROWS = 128  # the staging buffers' row multiple: ``edgespec.runner.linear.TILE_ROWS``


def padded_rows(n: int) -> int:
    """Rows of a staging buffer holding n rows: whole tiles."""
    return max(1, -(-n // TILE_ROWS)) * TILE_ROWS


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, H, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=inside, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * H + cols, mask=inside, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * H + cols, x, mask=inside)
    xf = x.to(tl.float32)
    mean_square = tl.sum(xf * xf, axis=0) / H
    normed = (xf * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * H + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, H] (contiguous; updated in place to x + delta[:R] when delta [>=R, H] is given),
    then RMS norm times ``weight`` [H] into out [padded_rows(R), H]: a linear's staging
    buffer, whose rows past R are left as they are (a product's rows never meet, so nothing
    reads what a padding row yields). Returns out."""
    R, H = x.shape
    if out is None:
        out = torch.empty(padded_rows(R), H, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(H)
    _add_rms_norm_kernel[(R,)](x, delta if delta is not None else x, weight, out, H, eps,
                               HAS_DELTA=delta is not None, BLOCK=block,
                               num_warps=_warps(block))
    return out


@triton.jit(do_not_specialize=["T"])
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, start_ptr, depth_ptr, T,
                          q_ptr, k_cache_ptr, v_cache_ptr,
                          ks_slot, ks_head, ks_pos, vs_slot, vs_head, vs_pos,
                          NH: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr,
                          HEADS: tl.constexpr):
    # one program a row, every head of it at once ([HEADS, HD], HEADS the heads' count
    # rounded up to a power of two): each element's arithmetic is a head's alone, so a head's
    # bits are those of a program of its own
    row = tl.program_id(0)  # b * T + t
    b = row // T
    t = row % T
    h = tl.arange(0, HEADS)[:, None]  # q heads, then k heads, then v heads
    d = tl.arange(0, HD)[None, :]
    real = h < NH + 2 * KVH
    src = qkv_ptr + row * ((NH + 2 * KVH) * HD) + h * HD
    x = tl.load(src + d, mask=real, other=0.0)
    slot = tl.load(slot_ptr + b)
    start = tl.load(start_ptr + b)
    stored = start + t  # row t of a step is stored at the slot's length + t
    pos = start + tl.load(depth_ptr + row)  # rotary position: by depth (trees)
    half: tl.constexpr = HD // 2
    partner = tl.load(src + (d + half) % HD, mask=real, other=0.0).to(tl.float32)
    rotated = tl.where(d < half, -partner, partner)
    c = tl.load(cos_ptr + pos * HD + d).to(tl.float32)
    s = tl.load(sin_ptr + pos * HD + d).to(tl.float32)
    y = (x.to(tl.float32) * c + rotated * s).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * (NH * HD) + h * HD + d, y, mask=h < NH)
    kv = k_cache_ptr + slot * ks_slot + (h - NH) * ks_head + stored * ks_pos
    tl.store(kv + d, y, mask=(h >= NH) & (h < NH + KVH))
    vv = v_cache_ptr + slot * vs_slot + (h - NH - KVH) * vs_head + stored * vs_pos
    tl.store(vv + d, x, mask=(h >= NH + KVH) & real)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: "FusedStep",
                  k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, kv_heads: int,
                  head_dim: int, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [>=R, (nh + 2 kvh) hd] (R = B T rows of ``step``) -> rotated queries
    [padded_rows(R), nh hd]; rotated keys and values written into k_cache / v_cache
    [slots, kvh, positions, >=hd] at each row's slot, position start + t. cos, sin
    [positions, hd]: the rotary tables."""
    R = step.rows
    if q_out is None:
        q_out = torch.empty(padded_rows(R), n_heads * head_dim, dtype=qkv.dtype,
                            device=qkv.device)
    heads = triton.next_power_of_2(n_heads + 2 * kv_heads)
    _rope_write_kv_kernel[(R,)](
        qkv, cos, sin, step.slots, step.starts, step.depth, step.width, q_out, k_cache, v_cache,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NH=n_heads, KVH=kv_heads, HD=head_dim, HEADS=heads, num_warps=_warps(heads * head_dim))
    return q_out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < inner
    g = tl.load(gate_up_ptr + row * (2 * inner) + cols, mask=inside, other=0.0)
    u = tl.load(gate_up_ptr + row * (2 * inner) + inner + cols, mask=inside, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(out_ptr.dtype.element_ty)
    y = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * inner + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


def silu_mul(gate_up: torch.Tensor, rows: int) -> torch.Tensor:
    """gate_up [P, 2 I] (P: whole tiles) -> SiLU(gate) x up [P, I] for its first ``rows``
    rows (the down projection's staging buffer; the rest left as they are)."""
    P, two_inner = gate_up.shape
    inner = two_inner // 2
    out = torch.empty(P, inner, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inner, block))](gate_up, out, inner, BLOCK=block,
                                                        num_warps=4)
    return out


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


class FusedStep:
    """A step's rows as the fused kernels read them (device tensors): B rows of T tokens, row b
    in KV slot ``slots[b]`` from position ``starts[b]``; token t of row b is rotated at
    starts[b] + depth[b, t] and sees the prefix then path[b, t, :depth[b, t] + 1] (rows of
    its own step, root first)."""

    __slots__ = ("slots", "starts", "depth", "path", "batch", "width", "keys")

    def __init__(self, slots: torch.Tensor, starts: torch.Tensor, depth: torch.Tensor,
                 path: torch.Tensor, keys: int | None = None):
        self.slots = slots  # [B] long
        self.starts = starts  # [B] long
        self.depth = depth  # [B, T] long, contiguous
        self.path = path  # [B, T, T] long, contiguous
        self.batch, self.width = depth.shape
        # at least the most keys any row sees (max start + T), where the host knows it; None
        # (a graph bucket: one grid for every length) bounds them by the cache
        self.keys = keys

    @property
    def rows(self) -> int:
        return self.batch * self.width

    @classmethod
    def of_tree_rows(cls, rows: Any) -> "FusedStep":
        """A ``StepRows`` of trees: depth and path as the rows built them (on the host, once)."""
        assert rows.path is not None, "a tree step carries its paths"
        T = rows.width
        return cls(rows.slot_index, rows.start_index, rows.depths[:, :T].contiguous(),
                   rows.path, max(rows.starts) + T)

    @classmethod
    def chains(cls, slots: torch.Tensor, starts: torch.Tensor, width: int,
               keys: int | None = None) -> "FusedStep":
        """Rows of chains: token t at depth t, seeing the rows 0..t before it (``keys``: the
        largest start + width, where the caller knows it)."""
        B, dev = slots.shape[0], slots.device
        cols = torch.arange(width, dtype=torch.long, device=dev)
        return cls(slots, starts, cols.repeat(B, 1),
                   cols.repeat(B, width, 1).contiguous(), keys)
