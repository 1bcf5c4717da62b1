"""Bounds on oneDNN's two caches of built kernels, for a process that serves a model on a CPU.

oneDNN, which runs the runner's products on a CPU, builds a kernel (a "primitive") for each
problem shape it meets and keeps it in two caches: its own primitive cache and PyTorch's ideep
cache, 1,024 entries each by default. A server's shapes follow its traffic (every step width and
prompt length is one), so with varied prompts the process grows until both are full. Measured
on a 2-core AMD EPYC (torch 2.13, float32, SmolLM2-135M, 4 KV slots, batches of 1-4 prompts of
5-300 tokens): 2,040 -> 2,231 MB over 60 batches and still growing by default, 2,022 -> 2,032
MB with 64 entries each, and no slower (349 s against 373 s for the same 3,741 tokens); either
bound alone still grew. docs/serving.md ("Memory on a CPU") has the figures.

Both caches read their capacity from the environment once, at their first use, so the bound
is set before the process runs its first product: ``edgespec``'s commands set it at start and
the Ray verifier and drafter actors before they load a model. A value already in the environment is
the user's and is kept (``LRU_CACHE_CAPACITY=1024 ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024`` is
oneDNN's own default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CACHE_ENTRIES = 64  # each cache's bound unless the environment says otherwise
# ideep's cache (PyTorch's packed-weight products) and oneDNN's primitive cache
CAPACITY_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
# oneDNN's older spelling of the second, which it reads where the first is unset: the user's too
LEGACY_PRIMITIVE_VARIABLE = "DNNL_PRIMITIVE_CACHE_CAPACITY"


@dataclass(frozen=True)
class KernelCacheBounds:
    """The capacity each cache reads at its first use, as the environment spells it (None:
    unset, oneDNN's default of 1,024)."""

    ideep: str | None
    primitives: str | None

    def describe(self) -> str:
        return (f"oneDNN kernel caches: {self.ideep or '1024 (default)'} entries (ideep, "
                f"{CAPACITY_VARIABLES[0]}), {self.primitives or '1024 (default)'} (primitives, "
                f"{CAPACITY_VARIABLES[1]})")


def bound_kernel_caches(entries: int = CACHE_ENTRIES) -> KernelCacheBounds:
    """Set each cache's capacity to ``entries`` where the environment does not already hold
    one; returns the capacities now in the environment. Takes effect only in a process that has
    not run a oneDNN product yet (the caches read it once)."""
    os.environ.setdefault(CAPACITY_VARIABLES[0], str(entries))
    if LEGACY_PRIMITIVE_VARIABLE not in os.environ:
        os.environ.setdefault(CAPACITY_VARIABLES[1], str(entries))
    return kernel_caches_in_effect()


def kernel_caches_in_effect() -> KernelCacheBounds:
    """The capacities the environment holds (what the caches read, if it held them before the
    process's first product)."""
    return KernelCacheBounds(ideep=os.environ.get(CAPACITY_VARIABLES[0]),
                             primitives=os.environ.get(CAPACITY_VARIABLES[1],
                                                       os.environ.get(LEGACY_PRIMITIVE_VARIABLE)))
