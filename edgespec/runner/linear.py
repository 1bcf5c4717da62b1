"""The runner's linear layer, rows batch-invariant on every device: a row gets the same bits
whatever else is in the call. On CPU the weights are pre-packed for oneDNN (a lone row goes
through as two); on CUDA the rows go through in fixed tiles of ``TILE_ROWS``, each call padded to
a whole tile, so cuBLAS only ever sees one problem shape per layer. The building block
``edgespec.runner.target_runner`` and ``edgespec.runner.dtype_probe`` share.

Why tiles on CUDA (measured on an H200, torch 2.11 + CUDA 13, docs/measured/gpu/): cuBLAS picks
its kernel by the row count, and some kernels split the reduction another way, so a row's bits
depended on the call's row count (bfloat16: 8192 -> 2048, 4096 -> 4096, 14336 -> 4096; float32:
nearly every shape). One call padded to a multiple of 128 rows was not enough (a 256-row call
takes another kernel than a 128-row one); 128-row tiles, one padded call each, made every shape
invariant in both dtypes up to 511 rows. vLLM's pinned cuBLASLt settings fixed bfloat16 only.
At some row counts a Triton kernel that gives the tiles' bits runs instead (``plan``:
``edgespec.runner.gemm_plan``), proven so at start.

Why row tiles on some CPUs (measured on an Emerald Rapids Xeon, AMX, torch 2.13): oneDNN's packed
bfloat16 product takes one kernel for calls of up to 32 rows and another above, so a row among 64
got other bits than alone. Calls of 1-32 rows agreed at 1-4 threads, but from 5 threads on a
narrow product (96 or 192 outputs) split its work by the row count again; calls of exactly 32
rows, padded, gave every row the same bits at 1-8 threads for every shape tried. There a runner's
products go in tiles of ``CPU_TILE_ROWS`` rows, each call padded to a whole tile, as on CUDA
(``products`` "packed-tiles" in its kernel set: the dtype probe chooses them where one call is not
batch-invariant and the tiles are). On Sapphire Rapids and AMD EPYC one call was invariant
(``products`` "packed").

Why row spans (the same Xeon, torch 2.13, one thread): a 32-row bfloat16 call costs about what a
40- or 80-row one does (the weights' reads, not the rows, are most of it: 25, 26 and 36 ms for a
pass of the default model's layers), so 32-row tiles made a step of 16 sessions x 5 tokens pay
three passes (75 ms) and a 128-token prefill chunk four (100 ms against 45). Above 36 rows the
kernel is one again: calls of 37 to 256 rows gave every row, first or last in its call, the same
bits (one thread; at two threads 37 to 119). There every call has between ``SPAN_FLOOR`` rows
(fewer are padded up) and a ceiling the probe proved (more are cut into calls of the ceiling):
``products`` "packed-spans128" / "packed-spans96".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.float32, torch.bfloat16)
GEMMS = ("tiles", "triton")  # the fused path's products: cuBLAS in 128-row tiles, or
# ``fused_gemm``'s fixed-config kernel (one pass over the weights; measured, not the default)
TILE_ROWS = 128  # rows per cuBLAS call on CUDA: every call has exactly this many
CPU_TILE_ROWS = 32  # rows per oneDNN call where the kernel set has "packed-tiles": always this many
SPAN_FLOOR = 40  # the fewest rows of a oneDNN call where the kernel set has "packed-spans<ceiling>"


def _mkldnn_ok(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear:
    """y = x W^T + b. On CPU in float32 and bfloat16 the weight is pre-packed for oneDNN once
    (bfloat16: AMX where the CPU has it, ~2x float32 per row and flat up to 8 rows).

    Rows are batch-invariant from 2 rows up on Sapphire Rapids and AMD EPYC (measured: 1..512
    rows, every layer shape of the default model, float32 and bfloat16; not an Emerald Rapids
    Xeon's bfloat16: see the module's docstring); a lone row goes through as two. On CUDA (and
    wherever ``tiled`` is asked for) every call is ``TILE_ROWS`` rows instead, with
    ``row_tile`` (the CPU's "packed-tiles") that many, and with ``row_span`` (the CPU's
    "packed-spans") between its floor and its ceiling.

    Pre-packing matters: measured on 2 CPU cores, MKL's plain sgemm re-packs the weight on every
    call and costs ~2x a matrix-vector product for 2..8 rows, so a forward over a k+1-token draft
    cost ~2x a forward over one token; with packed weights a 7-token forward costs ~1.5x a
    1-token one (37.5 vs 55.6 ms, default model, 700-token context).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 pack: bool = True, batch_hint: int = 8, tiled: bool | None = None,
                 row_tile: int | None = None, row_span: tuple[int, int] | None = None):
        """``tiled``: rows in fixed tiles of ``TILE_ROWS`` (None: on CUDA, where cuBLAS needs
        it). ``row_tile``: rows in fixed tiles of this many instead (the CPU's "packed-tiles").
        ``row_span``: (floor, ceiling): every call between these many rows (the CPU's
        "packed-spans")."""
        if row_span is not None and not 1 <= row_span[0] <= row_span[1]:
            raise ValueError(f"a row span is (floor, ceiling) with 1 <= floor <= ceiling, got "
                             f"{row_span}")
        if row_span is not None and row_tile is not None:
            raise ValueError("a layer's calls are row tiles or row spans, not both")
        self.weight, self.bias = weight, bias
        self.row_tile, self.row_span = row_tile, row_span
        self.tile_rows = row_tile or TILE_ROWS  # every call of a tiled layer has this many rows
        self.packed = None
        if pack and _mkldnn_ok(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.tiled = row_tile is not None or (weight.device.type == "cuda" if tiled is None
                                              else tiled)
        self.gemm = "tiles"  # what ``tiles`` runs on CUDA (``GEMMS``; "tiles" with a ``plan``)
        # "tiles" on CUDA: the Triton kernels some row counts run instead, each proven at start
        # to give the tiles' bits (``gemm_plan``; None: the tiles at every row count)
        self.plan = None

    @property
    def shape(self) -> tuple[int, int]:
        """(in features, out features)."""
        return self.weight.shape[1], self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiled:
            return self._in_tiles(x)
        if self.row_span is not None:
            return self._in_spans(x)
        if x.numel() == x.shape[-1]:
            # one row: oneDNN (and MKL) take a single-row path that sums a long input (the MLP's
            # down projection, 1536 wide) in another order than for 2 rows and more, so a decode
            # step would not have a verification row's bits; 2 rows cost about what 1 does
            two = x.reshape(1, -1).expand(2, -1).contiguous()
            return self._apply(two)[:1].reshape(*x.shape[:-1], -1)
        return self._apply(x)

    def _in_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N], the rows padded with zeros to whole tiles and each tile one
        call (rows never interact in a product, so the padding does not touch them)."""
        rows = x.reshape(-1, x.shape[-1])
        n, size = rows.shape[0], self.tile_rows
        tiles = max(1, -(-n // size))
        if n != tiles * size:
            rows = F.pad(rows, (0, 0, 0, tiles * size - n))
        return self.tiles(rows, n)[:n].reshape(*x.shape[:-1], -1)

    def _in_spans(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in calls of floor..ceiling rows (``row_span``): up to the
        ceiling one call (fewer than the floor padded with zero rows), more cut into calls of the
        ceiling and a last part (padded the same)."""
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        if n == 0:
            return x.new_empty(*x.shape[:-1], self.weight.shape[0])
        floor, ceiling = self.row_span  # type: ignore[misc]
        parts = [self._padded_call(rows[at:at + ceiling], floor) for at in range(0, n, ceiling)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.reshape(*x.shape[:-1], -1)

    def _padded_call(self, rows: torch.Tensor, floor: int) -> torch.Tensor:
        n = rows.shape[0]
        if n >= floor:
            return self._apply(rows)
        return self._apply(F.pad(rows, (0, 0, 0, floor - n)))[:n]

    def tiles(self, rows: torch.Tensor, used: int | None = None) -> torch.Tensor:
        """rows [P, K], P a whole number of tiles (a staging buffer the fused kernels wrote,
        its padding rows whatever they hold) -> [P, N]: one product of ``tile_rows`` rows per
        tile, each written into its rows of one output (no concatenation); or, where ``plan``
        names a Triton kernel for this many rows (it gives the tiles' bits, proven at start),
        that kernel over the real rows alone. ``used``: how many leading rows are real (the
        Triton GEMM computes only those, leaving the rest of the output unwritten)."""
        P, size = rows.shape[0], self.tile_rows
        assert P % size == 0, f"{P} rows are not whole tiles of {size}"
        config = None
        if self.plan is not None and rows.is_contiguous():  # else the tiles: the same bits
            config = self.plan.config_for(P if used is None else used)
        if config is not None or (self.gemm == "triton" and rows.device.type == "cuda"):
            from .fused_gemm import DEFAULT, gemm

            return gemm(rows, self.weight.detach(),
                        None if self.bias is None else self.bias.detach(), used,
                        config or DEFAULT)
        return self.tiles_cublas(rows)

    def tiles_cublas(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [P, K], P whole tiles -> [P, N], each tile one cuBLAS call (oneDNN's or torch's
        on a CPU)."""
        P, size = rows.shape[0], self.tile_rows
        out = torch.empty(P, self.weight.shape[0], dtype=rows.dtype, device=rows.device)
        w_t = self.weight.detach().t()  # out= products take no autograd (a model's weights may
        bias = None if self.bias is None else self.bias.detach()  # still ask for gradients)
        for at in range(0, P, size):
            tile = slice(at, at + size)
            if self.packed is not None:  # the CPU (Triton's interpreter, in tests)
                out[tile] = self._apply(rows[tile])
            elif bias is None:
                torch.mm(rows[tile], w_t, out=out[tile])
            else:
                torch.addmm(bias, rows[tile], w_t, out=out[tile])
        return out

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class RowCalls:
    """How a runner's CPU linear layers send their rows to oneDNN (the kernel set's eager
    ``products``, read by ``dtype_probe.linear_options``): packed weights or plain ones, and
    every call a fixed tile of rows, or between a span's floor and ceiling, or as it comes."""

    pack: bool = True
    tile: int | None = None  # "packed-tiles": every call exactly this many rows
    span: tuple[int, int] | None = None  # "packed-spans<c>": every call SPAN_FLOOR..c rows

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        return Linear(weight, bias, pack=self.pack, row_tile=self.tile, row_span=self.span)
