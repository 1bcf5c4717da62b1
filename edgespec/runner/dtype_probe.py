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


def linear_rows_exact(lin, rows: int = 16, seed: int = 2) -> bool:
    """Whether a runner ``Linear`` gives each of ``rows`` random rows the same bits alone, in
    pairs and all together (the served model's own weights and shapes)."""
    g = torch.Generator().manual_seed(seed)
    w = lin.weight
    x = torch.randn(rows, w.shape[1], generator=g).to(device=w.device, dtype=w.dtype)
    return _rows_agree(lin, x, lin(x))


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
