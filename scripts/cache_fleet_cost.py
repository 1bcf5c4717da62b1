"""What the draft cache's process spends a session-step as the fleet grows: N boards (MaG drafter
agents, ``--sessions-per-board`` sessions each, all in one process of their own) attached over
real gRPC to the cache (``edgespec cache``, a process of its own), and this process playing the
verifier's two store
calls a step (take, commit) against the same Redis, a step every ``--step-ms``. For each fleet
size it prints the CPU microseconds a session-step of the cache's process, of its Redis, of the
boards' process and of the driver's store calls, and the cache's messages: what a verifier's host
pays for each board beside its forwards.

    python scripts/cache_fleet_cost.py --boards 8,32,64 --steps 150 --json cache-fleet.json
    python scripts/cache_fleet_cost.py --boards 8 --sessions-per-board 8 --json eight-each.json

Each session's step takes its draft (up to 4 tokens), accepts all of it half the time and a
random part of it otherwise, and commits a token of its own: mostly fixes, as with MaG's drafts
on chat answers. The boards draft with MaG, as a board whose drafting costs nothing; the cache
and Redis do what they do for any drafter. Torch is not used.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 49152
WANT = 4  # draft tokens a step asks of each session


def serve_boards(n: int, cache: str) -> None:
    """The boards' process: n MaG agents attached to ``cache`` until stdin closes."""
    import threading

    from drafter_node.agent import DrafterAgent
    from edgespec.drafters import build_drafter

    agents = [DrafterAgent(cache, f"b{i}", build_drafter("mag"), fingerprint="", window=8)
              for i in range(n)]
    for a in agents:
        threading.Thread(target=a.run, daemon=True).start()
    for a in agents:
        a.connected.wait(60)
    print("attached", flush=True)
    sys.stdin.read()
    for a in agents:
        a.stop()


def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _redis_pid(handle) -> int:
    import psutil

    for p in psutil.Process().children(recursive=True):
        if "redis" in p.name():
            return p.pid
    raise RuntimeError("no redis-server child of this process (the embedded Redis)")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(n: int, steps: int, warmup: int, step_ms: float, seed: int,
            per_board: int = 1) -> dict:
    from cache_service.redis_conn import RedisHandle
    from cache_service.store import RedisSessionStore
    from edgespec.config import SamplingParams
    from edgespec.protocol.contract import DraftWant, Verdict

    rng = random.Random(seed)
    handle = RedisHandle()
    store = RedisSessionStore(handle.client, ttl_s=600)
    store.set_target({"model": "bench", "fingerprint": "", "vocab_size": VOCAB, "window": 8,
                      "chunk": 8})
    address = f"127.0.0.1:{_free_port()}"
    cache = subprocess.Popen([str(Path(sys.executable).parent / "edgespec"), "cache", "--listen",
                              address, "--redis-url", handle.url, "--log-level", "WARNING",
                              "--max-drafters", str(max(64, n)), "--fleet-table", "0"])
    boards = None
    try:
        deadline = time.monotonic() + 120  # the agents retry until the cache listens
        boards = subprocess.Popen([sys.executable, __file__, "--serve-boards", str(n),
                                   "--cache", address], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert boards.stdout is not None
        while boards.stdout.readline().strip() != "attached":
            if time.monotonic() > deadline or boards.poll() is not None:
                raise RuntimeError("the boards did not attach")
        sids = [f"s{i}" for i in range(n * per_board)]
        for i, sid in enumerate(sids):
            prompt = [rng.randrange(100, VOCAB) for _ in range(64)]
            store.create(sid, prompt, SamplingParams(), f"b{i % n}")
        redis_pid = _redis_pid(handle)
        counted = {"session_steps": 0, "draft_tokens": 0}

        def step() -> None:
            wants = [DraftWant(sid, WANT) for sid in sids]
            taken = store.take_when_ready(wants, step_ms / 1000)
            verdicts = []
            for sid, t in zip(sids, taken):
                k = len(t.tokens)
                acc = k if rng.random() < 0.5 else rng.randint(0, k)
                verdicts.append(Verdict(sid, t.epoch, t.start, acc, rng.randrange(100, VOCAB),
                                        wanted=WANT))
                counted["draft_tokens"] += k
            for out in store.commit_many(verdicts):
                if out.error is not None:
                    raise RuntimeError(out.error)
            counted["session_steps"] += len(sids)

        for _ in range(warmup):
            step()
            time.sleep(step_ms / 1000)
        counted.update(session_steps=0, draft_tokens=0)
        before = (_cpu_s(cache.pid), _cpu_s(redis_pid), _cpu_s(boards.pid), time.process_time())
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
            time.sleep(step_ms / 1000)
        wall = time.perf_counter() - t0
        after = (_cpu_s(cache.pid), _cpu_s(redis_pid), _cpu_s(boards.pid), time.process_time())
        ss = counted["session_steps"]
        us = [1e6 * (b - a) / ss for a, b in zip(before, after)]
        return {"boards": n, "sessions_per_board": per_board, "steps": steps,
                "step_ms": step_ms, "wall_s": wall,
                "session_steps": ss, "draft_tokens_taken_per_session_step":
                    counted["draft_tokens"] / ss,
                "cache_cpu_us_per_session_step": us[0], "redis_cpu_us_per_session_step": us[1],
                "boards_cpu_us_per_session_step": us[2], "driver_cpu_us_per_session_step": us[3],
                "cache_cores": (after[0] - before[0]) / wall}
    finally:
        if boards is not None:
            boards.stdin.close()
            boards.wait(30)
        cache.terminate()
        cache.wait(30)
        store.shutdown()
        handle.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--boards", default="8,32,64", help="fleet sizes, a comma list")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--step-ms", type=float, default=20.0,
                   help="the verifier's step: how long each take may wait, and the pause "
                        "between steps (a forward's time)")
    p.add_argument("--sessions-per-board", type=int, default=1, metavar="S",
                   help="sessions each board drafts for (default: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--serve-boards", type=int, help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve_boards:
        serve_boards(a.serve_boards, a.cache)
        return 0
    rows = []
    print(f"{'boards':>6} {'sessions':>8} {'cache us':>9} {'redis us':>9} {'boards us':>9} "
          f"{'driver us':>9} {'cache cores':>11}  (CPU microseconds a session-step)")
    for n in [int(x) for x in a.boards.split(",")]:
        r = run_one(n, a.steps, a.warmup, a.step_ms, a.seed, a.sessions_per_board)
        rows.append(r)
        print(f"{n:>6} {n * a.sessions_per_board:>8} {r['cache_cpu_us_per_session_step']:>9.1f} "
              f"{r['redis_cpu_us_per_session_step']:>9.1f} "
              f"{r['boards_cpu_us_per_session_step']:>9.1f} "
              f"{r['driver_cpu_us_per_session_step']:>9.1f} {r['cache_cores']:>11.2f}",
              flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"config": vars(a), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
