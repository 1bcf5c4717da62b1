"""A default thread count lowered to one at which the dtype to serve is batch-invariant.

A process that runs a model uses all cores but one unless told (``threads.default_threads``).
On some CPUs a BLAS splits its products by the thread count in a way that gives a row other
bits in another batch: MKL's AVX2 path (a laptop's CPU) did for float32 from 4 threads on, and
agreed at 1-3. There the default would refuse to start. ``resolve_stepping_down`` resolves the
dtype at the count in force and, where that is refused and the count is a default nothing has
settled yet (``threads.threads_adjustable``), tries fewer threads: halving until a count passes,
then the counts between it and the last that failed, highest first by bisection, so that a
default of 4 that fails where 3 passes serves at 3, not 2. Every count served is proven by its
own probes (the bisection's assumption that fewer threads pass more only decides which counts
are tried). The count found is kept and settled (``threads.settle_threads``): a runner built at
it is never moved to another by a later resolve in the process. A count the user gave is
refused, never changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from ..config import ConfigError
from .threads import fewer_threads, set_threads, settle_threads, threads_adjustable

log = logging.getLogger("edgespec.dtype")

# resolves the dtype at torch's thread count in force, or raises ConfigError; given the counts
# already tried below it (named in its refusal)
Resolve = Callable[[Sequence[int]], str]


def resolve_stepping_down(resolve: Resolve, what: str) -> str:
    """``resolve(())`` at the count in force; where it raises ConfigError on an adjustable
    count above 1, the highest lower count at which it resolves (``resolved_below``), kept,
    with a warning naming ``what`` was asked for and both counts; else ``resolve`` at the first
    count again, told the counts tried, raises. The count in force at the end is settled."""
    first = torch.get_num_threads()
    try:
        found = resolve(())
    except ConfigError:
        if not threads_adjustable() or first == 1:
            raise
    else:
        settle_threads()
        return found
    tried: list[int] = []
    try:
        lower = resolved_below(resolve, first, tried)
    except BaseException:  # an interrupt or a broken probe: the count as it was
        set_threads(first, by_user=False)
        raise
    if lower is None:
        set_threads(first, by_user=False)
        found = resolve(sorted(tried, reverse=True))  # raises: refused at every count tried
        settle_threads()
        return found
    count, found = lower
    log.warning("%s batch-invariant here at %d threads (a default count), %s is at %d: serving "
                "at %d threads (give --threads to choose the count; one at which the dtype is "
                "not exact is refused)", what, first, found, count, count)
    settle_threads()
    return found


def resolved_below(resolve: Resolve, first: int, tried: list[int]) -> tuple[int, str] | None:
    """(the highest count below ``first`` found to resolve, its dtype), torch left at it; or
    None, torch left at 1. Halves until a count resolves, then bisects between it and the last
    count that failed. ``tried``: each count tried, appended."""
    failed = first
    for n in fewer_threads(first):
        found = _attempt(resolve, n, tried)
        if found is None:
            failed = n
            continue
        passed = n
        while failed - passed > 1:
            mid = (passed + failed) // 2
            got = _attempt(resolve, mid, tried)
            if got is None:
                failed = mid
            else:
                passed, found = mid, got
        set_threads(passed, by_user=False)
        return passed, found
    return None


def _attempt(resolve: Resolve, n: int, tried: list[int]) -> str | None:
    set_threads(n, by_user=False)
    tried.append(n)
    try:
        return resolve(())
    except ConfigError:
        return None
