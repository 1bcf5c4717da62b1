"""Whether torch.compile (inductor) keeps the runner's per-layer pointwise bits on this CPU.

    python scripts/compile_exactness.py

The runner's exactness rests on each row getting the same bits whatever the batch; a fused
kernel is usable only if it gives eager's bits at every row count. This compiles the rotary
embedding, SiLU(gate) x up and the RMS norm (dynamic shapes), compares them bit for bit with the
eager forms the runner runs, at row counts 1..64, in float32 and bfloat16, and times both (2
torch threads). Measured here (issue 24, point 3): float32 rotary and SiLU x up exact, RMS norm
not, compiled slower; bfloat16 none exact. So the CPU runner stays eager.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from edgespec.runner.attention import pointwise

ROWS = (1, 2, 3, 5, 8, 9, 17, 40, 64)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def silu_up(gate, up):
    return F.silu(gate) * up


def silu_up_eager(gate, up):  # the runner's: every element on the vectorised path
    return pointwise(F.silu, gate) * up


def rms(x, w, eps=1e-5):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)  # this machine's cores
    compiled = {name: torch.compile(fn, dynamic=True)
                for name, fn in (("rotate", rotate), ("silu_up", silu_up), ("rms", rms))}
    for dtype in (torch.float32, torch.bfloat16):
        exact = dict.fromkeys(compiled, True)
        eager_s = compiled_s = 0.0
        for rows in ROWS:
            x = torch.randn(rows, 9, 64, dtype=dtype)
            cos, sin = (torch.randn(rows, 1, 64, dtype=dtype) for _ in range(2))
            exact["rotate"] &= torch.equal(compiled["rotate"](x, cos, sin), rotate(x, cos, sin))
            g, u = (torch.randn(rows * 5, 1536, dtype=dtype) for _ in range(2))
            exact["silu_up"] &= torch.equal(compiled["silu_up"](g, u), silu_up_eager(g, u))
            h, w = torch.randn(rows * 5, 576, dtype=dtype), torch.randn(576, dtype=dtype)
            exact["rms"] &= torch.equal(compiled["rms"](h, w), rms(h, w))
            for _ in range(3):
                t = time.perf_counter()
                silu_up_eager(g, u), rms(h, w)
                eager_s += time.perf_counter() - t
                t = time.perf_counter()
                compiled["silu_up"](g, u), compiled["rms"](h, w)
                compiled_s += time.perf_counter() - t
        print(f"{dtype}: bit-exact at rows {ROWS[0]}..{ROWS[-1]}: {exact}; SiLU x up + RMS norm "
              f"eager {eager_s * 1e3:.1f} ms, compiled {compiled_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
