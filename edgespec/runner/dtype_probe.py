"""Which dtypes this machine serves exactly, decided by probes at start, not by CPU flags, at
the thread count that will serve (torch's kernels split their work by it).

A dtype is served as lossless only if the runner's kernels are batch-invariant in it here: the
attention (``edgespec.runner.attention_probe.probe_invariance``, for a query-column tile of 16, else
32, 64 or 128, on a CPU first 1 (no padding) and last products of exactly 16 columns, with its
products in the dtype itself or, where oneDNN emulates bfloat16, in float32: ``cpu_kind``) and
the packed linear layers (every row alone, in pairs, among 64 rows and in calls of 3-47 rows
gives the same bits, and the product is right: within bfloat16 rounding of a float32
reference).
``auto`` (``dtype_choice``) measures: among the dtypes that pass, the one whose linear layer is
faster here (on an AMX CPU bfloat16, about 1.5x float32's forward; on Cascade Lake, where oneDNN
emulates bfloat16, float32). The linear layers' rows go in one call, or in calls of 40 to 128
(or 96) rows, or in padded calls of 32 rows, the first of these that is invariant here
(``packed_products``: an Emerald Rapids Xeon's bfloat16 takes spans at one thread). CPU flags
are not trusted: the machine this was built on advertises AMX, and llama.cpp's AMX path faults
on it, while oneDNN's runs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch

from ..config import DTYPE_NAMES
from .attention import MAX_COLS
from .cpu_kind import cpu_kind
from .linear import Linear, RowCalls


log = logging.getLogger("edgespec.dtype")

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
COL_TILES = (16, 32, 64, 128)
# on a CPU, tried before and after those: no padding at all (a decode step's 1-3 columns a kv
# head were padded to 16: 35-40% of its attention), and, last, products of exactly 16 columns
CPU_UNPADDED, CPU_FIXED_WIDTH = 1, 16


@dataclass(frozen=True)
class AttentionKernel:
    """How the runner's attention runs batch-invariantly here: its query-column tile and the
    dtype of its two products (None: the model's own)."""

    col_tile: int
    products: torch.dtype | None = None
    max_cols: int = MAX_COLS  # the most query columns a product takes


def attention_kernel(dtype: torch.dtype, device: str = "cpu", kv_heads: int = 2,
                     group: int = 3, head_dim: int = 64) -> AttentionKernel | None:
    """The attention kernel that is batch-invariant here, at torch's thread count now, for this
    head layout, or None."""
    return _attention_kernel(dtype, device, kv_heads, group, head_dim, torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _attention_kernel(dtype: torch.dtype, device: str, kv_heads: int, group: int,
                      head_dim: int, threads: int) -> AttentionKernel | None:
    from .attention_probe import probe_invariance

    products: list[torch.dtype | None] = [None]
    if device == "cpu" and dtype == torch.bfloat16 and not cpu_kind().bf16_native:
        # oneDNN's emulated bfloat16 gemm splits small batched products by the thread count:
        # seen to change a column's bits at 8 threads that no random probe caught
        log.info("bfloat16 is emulated on this CPU: the attention's products run in float32")
        products = [torch.float32]
    elif dtype != torch.float32:
        products.append(torch.float32)
    kernels = [AttentionKernel(tile) for tile in COL_TILES]
    if device == "cpu":
        kernels = [AttentionKernel(CPU_UNPADDED), *kernels,
                   AttentionKernel(CPU_FIXED_WIDTH, max_cols=CPU_FIXED_WIDTH)]
    for prod in products:
        for k in kernels:
            try:
                if probe_invariance(dtype, device, k.col_tile, kv_heads, group, head_dim, prod,
                                    k.max_cols):
                    return dataclasses.replace(k, products=prod)
            except RuntimeError as exc:  # a kernel this machine lacks: try the next products
                log.info("attention probe in %s on %s failed: %s", dtype, device, exc)
                break
    return None


def attention_tile(dtype: torch.dtype, device: str = "cpu", kv_heads: int = 2, group: int = 3,
                   head_dim: int = 64) -> int | None:
    """The query-column tile of ``attention_kernel``, or None."""
    kernel = attention_kernel(dtype, device, kv_heads, group, head_dim)
    return None if kernel is None else kernel.col_tile


# the CPU's exact products, the cheaper first: one call; calls of SPAN_FLOOR up to 128 or 96 rows
# (``linear.RowCalls``); calls of exactly 32
PRODUCTS = ("packed", "packed-spans128", "packed-spans96", "packed-tiles")
SPANS = "packed-spans"


def packed_products(dtype: torch.dtype, device: str = "cpu",
                    shapes: tuple[tuple[int, int], ...] = ()) -> str | None:
    """How the runner's linear layers in ``dtype`` give every row its bits here, at torch's
    thread count now: "packed" (one oneDNN call whatever the rows), else "packed-spans<c>"
    (every call between ``linear.SPAN_FLOOR`` and c rows: padded up, cut down; where oneDNN
    takes one kernel up to 32 rows and another above: an Emerald Rapids Xeon's bfloat16), else
    "packed-tiles" (every call ``linear.CPU_TILE_ROWS`` rows, padded), else None (not
    batch-invariant here). ``shapes``: the model's linear layers' (out, in), each swept at every
    call size of a span before spans are chosen (oneDNN blocks a narrow product by its shape:
    a 96-wide head varied inside the span where the default model's layers did not)."""
    threads = torch.get_num_threads()
    for products in PRODUCTS:
        if _packed_linear_exact(dtype, device, threads, products) and (
                not products.startswith(SPANS)
                or all(_span_exact(dtype, device, threads, products, s) for s in shapes)):
            return products
    return None


def packed_linear_exact(dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether the runner's linear layer in ``dtype`` computes the right product and gives every
    row the same bits alone, in pairs, among all rows and in calls of 3, 17, 31, 33 and 47 rows
    (and for spans, calls about their floor and ceiling), for the default model's widest
    reduction (its down projection, 1536 -> 576: a lone row once took another path there), in
    one of ``PRODUCTS``, at torch's thread count now."""
    return packed_products(dtype, device) is not None


def linear_options(products: str) -> RowCalls:
    """How the runner's linear layers are built for these eager products ("packed",
    "packed-spans<ceiling>", "packed-tiles", "plain"): the one reading of their names."""
    from .linear import CPU_TILE_ROWS, SPAN_FLOOR

    if products.startswith(SPANS):
        return RowCalls(span=(SPAN_FLOOR, int(products.removeprefix(SPANS))))
    return RowCalls(pack=products != "plain",
                    tile=CPU_TILE_ROWS if products == "packed-tiles" else None)


def linear_for(products: str, weight: torch.Tensor, bias: torch.Tensor | None = None
               ) -> Linear:
    """The runner's linear layer with these products (``linear_options``)."""
    return linear_options(products).linear(weight, bias)


DOWN = (576, 1536)  # (out, in) of the default model's down projection, the products' probe


def _probe_counts(products: str) -> tuple[int, list[int]]:
    """The rows of a products' probe and the call sizes it tries: for spans every size from
    just below the floor to one past the ceiling (a call cut in two)."""
    span = linear_options(products).span
    if span is None:
        return 64, [3, 17, 31, 33, 47]
    floor, ceiling = span
    return ceiling + 2, [1, floor - 1, *range(floor, ceiling + 2)]


def cancelling_probe(shape: tuple[int, int], rows: int, dtype: torch.dtype, device: str,
                     seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight of ``shape`` (out, in) and ``rows`` rows whose products cancel in pairs (each
    input column and a partner: the same weights, opposite inputs), so every exact output is 0
    and what a call returns is its float32 sums' rounding residue, which any change of
    summation order moves. (Random rows show a changed order in bfloat16 only where a sum lies
    near a rounding boundary, a few elements a call: a narrow layer that varied was caught by
    about half the draws.)"""
    out, k = shape
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=g) * 0.05
    x = torch.randn(rows, k, generator=g) * 2
    p, h = torch.randperm(k, generator=g), k // 2
    w[:, p[h:2 * h]] = w[:, p[:h]]
    x[:, p[h:2 * h]] = -x[:, p[:h]]
    return w.to(device=device, dtype=dtype), x.to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=None)
def _span_exact(dtype: torch.dtype, device: str, threads: int, products: str,
                shape: tuple[int, int]) -> bool:
    """Whether spans give a row of a linear layer of this (out, in) shape the same bits at every
    call size they make (each size's first rows, so each row last in one of the calls) and one
    and 17 places earlier in its call, against the same rows in a call of the ceiling and a
    cut one (``cancelling_probe``'s rows: the kernel's summation order, not the values,
    decides)."""
    floor, ceiling = linear_options(products).span  # type: ignore[misc]
    w, x = cancelling_probe(shape, ceiling + 17, dtype, device, seed=sum(shape))
    try:
        lin = linear_for(products, w)
        ref = lin(x)  # a call of the ceiling and a cut part
        return all(torch.equal(lin(x[:c]), ref[:c])
                   for c in (1, floor - 1, *range(floor, ceiling + 2))) and \
            all(torch.equal(lin(x[shift:]), ref[shift:]) for shift in (1, 17))
    except RuntimeError as exc:
        log.info("linear probe (%s) of %s in %s on %s failed: %s", products, shape, dtype,
                 device, exc)
        return False


@functools.lru_cache(maxsize=None)
def _packed_linear_exact(dtype: torch.dtype, device: str, threads: int, products: str) -> bool:
    g = torch.Generator().manual_seed(1)
    rows, counts = _probe_counts(products)
    w = (torch.randn(*DOWN, generator=g) * 0.05).to(device=device, dtype=dtype)
    x = (torch.randn(rows, 1536, generator=g) * 2).to(device=device, dtype=dtype)
    try:
        lin = linear_for(products, w)
        wide = lin(x)
        # calls that end in a part of a tile (a lone row among them), about a span's ends; on
        # rows that cancel too, where any change of order shows
        cw, cx = cancelling_probe(DOWN, rows, dtype, device, seed=1)
        clin = linear_for(products, cw)
        for probe, rows_in, whole in ((lin, x, wide), (clin, cx, clin(cx))):
            if not _rows_agree(probe, rows_in, whole) or \
                    first_varying_count(probe, rows_in, counts) is not None:
                return False
    except RuntimeError as exc:
        log.info("linear probe (%s) in %s on %s failed: %s", products, dtype, device, exc)
        return False
    ref = x.float() @ w.float().t()
    return (wide.float() - ref).abs().max().item() <= 0.05 * ref.abs().max().item()


def _rows_agree(lin, x: torch.Tensor, wide: torch.Tensor) -> bool:
    """Whether ``lin`` gives every row of x [R, K] (R even) alone and in pairs the bits it gave
    all rows together (``wide`` = lin(x))."""
    alone = torch.cat([lin(x[i:i + 1]) for i in range(len(x))])
    pairs = torch.cat([lin(x[i:i + 2]) for i in range(0, len(x), 2)])
    return torch.equal(alone, wide) and torch.equal(pairs, wide)


def probe_row_counts(device: str, max_rows: int) -> list[int]:
    """The row counts a start check tries, up to ``max_rows`` (the most rows one forward
    sends). On CUDA, where every call is padded to whole tiles, the counts that can differ are
    the paddings of a tile: every count up to two tiles (each padding of a first and of a second
    tile), and ``max_rows`` (above two tiles a call only repeats the same tile calls). On CPU,
    where oneDNN chooses its blocking by powers of two and a lone row once took its own path:
    1, 2, 3 and each power of two and its neighbours up to 128, past a prefill chunk's 64 rows
    into the sizes where a threaded gemm splits its rows another way (about a second for the
    default model: the packed kernel was measured invariant from 2 to 512 rows)."""
    from .linear import TILE_ROWS

    if device.startswith("cuda"):
        counts = set(range(1, 2 * TILE_ROWS + 1))
    else:  # and about the spans' floor (40) and lower ceiling (96)
        max_rows = min(max_rows, 129)
        counts = {1, 2, 3} | {p + d for p in (4, 8, 16, 32, 40, 64, 96, 128) for d in (-1, 0, 1)}
    return sorted(c for c in counts | {max_rows} if 1 <= c <= max_rows)


def first_varying_count(fn, x: torch.Tensor, counts: list[int]) -> int | None:
    """The first row count at which a row-wise ``fn`` gives rows other bits than it gave them
    among all of x [R, K] (rows taken from the start and from the end of x, so a row's place in
    the call changes too), or None if every count agrees."""
    full = fn(x)
    n = len(x)
    for c in counts:
        if not (torch.equal(fn(x[:c]), full[:c]) and torch.equal(fn(x[n - c:]), full[n - c:])):
            return c
    return None


def probe_input(rows: int, width: int, like: torch.Tensor, seed: int = 2) -> torch.Tensor:
    """Random rows [rows, width] on ``like``'s device in its dtype, made on the CPU generator so
    every device probes the same numbers."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=g) * 2).to(device=like.device, dtype=like.dtype)


def exact_here(name: str, device: str = "cpu") -> bool:
    dtype = DTYPES[name]
    return packed_linear_exact(dtype, device) and attention_tile(dtype, device) is not None
