"""The GPU sitting's stages that time a graphed runner's step beyond ``graphs``
(``scripts/gpu_sitting.py``): ``decode`` (a runner of each attention kernel at 1 x 1 over 300
and 4,096 keys and at 64 x 9), ``exactness``'s driver (the same model on cuBLAS and SDPA,
``sitting_exactness``) and ``breakdown`` (a graphed step's GPU time by kernel name). Each takes
the sitting (``gpu_sitting.Sitting``), a shape's name and its model."""

from __future__ import annotations

import json

import torch

from edgespec.config import ConfigError
from sitting_common import (CONTEXT, LONG_CONTEXT, chain_rows, event_median_ms,
                            free_device_memory, graphed_median_ms, profile_kernels, runner_for,
                            say)
from sitting_exactness import stage_exactness

DECODE_KERNELS = ("tiles", "split", "chunks", "split-decode")  # decode timed with each


def stage_decode(s, shape: str, model) -> None:
    """Decode (1 x 1, graphed) at 300 and 4,096 keys, and the 64 x 9 step at 300, on a runner
    of each attention kernel in ``DECODE_KERNELS``: the tiles walk a slot's keys in one
    program a kv head, the split kernel in chunks of 256 merged in order by a second kernel,
    the chunks kernel the same chunks in turn in the tiles' one program (the split's bits),
    split-decode split for one token a row and chunks for wider steps."""
    out = s.data.setdefault("decode", {}).setdefault(shape, {})
    for kernel in DECODE_KERNELS:
        try:
            out[kernel] = _decode_times(s, model, kernel)
        except ConfigError as e:  # its start probe refused it here (split-decode: where chunks
            out[kernel] = {"refused": str(e)}  # and split differ): what it found, not a break
        say(f"   {shape} {kernel}: " + ", ".join(f"{k} {v}" for k, v in out[kernel].items()))
        free_device_memory(s.device)


def _decode_times(s, model, kernel: str) -> dict:
    contexts = (CONTEXT, LONG_CONTEXT) if not s.dry else (20, 300)
    wide = (64, 9) if not s.dry else (2, 5)
    repeat = 20 if not s.dry else 1
    g = torch.Generator().manual_seed(1)
    runner = runner_for(s, model, wide[0], contexts[-1] + 32, graphs=True,
                        attention_kernel=kernel)
    row: dict = {}
    for _ in range(wide[0]):
        runner.new_slot()
    prompt = torch.randint(3, runner.vocab_size, (contexts[-1],), generator=g).tolist()
    for context in contexts:  # slot 0 at each context
        runner.prefill(0, prompt[:context])
        one = chain_rows(runner, 1, 1)
        row[f"1x1@{context}_ms"] = round(event_median_ms(lambda: runner.score_rows(one),
                                                         s.device, repeat), 3)
    runner.prefill(0, prompt[:contexts[0]])
    for slot in range(1, wide[0]):
        runner.prefill(slot, torch.randint(3, runner.vocab_size, (contexts[0],),
                                           generator=g).tolist())
    rows = chain_rows(runner, *wide)
    row[f"{wide[0]}x{wide[1]}_ms"] = round(event_median_ms(lambda: runner.score_rows(rows),
                                                            s.device, repeat), 3)
    row["graphs_failed"] = runner.graphs.state().failed if runner.graphs else "no graphs"
    return row


def stage_plain(s, shape: str, model) -> None:
    """The cost of exactness: the same model's step on cuBLAS and SDPA, graphed, against the
    runner's (``sitting_exactness``; after ``decode``, whose runner times it reads)."""
    context = CONTEXT if not s.dry else 20
    sizes = ((1, 1), (64, 9)) if not s.dry else ((1, 1), (2, 5))
    runner = runner_for(s, model, 1, context + 32, graphs=False)
    stage_exactness(s, shape, runner, sizes, context,
                    lambda fn: graphed_median_ms(fn, s.device, 20 if not s.dry else 1))
    del runner
    free_device_memory(s.device)


def stage_breakdown(s, shape: str, model) -> None:
    """Where a graphed step's GPU time goes: kernels by name at 1 x 1 and 64 x 9."""
    sizes = ((1, 1), (64, 9)) if not s.dry else ((1, 1), (2, 5))
    context = CONTEXT if not s.dry else 20
    top = max(b for b, _ in sizes)
    runner = runner_for(s, model, top, context + 32, graphs=True)
    g = torch.Generator().manual_seed(0)
    for slot in range(top):
        runner.new_slot()
        runner.prefill(slot, torch.randint(3, runner.vocab_size, (context,), generator=g).tolist())
    out = s.data.setdefault("breakdown", {}).setdefault(shape, {})
    for B, T in sizes:
        rows = chain_rows(runner, B, T)
        out[f"{B}x{T}"] = profile_kernels(lambda: runner.score_rows(rows), s.device)
        say(f"   {shape} {B} x {T}: {json.dumps(out[f'{B}x{T}'].get('top', [])[:5])}")
