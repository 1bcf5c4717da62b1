"""The target runner's start check: refuse a model whose kernels are not batch-invariant here.

Verification is lossless only if a row's bits do not depend on the other rows a forward carries
(DESIGN: exactness from batch-invariant kernels, never a tolerance). Before a runner serves, every
distinct linear shape of the model (its own weights), and the row-wise pointwise ops (RMS norm,
SiLU; the fused kernels' own on the GPU path), are run on the same rows at each row count
``probe_row_counts`` gives up to the runner's ``max_rows``; the first count that gives a row
other bits than the widest refuses the model (``ConfigError``), naming the part and the count.
The attention's probe runs when the kernel set is chosen (``kernel_set``). Under a second for the
default model on a CPU; on a GPU, milliseconds a shape (and cached: ``check_cache``).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from ..config import ConfigError
from .attention import pointwise
from .check_cache import CheckKey, code_digest, model_fingerprint, run_checked
from .dtype_probe import first_varying_count, probe_input, probe_row_counts
from .kernel_set import refusal
from .model_weights import distinct_linears


def check_at_start(runner: Any, model_config: Any, kernels: str) -> float:
    """Run ``check_invariance`` on a new target runner; its seconds. On a CPU it runs every
    time: under a second, and its probes warm oneDNN's kernels for the row counts the steps then
    meet (a cached check left the first steps to pay that: Spec-Bench's target-only 12% slower,
    measured). On a GPU its outcome is cached (``check_cache``) under the model's fingerprint
    (``model_config``, its transformers config, and a sample of its weights), the device, the
    dtype, the rows checked, ``kernels`` (the kernel set's choices and code digest) and the
    probes' own code."""
    if runner.device.type != "cuda":
        t0 = time.perf_counter()
        check_invariance(runner)
        return time.perf_counter() - t0
    from . import dtype_probe

    fingerprint = model_fingerprint(model_config.to_dict(), sampled_weights(runner))
    key = CheckKey.here(fingerprint, runner.device, runner.dtype, runner.max_rows,
                        f"{kernels}+{code_digest(dtype_probe, sys.modules[__name__])}")
    return run_checked(key, lambda: check_invariance(runner)).seconds


def sampled_weights(runner: Any) -> list[torch.Tensor]:
    """The tensors of ``runner`` (a ``TargetRunner``) a start check's outcome depends on (the
    check cache fingerprints a sample of each)."""
    out = [runner.embed, runner.norm, runner.lm_head.weight]
    for layer in runner.layers:
        out += [layer.ln1, layer.ln2, layer.qkv.weight, layer.o.weight,
                layer.gate_up.weight, layer.down.weight]
    return out


@torch.inference_mode()
def check_invariance(runner: Any) -> None:
    """Raise ``ConfigError`` unless each of ``runner``'s linear shapes and row-wise ops gives
    every row the same bits at every probed row count (``runner``: a ``TargetRunner``, not
    imported here: it imports this module)."""
    refuse = refusal(runner.dtype, runner.device)
    counts = probe_row_counts(str(runner.device), runner.max_rows)
    rows = counts[-1]
    for name, lin in distinct_linears(runner.layers[0], runner.lm_head):
        k, n = lin.shape
        bad = first_varying_count(lin, probe_input(rows, k, lin.weight), counts)
        if bad is not None:
            raise ConfigError(f"linear layer {name} ({k} -> {n}) is not batch-invariant here: "
                              f"a call of {bad} rows gives a row other bits than a call of "
                              f"{rows}, {refuse}")
    hidden = probe_input(rows, runner.embed.shape[1], runner.embed)
    checks = [("RMS norm", lambda t: runner._rms(t, runner.norm)),
              ("SiLU", lambda t: pointwise(F.silu, t))]
    if runner.fused is not None:
        from . import fused_kernels as fk

        checks = [("fused RMS norm",
                   lambda t: fk.add_rms_norm(t.contiguous(), None, runner.norm,
                                             runner.eps)[:t.shape[0]]),
                  ("fused SiLU x up",
                   lambda t: fk.silu_mul(_tile_rows(torch.cat([t, t.flip(-1)], -1)),
                                         t.shape[0])[:t.shape[0]])]
    for name, fn in checks:
        bad = first_varying_count(fn, hidden, counts)
        if bad is not None:
            raise ConfigError(f"the {name} is not batch-invariant here: a call of {bad} rows "
                              f"gives a row other bits than a call of {rows}, {refuse}")


def _tile_rows(x: torch.Tensor) -> torch.Tensor:
    """x [n, K] padded with zero rows to whole tiles of the fused kernels' staging buffers."""
    from .fused_kernels import padded_rows

    return F.pad(x, (0, 0, 0, padded_rows(x.shape[0]) - x.shape[0])).contiguous()
