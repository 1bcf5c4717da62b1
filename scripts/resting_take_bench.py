"""A step's take from the Redis store when it asks every session for nothing (a server serving
alone, or a planner that finds its boards' drafts do not pay): the verifier's seconds a take,
for sessions created with a board and without one, against an embedded Redis (or
``EDGESPEC_REDIS_URL``). The sessions asked nothing are answered from what this process's own
commits left (``RedisSessionStore.take_when_ready``); a take that asks each session for 2
tokens, which reads Redis in one script, is timed beside it as the baseline. Then the step's
commit of a verdict for each session (no draft: a server serving alone), the verifier's
seconds a commit and Redis's own (its ``INFO commandstats`` for the script, a verdict). The
median of ``--repeats`` passes of ``--loops`` takes or commits. No torch. Prints a table and
writes JSON.

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
from edgespec.protocol.contract import DraftWant, Verdict  # noqa: E402


def median_us(fn, loops: int, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        runs.append((time.perf_counter() - t0) / loops)
    return 1e6 * statistics.median(runs)


def commit_us(store: RedisSessionStore, sids: list[str], loops: int, repeats: int
              ) -> tuple[float, float]:
    """A step's commit of one verdict a session (nothing drafted, each a fix): the median
    microseconds a commit, and Redis's own a verdict (the commit script's time, as its
    ``INFO commandstats`` counts it, over every commit timed)."""
    store.finish_recording()  # the fleet table's scripts of sessions closed before: done
    at = {sid: store.take_when_ready([DraftWant(sid, 0, wait=False)], 0.0)[0] for sid in sids}
    ends = {sid: (t.epoch, t.start) for sid, t in at.items()}

    def commit() -> None:
        verdicts = [Verdict(sid, *ends[sid], 0, 7, wanted=0) for sid in sids]
        for v, out in zip(verdicts, store.commit_many(verdicts)):
            if not out.ok or out.fix is None:
                raise RuntimeError(f"a commit of session {v.session_id} was not a fix: {out}")
            ends[v.session_id] = (out.fix.epoch, v.end)

    def script_usec() -> tuple[int, int]:
        stats = store.redis.info("commandstats").get("cmdstat_evalsha", {})
        return stats.get("usec", 0), stats.get("calls", 0)

    commit()
    usec, calls = script_usec()
    us = median_us(commit, loops, repeats)
    usec, calls = (a - b for a, b in zip(script_usec(), (usec, calls)))
    return us, usec / max(1, calls * len(sids))


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
              f"{'ratio':>7} {'commit, us':>11} {'in Redis, us a verdict':>23}")
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
                commit, in_redis = commit_us(store, sids, args.loops, args.repeats)
                rows.append({"sessions": n, "board": board is not None,
                             "asked_nothing_us": rest, "asked_2_us": ask, "commit_us": commit,
                             "commit_in_redis_us_per_verdict": in_redis})
                print(f"{n:>8} {'yes' if board else 'no':>6} {rest:>18.1f} {ask:>12.1f} "
                      f"{ask / rest:>6.1f}x {commit:>11.1f} {in_redis:>23.2f}")
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
