"""The GPU sitting's attention stage (``scripts/gpu_sitting.py``): the fused attention kernels
(``edgespec.runner.fused_attention``) against each other, alone, at each shape's head layout.

The first sitting found the attention kernel half of a graphed step (8b at 64 x 9: 25 of 49 ms;
135m at 1 x 1: 0.76 of 1.44 ms): one program per query and head re-read every key block for
each of them. This stage answers, in seconds and before any model is built, which kernel a
runner should serve with: for every kernel (``tiles``, ``rows``, ``split``: the tiles over
fixed chunks of keys, merged in order), the start probe's verdict (a query's bits alone, in a
batch and as a tree node), the median of calls replayed from a CUDA graph (so the kernel is
timed, not its launch) at the sitting's sizes over 300- and 4,096-key contexts (the tiles also
with 1, 2, 4 and 8 warps a program), and how far apart the kernels' outputs are (their sums
are ordered differently, so they agree to rounding, not bits). A runner takes the first kernel
whose probe passes (``kernel_set.choose_kernel_set``) unless asked for one; the timings say
which should be first.
"""

from __future__ import annotations

import torch

from edgespec.models.shapes import SHAPES
from edgespec.runner.fused_attention import ATTENTION_KERNELS, slot_attention
from edgespec.runner.fused_attention_probe import probe_slot_attention
from edgespec.runner.fused_kernels import FusedStep

WARPS = (1, 2, 4, 8)
AGREE = 0.1  # bfloat16 outputs of order 1, summed in another order: a few units of 2^-8 apart


def _inputs(B: int, T: int, context: int, nh: int, kvh: int, hd: int, device: str, seed: int):
    """Queries [B T, nh hd] and a KV cache [B, kvh, cap, hd] whose slots hold ``context`` keys
    plus the step's T, bfloat16."""
    g = torch.Generator().manual_seed(seed)
    cap = -(-(context + T) // 64) * 64

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, torch.bfloat16)

    q = rand(B * T, nh * hd)
    k, v = rand(B, kvh, cap, hd), rand(B, kvh, cap, hd)
    slots = torch.arange(B, device=device)
    starts = torch.full((B,), context, dtype=torch.long, device=device)
    return q, k, v, FusedStep.chains(slots, starts, T)


def stage_attention(s, shapes: list[str], sizes, contexts, timer) -> None:
    """Probe and time every attention kernel at each shape's head layout, over each context
    length. ``timer(fn)``: the median milliseconds of fn (replayed from a CUDA graph on the
    GPU: the launch is not what is timed)."""
    out = s.data.setdefault("attention", {})
    first = ATTENTION_KERNELS[0]
    for shape in shapes:
        m = SHAPES[shape]
        nh, kvh, hd = m.heads, m.kv_heads, m.hidden // m.heads
        entry: dict = {"layout": f"{nh} q heads, {kvh} kv heads, head size {hd}",
                       "probe": {}, "sizes": []}
        for kernel in ATTENTION_KERNELS:
            differs = probe_slot_attention(torch.bfloat16, s.device, nh, kvh, hd, kernel)
            entry["probe"][kernel] = "invariant" if differs is None else differs
            if differs is not None and kernel == first:
                s.mismatch(f"{shape}: the {kernel} attention's probe failed ({differs})")
        for context in contexts:
            for B, T in sizes:
                entry["sizes"].append(_timed_size(s, shape, (nh, kvh, hd), B, T, context, timer))
        out[shape] = entry


def _timed_size(s, shape: str, layout, B: int, T: int, context: int, timer) -> dict:
    """One size's row: every kernel's ms (the tiles' also by warps), each against the first,
    and how far the kernels' outputs are from the first's."""
    nh, kvh, hd = layout
    first = ATTENTION_KERNELS[0]
    q, k, v, step = _inputs(B, T, context, nh, kvh, hd, s.device, seed=B * 100 + T)
    row: dict = {"context": context, "sessions": B, "tokens": T}
    outs = {}
    for kernel in ATTENTION_KERNELS:
        def call(kernel=kernel, warps=None):
            return slot_attention(q, step, k, v, nh, kvh, hd, hd ** -0.5, kernel=kernel,
                                  warps=warps)

        outs[kernel] = call()[:B * T].float()
        row[f"{kernel}_ms"] = round(timer(call), 4)
        if kernel == "tiles":  # the warps a tile program runs with, besides the default
            row["tiles_ms_by_warps"] = {w: round(timer(lambda w=w: call(warps=w)), 4)
                                        for w in WARPS}
            # whether a warp count keeps the default's bits (a runner could then take the
            # fastest for every step without a row's bits moving)
            row["tiles_bits_by_warps"] = {
                w: bool(torch.equal(call(warps=w)[:B * T].float(), outs["tiles"]))
                for w in WARPS}
    # the chunks kernel does the split kernel's arithmetic in one program: equal bits would let
    # a runner take either by the step (split for decode over long slots, chunks when wide)
    row["chunks_equal_split"] = bool(torch.equal(outs["chunks"], outs["split"]))
    row["max_abs_diff"] = max(float((outs[x] - outs[first]).abs().max())
                              for x in ATTENTION_KERNELS)
    if row["max_abs_diff"] > AGREE:
        s.mismatch(f"{shape} {B} x {T} at {context} keys: the attention kernels' outputs "
                   f"differ by {row['max_abs_diff']:.3g}")
    row["vs_first"] = {x: round(row[f"{x}_ms"] / max(row[f"{first}_ms"], 1e-9), 2)
                       for x in ATTENTION_KERNELS[1:]}
    print(f"   {shape} {B} x {T} at {context} keys: " + ", ".join(
        f"{x} {row[f'{x}_ms']:.4f} ms" for x in ATTENTION_KERNELS)
        + f", outputs within {row['max_abs_diff']:.1e}, chunks = split bits "
        f"{row['chunks_equal_split']}", flush=True)
    return row
