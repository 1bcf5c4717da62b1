"""The garbage collector's youngest-generation threshold, CPython's 700 against
``process_heap.YOUNG_THRESHOLD`` (what a server sets at start), in one process, runs
alternating: bench-host's own ``measure`` (64 sessions, MaG, the in-process store, the target
answering at once; the heap frozen as a server's). Torch on one thread. Prints each side's
median host microseconds a session-step and writes every run's figures as JSON.

    python docs/measured/fleet-host/gc-young/young_threshold_ab.py [ROUNDS] [OUT.json]
"""

import gc
import json
import statistics
import sys

import edgespec.runner.process_heap as heap
from edgespec.runner.threads import set_threads
from edgespec_cli.bench.host_cost import measure


def main() -> None:
    set_threads(1)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    out = sys.argv[2] if len(sys.argv) > 2 else "young-threshold-ab.json"
    young = heap.YOUNG_THRESHOLD
    runs: dict[str, list[float]] = {"700": [], str(young): []}
    for r in range(rounds):
        for side in (("700", str(young)) if r % 2 == 0 else (str(young), "700")):
            heap.YOUNG_THRESHOLD = int(side)  # measure's freeze_startup_heap sets it
            gc.set_threshold(700, *gc.get_threshold()[1:])
            runs[side].append(measure("local", "mag", 64, 64, 0.9)["host_us_per_session_step"])
    heap.YOUNG_THRESHOLD = young
    for side, got in runs.items():
        print(f"young threshold {side}: median {statistics.median(got):.2f} us a session-step; "
              f"runs {[round(x, 2) for x in got]}")
    with open(out, "w") as f:
        json.dump({"sessions": 64, "drafter": "mag", "threads": 1, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
