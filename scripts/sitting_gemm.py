"""The GPU sitting's GEMM stage (``scripts/gpu_sitting.py``): the runner's products, cuBLAS in
128-row tiles (what it serves with) against the fixed-config Triton GEMM in each configuration
of ``edgespec.runner.fused_gemm.CANDIDATES``, per shape, alone (no model built).

The first sitting found the tiles 22 of 49 ms of the 8b step at 64 x 9 (a 576-row step reads
the weights once per 128-row tile: five times) and the one Triton configuration tried no faster.
For each of a shape's distinct linears (qkv, o, gate_up, down, the LM head) at the rows of the
sitting's sizes (1, 40, 64 and 576: 1 x 1, 8 x 5, 64 x 1, 64 x 9), random bfloat16 weights on
the GPU, this stage takes CUDA-event medians of 10 calls and adds them up into the products'
milliseconds a step (each layer's four, times the layers, plus the LM head once), and checks
that each configuration gives a row the same bits alone as among 576. The fastest invariant
configuration at 64 x 9 that is no slower than the tiles at 1 x 1 is the one to serve with.
"""

from __future__ import annotations

import torch

from edgespec.models.shapes import SHAPES
from edgespec.runner.fused_gemm import CANDIDATES, gemm
from edgespec.runner.gemm_plan import plan_for
from edgespec.runner.fused_kernels import padded_rows
from edgespec.runner.linear import Linear

ROWS = (1, 40, 64, 576)  # the rows of 1 x 1, 8 x 5, 64 x 1 and 64 x 9


def _linears(shape: str) -> list[tuple[str, int, int, int]]:
    """(name, out features N, in features K, calls a step) of each of the shape's products."""
    m = SHAPES[shape]
    hd = m.hidden // m.heads
    return [("qkv", (m.heads + 2 * m.kv_heads) * hd, m.hidden, m.layers),
            ("o", m.hidden, m.heads * hd, m.layers),
            ("gate_up", 2 * m.mlp, m.hidden, m.layers),
            ("down", m.hidden, m.mlp, m.layers),
            ("lm_head", m.vocab, m.hidden, 1)]


def _alone_equal(x: torch.Tensor, w: torch.Tensor, config) -> bool:
    """A row's bits alone and among the call's others."""
    full = gemm(x, w, config=config)
    return all(torch.equal(gemm(x[r:r + 1].contiguous(), w, config=config)[0], full[r])
               for r in (0, x.shape[0] // 2, x.shape[0] - 1))


def _bit_classes(x: torch.Tensor, w: torch.Tensor, tiles: Linear, M: int) -> list[list[str]]:
    """The kernels (the tiles and each candidate) grouped by the bits of their output on x's
    first M rows (x: whole tiles): kernels in one group could be chosen between by row count
    without changing a row's bits."""
    outs = {"tiles": tiles.tiles(x, M)[:M]}
    outs.update({c.name: gemm(x, w, rows=M, config=c)[:M] for c in CANDIDATES})
    groups: list[list[str]] = []
    for name, y in outs.items():
        for group in groups:
            if torch.equal(outs[group[0]], y):
                group.append(name)
                break
        else:
            groups.append([name])
    return groups


def stage_gemm(s, shapes: list[str], rows: tuple[int, ...], timer) -> None:
    """Time the tiles and every candidate configuration over each shape's products.
    ``timer(fn)``: the median milliseconds of fn (CUDA events on the GPU)."""
    out = s.data.setdefault("gemm", {})
    g = torch.Generator().manual_seed(0)
    for shape in shapes:
        names = ["tiles", "plan"] + [c.name for c in CANDIDATES]
        step = {str(M): dict.fromkeys(names, 0.0) for M in rows}
        invariant = dict.fromkeys((c.name for c in CANDIDATES), True)
        per_linear = []
        for name, N, K, calls in _linears(shape):
            if s.dry:  # Triton's interpreter: the plumbing on a corner of each product
                N, K = min(N, 192), min(K, 128)
            w = (torch.randn(N, K, generator=g) * K ** -0.5).to(s.device, torch.bfloat16)
            tiles = Linear(w, pack=False, tiled=True)
            x_all = torch.randn(padded_rows(max(rows)), K, generator=g).to(s.device,
                                                                           torch.bfloat16)
            entry: dict = {"linear": name, "n": N, "k": K}
            # the runner's kernel at each row count (``gemm_plan``; proven there at start)
            plan = plan_for(N, K, torch.bfloat16)
            entry["plan"] = plan.describe() if plan is not None else "tiles"
            for M in rows:
                x = x_all[:padded_rows(M)].contiguous()
                ms = {"tiles": timer(lambda: tiles.tiles(x, M))}
                for c in CANDIDATES:
                    ms[c.name] = timer(lambda c=c: gemm(x, w, rows=M, config=c))
                planned = plan.config_for(M) if plan is not None else None
                ms["plan"] = ms[planned.name if planned is not None else "tiles"]
                for k, v in ms.items():
                    step[str(M)][k] += v * calls
                entry[str(M)] = {k: round(v, 4) for k, v in ms.items()}
            entry["same_bits"] = _bit_classes(x_all, w, tiles, max(rows))
            for c in CANDIDATES:
                if not _alone_equal(x_all[:max(rows)].contiguous(), w, c):
                    invariant[c.name] = False
                    s.mismatch(f"{shape} {name}: the Triton GEMM {c.name} gives a row other "
                               "bits alone than in its batch")
            per_linear.append(entry)
        out[shape] = {"step_ms": {M: {k: round(v, 3) for k, v in by.items()}
                                  for M, by in step.items()},
                      "invariant": invariant, "linears": per_linear}
        for M in rows:
            by = step[str(M)]
            best = min((c.name for c in CANDIDATES), key=lambda k: by[k])
            print(f"   {shape} {M} rows: products a step, tiles {by['tiles']:.2f} ms, the "
                  f"runner's plan {by['plan']:.2f} ms, best Triton {best} {by[best]:.2f} ms",
                  flush=True)
