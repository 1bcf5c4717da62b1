"""A step's take from the Redis store when it asks every session for nothing (a server serving
alone, or a planner that finds its boards' drafts do not pay): the verifier's seconds a take,
for sessions created with a board and without one, against an embedded Redis (or
``EDGESPEC_REDIS_URL``). The sessions asked nothing are answered from what this process's own
commits left (``RedisSessionStore.take_when_ready``); a take that asks each session for 2
tokens, which reads Redis in one script, is timed beside it as the baseline. The median of
``--repeats`` passes of ``--loops`` takes. No torch. Prints a table and writes JSON.

    python scripts/resting_take_bench.py --json bench-results/resting-take.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cache_service.redis_conn import RedisHandle  # noqa: E402
from cache_service.store import RedisSessionStore  # noqa: E402
from edgespec.config import SamplingParams  # noqa: E402
from edgespec.protocol.contract import DraftWant  # noqa: E402


def median_us(fn, loops: int, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        runs.append((time.perf_counter() - t0) / loops)
    return 1e6 * statistics.median(runs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", default="8,64", help="session counts (default: %(default)s)")
    p.add_argument("--loops", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="bench-results/resting-take.json")
    args = p.parse_args()
    handle = RedisHandle()
    rows = []
    try:
        store = RedisSessionStore(handle.client, prefix="rt:", ttl_s=120)
        print(f"{'sessions':>8} {'board':>6} {'asked nothing, us':>18} {'asked 2, us':>12} "
              f"{'ratio':>7}")
        for n in [int(x) for x in args.sessions.split(",")]:
            for board in ("dev-a", None):
                sids = [f"{board or 'none'}-{n}-{i}" for i in range(n)]
                for sid in sids:
                    store.create(sid, [1, 2, 3], SamplingParams(), board)
                resting = [DraftWant(sid, 0, wait=False) for sid in sids]
                asking = [DraftWant(sid, 2, wait=False) for sid in sids]
                rest = median_us(lambda: store.take_when_ready(resting, 0.0), args.loops,
                                 args.repeats)
                ask = median_us(lambda: store.take_when_ready(asking, 0.0), args.loops,
                                args.repeats)
                rows.append({"sessions": n, "board": board is not None,
                             "asked_nothing_us": rest, "asked_2_us": ask})
                print(f"{n:>8} {'yes' if board else 'no':>6} {rest:>18.1f} {ask:>12.1f} "
                      f"{ask / rest:>6.1f}x")
                for sid in sids:
                    store.close(sid)
        store.shutdown()
    finally:
        handle.close()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"loops": args.loops, "repeats": args.repeats, "results": rows},
                              indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
