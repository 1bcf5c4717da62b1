"""The garbage collector's policy in a process that serves a model.

A verification step builds a few short-lived objects per session (its row, its verdict, its
commit); they are freed by reference counting, but the allocations still trigger the cyclic
collector, whose older generations then walk every object the process holds: the model's
modules, torch, transformers, gRPC, Ray, several hundred thousand objects, none of which will
ever be garbage. ``freeze_startup_heap`` moves what is alive once a server has started (after
the model loaded) into the collector's permanent generation (``gc.freeze``), so that its passes
walk only what serving creates. Measured, ``edgespec bench-host``, 64 sessions, target-only,
this machine: the verifier's host work 35-49 us a session-step before, 21-25 after (five runs
each). A frozen object that later dies through a reference cycle is not collected while it is
frozen: a server thaws the heap when it stops (``thaw_heap``), so that a process that runs
several servers one after another (the tests, a benchmark) gets their memory back.

The youngest generation is collected once ``YOUNG_THRESHOLD`` allocations outnumber
deallocations, not CPython's 700: a 64-session step allocates a few thousand short-lived objects
that reference counting frees, and each pass over them found nothing to collect (``bench-host``,
64 sessions, MaG, six alternating runs each: 24.1 -> 23.2 us a session-step). A cycle made
while serving lives a little longer before it is collected; the older generations' thresholds
are CPython's.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000
_thresholds: tuple[int, ...] | None = None  # the collector's before the first freeze
_frozen = 0  # servers started (frozen) and not stopped (thawed) in this process


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object alive now out of the collector's passes, and
    raise the youngest generation's threshold to at least ``YOUNG_THRESHOLD`` (kept while any
    server of the process serves); returns how many objects are frozen."""
    global _thresholds, _frozen
    gc.collect()
    gc.freeze()
    if _frozen == 0:
        _thresholds = gc.get_threshold()
        gc.set_threshold(max(YOUNG_THRESHOLD, _thresholds[0]), *_thresholds[1:])
    _frozen += 1
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (a server stopping; as ``gc.freeze``,
    for the whole process), and its thresholds once the last server has stopped."""
    global _thresholds, _frozen
    gc.unfreeze()
    _frozen = max(0, _frozen - 1)
    if _frozen == 0 and _thresholds is not None:
        gc.set_threshold(*_thresholds)
        _thresholds = None
