"""Which dtypes this machine serves exactly, decided by probes at start, not by CPU flags.

A dtype is served as lossless only if the runner's kernels are batch-invariant in it here: the
attention (``edgespec.runner.attention.probe_invariance``, for a query-column tile of 16, else
32, 64 or 128) and the packed linear layers (every row alone, in pairs and among 64 rows gives
the same bits, and the product is right: within bfloat16 rounding of a float32 reference).
``auto`` takes bfloat16 where both hold (on this CPU: AMX through oneDNN, about 1.5x float32's
forward), else float32. CPU flags are not trusted: the machine this was built on advertises AMX,
and llama.cpp's AMX path faults on it, while oneDNN's runs.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..config import DTYPE_NAMES, ConfigError

log = logging.getLogger("edgespec.dtype")

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
COL_TILES = (16, 32, 64, 128)


@functools.lru_cache(maxsize=None)
def attention_tile(dtype: torch.dtype, device: str = "cpu", kv_heads: int = 2, group: int = 3,
                   head_dim: int = 64) -> int | None:
    """The smallest query-column tile at which attention is batch-invariant here for this head
    layout, or None."""
    from .attention import probe_invariance

    for tile in COL_TILES:
        try:
            if probe_invariance(dtype, device, tile, kv_heads, group, head_dim):
                return tile
        except RuntimeError as exc:  # a kernel this machine lacks for the dtype
            log.info("attention probe in %s on %s failed: %s", dtype, device, exc)
            return None
    return None


@functools.lru_cache(maxsize=None)
def packed_linear_exact(dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether the runner's linear layer in ``dtype`` computes the right product and gives every
    row the same bits alone and among 64 rows, for the default model's widest reduction (its
    down projection, 1536 -> 576: a lone row once took another path there)."""
    from .linear import Linear

    g = torch.Generator().manual_seed(1)
    w = (torch.randn(576, 1536, generator=g) * 0.05).to(device=device, dtype=dtype)
    x = (torch.randn(64, 1536, generator=g) * 2).to(device=device, dtype=dtype)
    try:
        lin = Linear(w)
        wide = lin(x)
        if not _rows_agree(lin, x, wide):
            return False
    except RuntimeError as exc:
        log.info("packed linear probe in %s on %s failed: %s", dtype, device, exc)
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
    1, 2, 3 and each power of two and its neighbours up to 64 (well under a second for the
    default model: the packed kernel was measured invariant from 2 to 512 rows)."""
    from .linear import TILE_ROWS

    if device.startswith("cuda"):
        counts = set(range(1, 2 * TILE_ROWS + 1))
    else:
        max_rows = min(max_rows, 64)
        counts = {1, 2, 3} | {p + d for p in (4, 8, 16, 32, 64) for d in (-1, 0, 1)}
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


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """The dtype to serve for ``name`` ("auto" or one of DTYPES) on ``device``; ConfigError for
    a dtype this machine cannot serve exactly (lossless decoding is never served inexactly)."""
    if name not in DTYPE_CHOICES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    if name == "auto":
        chosen = "bfloat16" if exact_here("bfloat16", device) else "float32"
        log.info("dtype auto: %s on %s", chosen, device)
        name = chosen
    if not exact_here(name, device):
        raise ConfigError(
            f"dtype {name} is not batch-invariant on this {device} (its probe failed), so "
            f"speculative decoding in it would not be lossless; use --dtype auto or float32")
    return name
