"""The fused path's products on CUDA: at each row count the fastest kernel that gives the cuBLAS
tiles' bits, proven so at start.

The runner's products are cuBLAS in 128-row tiles (``Linear.tiles``): a row's bits do not depend
on the call. The GPU sitting of 2026-12-04 (an H200, ``docs/measured/gpu/``) timed the tiles
against the Triton GEMM (``fused_gemm``) in eleven configurations, product by product, at 1, 40,
64 and 576 rows, and grouped the kernels by the bits they give: for every product but the MLP's
down projection at the 1.7b and 8b shapes (whose long reduction cuBLAS splits), every Triton
configuration with one range of K gave exactly the tiles' bits (both sum each output over K in
the same order, in float32), and several were faster at some row counts: a decode row through
narrow column tiles (8b attention output 1.39x), a 576-row verification step through big tiles
that read each weight tile once (8b qkv 1.43x, 135m 3-3.7x), where the tiles read the weights
once per 128 rows.

So a product keeps the tiles' bits and runs, in each band of row counts, the kernel measured
fastest there among those that give them (``MEASURED``: bfloat16, by the product's (outputs,
inputs)); at start the runner proves each planned kernel against the tiles (``prove_plan``:
rows of two kinds in a call, and a row alone), and a kernel that differs is dropped from the
plan (its band goes back to the tiles), so a row's bits still depend neither on the batch nor
on the band. Two kernels give equal bits for every input exactly when they do the same
arithmetic in the same order, which does not depend on the values: so one proof a shape, dtype
and device a process (on the first layer of that shape) stands for every layer; a kernel that
sums in another order differs on almost every random row, and the probe's second kind of rows
(columns scaled from 2^-12 to 2^12) makes rounding differences likelier still. The plans serve
Hopper GPUs (compute capability 9: the H100 and H200 they were measured on); other GPUs, shapes
and dtypes run the tiles at every row count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from .fused_gemm import CANDIDATES, GemmConfig, fits

log = logging.getLogger(__name__)

BY_NAME = {c.name: c for c in CANDIDATES}
TILES = "tiles"
PROBE_ROWS = 256  # two tiles: a call's rows against the same rows through each planned kernel

# (outputs N, inputs K) -> ((most rows, kernel), ...), the last band any number of rows: the
# fastest kernel of the tiles' bits in each band at the sitting's rows (1; 40 and 64; 576),
# where it beat the tiles by over 3% (``scripts/sitting_gemm.py``'s JSON, H200, bfloat16)
MEASURED: dict[tuple[int, int], tuple[tuple[int | None, str], ...]] = {
    # Llama-3.1-8B
    (6144, 4096): ((128, TILES), (None, "128x128x64/w8s3g16/nosplit")),
    (4096, 4096): ((16, "16x32x128/w4s4g16/nosplit"), (128, TILES),
                   (None, "64x64x64/w4s4g16/nosplit")),
    (28672, 4096): ((16, "16x64x64/w4s4g16/nosplit"), (128, "64x128x64/w4s4g16/nosplit"),
                    (None, "128x128x64/w8s3")),
    (128256, 4096): ((16, "16x32x128/w4s4g16/nosplit"), (128, "64x128x64/w4s4"),
                     (None, "128x256x64/w8s3")),
    # SmolLM2-1.7B
    (6144, 2048): ((128, TILES), (None, "128x128x64/w8s3g16/nosplit")),
    (2048, 2048): ((16, "16x32x128/w4s4g16/nosplit"), (128, TILES),
                   (None, "128x128x64/w8s3g16/nosplit")),
    (16384, 2048): ((16, "16x32x128/w4s4g16/nosplit"), (128, "64x64x64/w4s4g16/nosplit"),
                    (None, "128x128x64/w8s3g16/nosplit")),
    (49152, 2048): ((16, "16x64x64/w4s4g16/nosplit"), (128, "64x64x64/w4s4g16/nosplit"),
                    (None, "128x128x64/w8s3")),
    # SmolLM2-135M (the default model's shape)
    (960, 576): ((128, "16x32x128/w4s4g16/nosplit"), (None, "64x64x64/w4s4g16/nosplit")),
    (576, 576): ((128, "16x32x128/w4s4g16/nosplit"), (None, "64x64x64/w4s4g16/nosplit")),
    (3072, 576): ((16, "16x32x128/w4s4g16/nosplit"), (128, TILES),
                  (None, "128x128x64/w8s3g16/nosplit")),
    (576, 1536): ((128, TILES), (None, "64x64x64/w4s4g16/nosplit")),
    (49152, 576): ((16, "16x64x64/w4s4g16/nosplit"), (128, "64x64x64/w4s4g16/nosplit"),
                   (None, "128x128x64/w8s3")),
}


@dataclass(frozen=True)
class Band:
    """Calls of up to ``max_rows`` rows (None: any number) run ``config`` (None: the tiles)."""

    max_rows: int | None
    config: GemmConfig | None


@dataclass(frozen=True)
class GemmPlan:
    """An (n outputs, k inputs) product's kernel by row count, bands in increasing order."""

    bands: tuple[Band, ...]
    n: int
    k: int

    def config_for(self, rows: int) -> GemmConfig | None:
        """The Triton configuration a call of ``rows`` real rows runs (None: the tiles, also
        where the band's kernel cannot take the call: ``fused_gemm.fits``)."""
        for band in self.bands:
            if band.max_rows is None or rows <= band.max_rows:
                config = band.config
                return config if config is None or fits(rows, self.n, self.k, config) else None
        return None

    @property
    def configs(self) -> list[GemmConfig]:
        """The Triton configurations the plan runs, each once, in band order."""
        return list(dict.fromkeys(b.config for b in self.bands if b.config is not None))

    def without(self, dropped: set[GemmConfig]) -> "GemmPlan | None":
        """The plan with ``dropped`` kernels' bands back on the tiles (None: only tiles left)."""
        bands = tuple(Band(b.max_rows, None if b.config in dropped else b.config)
                      for b in self.bands)
        return replace(self, bands=bands) if any(b.config is not None for b in bands) else None

    def describe(self) -> str:
        """One line: each band's rows and kernel."""
        return ", ".join(f"{'<=' + str(b.max_rows) if b.max_rows else 'more'}: "
                         f"{b.config.name if b.config else TILES}" for b in self.bands)


def plan_for(n: int, k: int, dtype: torch.dtype) -> GemmPlan | None:
    """The measured plan of an (n outputs, k inputs) product in ``dtype``, None where there is
    none (the tiles at every row count)."""
    bands = MEASURED.get((n, k)) if dtype == torch.bfloat16 else None
    if not bands:
        return None
    return GemmPlan(tuple(Band(top, None if name == TILES else BY_NAME[name])
                          for top, name in bands), n, k)


def prove_plan(linear, plan: GemmPlan, seed: int = 0,
               rows: int = PROBE_ROWS) -> tuple[GemmPlan | None, list[str]]:
    """``plan`` with every kernel that does not give ``linear``'s tiles' bits here dropped:
    ``rows`` random rows in one call, and the first of them alone, against the tiles.
    Returns the proven plan (None: nothing but the tiles left) and what was dropped, why."""
    from .fused_gemm import gemm

    weight = linear.weight.detach()
    bias = None if linear.bias is None else linear.bias.detach()
    g = torch.Generator(device=weight.device).manual_seed(seed)
    x = torch.randn(rows, weight.shape[1], generator=g, device=weight.device,
                    dtype=torch.float32)
    scale = torch.exp2(torch.randint(-12, 13, (weight.shape[1],), generator=g,
                                     device=weight.device).float())
    x[rows // 2:] *= scale  # the second half's columns of very different sizes
    x = x.to(weight.dtype)
    want = linear.tiles_cublas(x)
    dropped: set[GemmConfig] = set()
    why: list[str] = []
    for config in plan.configs:
        try:
            got = gemm(x, weight, bias, config=config)
            alone = gemm(x[:1].contiguous(), weight, bias, config=config)
        except Exception as exc:  # a configuration that does not build or run here
            dropped.add(config)
            why.append(f"{config.name}: {type(exc).__name__}: {exc}")
            continue
        if not (torch.equal(got, want) and torch.equal(alone[0], want[0])):
            dropped.add(config)
            why.append(f"{config.name}: other bits than the tiles")
    return plan.without(dropped), why


# proven plans in this process, by (n, k, dtype, device, bias)
_PROVEN: dict[tuple, GemmPlan | None] = {}


def attach_plans(linears: list) -> str:
    """Give each linear of a measured shape on a Hopper GPU its proven plan (``Linear.plan``),
    proving each shape once a process; returns one line for the log."""
    planned = 0
    for lin in linears:
        w = lin.weight
        plan = plan_for(w.shape[0], w.shape[1], w.dtype)
        if plan is None or w.device.type != "cuda" or not w.is_contiguous() \
                or torch.cuda.get_device_capability(w.device)[0] != 9:
            continue
        key = (w.shape[0], w.shape[1], w.dtype, str(w.device), lin.bias is not None)
        if key not in _PROVEN:
            _PROVEN[key], why = prove_plan(lin, plan)
            for line in why:
                log.warning("product %d x %d: %s (that band runs the tiles)", w.shape[0],
                            w.shape[1], line)
        lin.plan = _PROVEN[key]
        planned += lin.plan is not None
    return f"{planned} of {len(linears)} products planned by rows"
