"""``--dtype auto`` and every named dtype resolved at start: a dtype is served only where its
probes (``dtype_probe.exact_here``) find the runner's kernels batch-invariant here, at the
thread count that will serve; among the exact candidates ``auto`` takes the one whose linear
layers are measured faster here (bfloat16 only when clearly faster), measured once a machine
setting and remembered (``dtype_memo``). A refusal names the dtype, the device, the thread
count and what to use instead; on a CPU whose thread count is an unsettled default, a refused
count is lowered first (``thread_step_down``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..config import ConfigError
from .cpu_kind import cpu_kind
from .dtype_memo import memo_path, remember, remembered, setting_key
from .dtype_probe import DTYPE_CHOICES, DTYPES, exact_here, linear_for, packed_products
from .thread_step_down import resolve_stepping_down

log = logging.getLogger("edgespec.dtype")


COST_LAYERS = 16  # linear_costs_ms's distinct weights: 113 MB in float32, past a core's caches
# what auto measures, part of the setting a choice is remembered for (another measure, another key)
COST_PROBE = (f"the fastest pass of {COST_LAYERS} 576->3072 linears over 8 rows, the dtypes' "
              "passes alternating")
COST_WARMUP = 12  # passes before timing: float32's first passes over fresh weights ran ~2x slower


def linear_costs_ms(dtypes: Sequence[torch.dtype], device: str = "cpu", rows: int = 8,
                    repeats: int = 15) -> list[float]:
    """Each dtype's fastest of ``repeats`` passes of the runner's linear layers over ``rows``
    rows (a verification step's) through ``COST_LAYERS`` distinct weights at the default
    model's MLP width (576 -> 3072, its gate and up projections: the shape most of a forward's
    time goes through), at torch's thread count now, in the products the runner would use,
    after ``COST_WARMUP`` passes; the dtypes' passes alternate. Distinct weights, more than a
    core's own caches hold, as a model's layers are: bfloat16's half-size ones pay there (one
    weight, read from a core's cache every call, measured float32 the faster at 2 threads on an
    Emerald Rapids Xeon whose bfloat16 forward was 1.2-1.5x float32's). The fastest pass, and
    the passes alternating: a busy machine only adds time, its slow spells last seconds (one
    dtype measured after the other had caught one of them in one process of six), and the
    first measurement is remembered for good."""
    g = torch.Generator().manual_seed(3)
    layers = []
    for dtype in dtypes:
        products = packed_products(dtype, device) or "packed"
        layers.append(([linear_for(products, (torch.randn(3072, 576, generator=g) * 0.05).to(
            device=device, dtype=dtype)) for _ in range(COST_LAYERS)],
            torch.randn(rows, 576, generator=g).to(device=device, dtype=dtype)))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    best = [float("inf")] * len(layers)
    for i in range(repeats + COST_WARMUP):
        for j, (lins, x) in enumerate(layers):
            sync()
            t0 = time.perf_counter()
            for lin in lins:
                lin(x)
            sync()
            if i >= COST_WARMUP:
                best[j] = min(best[j], (time.perf_counter() - t0) * 1e3)
    return best


@dataclass(frozen=True)
class DtypeChoice:
    """What ``auto`` chose and why: the exact candidates' measured linear cost (ms)."""

    dtype: str
    cost_ms: dict[str, float]
    refused: tuple[str, ...]  # candidates whose probe failed here
    remembered: str = ""  # when the choice was measured, if it was remembered (``dtype_memo``)

    def reason(self) -> str:
        costs = ", ".join(f"{d} {ms:.3f} ms" for d, ms in self.cost_ms.items())
        kept = (f", remembered from {self.remembered} in {memo_path()} (delete it to measure "
                f"again)" if self.remembered else "")
        why = (f"exact here and measured faster ({COST_PROBE}: {costs}; "
               f"bfloat16 only if under {BF16_MARGIN:.0%} of float32's){kept}"
               if len(self.cost_ms) > 1 else "the only exact candidate")
        refused = f"; not batch-invariant here: {', '.join(self.refused)}" if self.refused else ""
        return f"{self.dtype}: {why}{refused}"


AUTO_CANDIDATES = ("bfloat16", "float32")
# bfloat16 must cost under this share of float32's to be chosen: near a tie the choice would
# depend on the moment's load, and float32 is then as fast and simpler to trust
BF16_MARGIN = 0.9


def _threads_note(device: str, also_tried: Sequence[int] = ()) -> str:
    """What a refusal says of the thread count: the counts tried below it where a default was
    lowered (``thread_step_down``), else that fewer --threads may pass (on a CPU, above 1)."""
    if also_tried:
        return f" (nor at {', '.join(map(str, also_tried))} threads)"
    if device == "cpu" and torch.get_num_threads() > 1:
        return " (a BLAS may split its products by the thread count: fewer --threads may pass)"
    return ""


def choose_auto(device: str = "cpu", also_tried: Sequence[int] = ()) -> DtypeChoice:
    """Among the exact candidates, the one whose linear layer is faster here, measured once a
    machine setting and remembered (``dtype_memo``). ``also_tried``: thread counts below this
    one already refused, named if this one is too."""
    exact = [d for d in AUTO_CANDIDATES if exact_here(d, device)]
    refused = tuple(d for d in AUTO_CANDIDATES if d not in exact)
    if not exact:
        raise ConfigError(f"no dtype is batch-invariant on this {device} at "
                          f"{torch.get_num_threads()} threads{_threads_note(device, also_tried)}"
                          f": neither {' nor '.join(AUTO_CANDIDATES)} passed its probe")
    if len(exact) == 1:
        return DtypeChoice(exact[0], {exact[0]: float("nan")}, refused)
    what = cpu_kind().describe() if device == "cpu" else torch.cuda.get_device_name(device)
    key = setting_key(device, what, exact, COST_PROBE)
    kept = remembered(key)
    if kept is not None and kept["dtype"] in exact:  # the first measurement, for every run
        return DtypeChoice(kept["dtype"], kept["cost_ms"], refused,
                           str(kept.get("measured") or "?"))
    costs = dict(zip(exact, linear_costs_ms([DTYPES[d] for d in exact], device)))
    best = "bfloat16" if costs["bfloat16"] < BF16_MARGIN * costs["float32"] else "float32"
    remember(key, best, costs)
    return DtypeChoice(best, costs, refused)


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """The dtype to serve for ``name`` ("auto" or one of DTYPES) on ``device``, at torch's
    thread count now (set it first: the probes run at it); ConfigError for a dtype this machine
    cannot serve exactly (lossless decoding is never served inexactly). On a CPU whose thread
    count is a default nothing has settled yet, a count at which it is refused is lowered to
    the highest at which it is exact (``thread_step_down``), which the process then keeps."""
    if name not in DTYPE_CHOICES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    if device != "cpu":
        return _resolve_at_threads_now(name, device)
    what = "no dtype is" if name == "auto" else f"dtype {name} is not"
    return resolve_stepping_down(lambda tried: _resolve_at_threads_now(name, device, tried),
                                 what)


def _resolve_at_threads_now(name: str, device: str, also_tried: Sequence[int] = ()) -> str:
    """``name`` resolved at torch's thread count in force: auto's choice (logged with what it
    measured and the CPU), or the dtype named where it is exact here, else ConfigError (naming
    the counts ``also_tried`` below this one)."""
    threads = torch.get_num_threads()
    if name == "auto":
        choice = choose_auto(device, also_tried)
        where = cpu_kind().describe() if device == "cpu" else device
        log.info("dtype auto: %s on %s at %d threads (%s)", choice.dtype, device, threads,
                 choice.reason())
        log.info("this CPU: %s", where)
        return choice.dtype
    if not exact_here(name, device):
        kind = cpu_kind() if device == "cpu" else None
        emulated = (f" (bfloat16 is emulated here: {kind.describe()})"
                    if kind and name == "bfloat16" and not kind.bf16_native else "")
        other = "--dtype auto" if name == "float32" else "--dtype auto or float32"
        raise ConfigError(
            f"dtype {name} is not batch-invariant on this {device} at {threads} threads"
            f"{_threads_note(device, also_tried)} (its probe failed){emulated}, so speculative "
            f"decoding in it would not be lossless; use {other}")
    return name
