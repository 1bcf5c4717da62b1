"""What the draft cache spends on one drafter's chunk: ``check_and_push`` (the checks, the
session's owner, the push script) against the embedded Redis, in this process, timed by the
calling thread's CPU clock and the wall. A board's chunk costs this in the cache's reader
thread, on the verifier's host, beside gRPC's own work.

    python scripts/chunk_push_cost.py --chunks 4000 --repeats 5 --json chunk-push.json

Each repeat: one session assigned to a device; chunks of ``--tokens`` draft tokens pushed one
after another, a commit (one token accepted, one fixed: the draft dropped, the epoch moved) after
every ``--per-commit`` chunks so that the window never fills; only the pushes are timed. Prints
each repeat's microseconds a chunk and the median; the JSON holds them all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cache_service.chunk_checks import check_and_push  # noqa: E402
from cache_service.redis_conn import RedisHandle  # noqa: E402
from cache_service.store import RedisSessionStore  # noqa: E402
from edgespec.config import SamplingParams  # noqa: E402
from edgespec.protocol.contract import Verdict  # noqa: E402
from edgespec.v1 import edgespec_pb2 as pb  # noqa: E402

DEVICE = "board-1"
VOCAB = 49152
WINDOW = 32


def one_repeat(store: RedisSessionStore, sid: str, chunks: int, tokens: int,
               per_commit: int) -> dict:
    store.create(sid, list(range(100, 300)), SamplingParams(), DEVICE)
    epoch, end, start = 0, 200, 200
    cpu = wall = 0.0
    for i in range(chunks):
        chunk = pb.DraftChunk(session_id=sid, epoch=epoch, start=start,
                              tokens=[(7 * (start + j)) % VOCAB for j in range(tokens)])
        c0, w0 = time.thread_time(), time.perf_counter()
        ack, _ = check_and_push(store, DEVICE, chunk, VOCAB, WINDOW, per_device=False)
        cpu += time.thread_time() - c0
        wall += time.perf_counter() - w0
        assert ack.kept == tokens, ack
        start += tokens
        if (i + 1) % per_commit == 0:  # the first draft token accepted, then a fix
            fix_token = (7 * (end + 1) + 1) % VOCAB  # not the draft's second token
            [out] = store.commit_many([Verdict(sid, epoch, end, 1, fix_token)])
            assert out.ok and out.fix is not None, out
            epoch, end = out.fix.epoch, end + 2
            start = end
    store.close(sid)
    return {"chunks": chunks, "cpu_us_a_chunk": 1e6 * cpu / chunks,
            "wall_us_a_chunk": 1e6 * wall / chunks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=4000)
    ap.add_argument("--tokens", type=int, default=2, help="draft tokens a chunk (a board's 2)")
    ap.add_argument("--per-commit", type=int, default=4, help="chunks between two commits")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write every repeat here")
    args = ap.parse_args()
    handle = RedisHandle()
    store = RedisSessionStore(handle.client, prefix="bench:", ttl_s=60)
    try:
        store.devices.register(DEVICE, {"max_sessions": 4})
        runs = [one_repeat(store, f"s{r}", args.chunks, args.tokens, args.per_commit)
                for r in range(args.repeats)]
    finally:
        store.shutdown()
        handle.close()
    for r in runs:
        print(f"{r['chunks']} chunks: {r['cpu_us_a_chunk']:.1f} us CPU, "
              f"{r['wall_us_a_chunk']:.1f} us wall a chunk")
    cpu = statistics.median(r["cpu_us_a_chunk"] for r in runs)
    wall = statistics.median(r["wall_us_a_chunk"] for r in runs)
    print(f"median: {cpu:.1f} us CPU, {wall:.1f} us wall a chunk (the calling thread; Redis's "
          f"own work is in its process)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs,
                                               "median_cpu_us": cpu,
                                               "median_wall_us": wall}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
