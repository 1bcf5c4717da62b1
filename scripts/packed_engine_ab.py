"""The engine with a ragged step's rows packed (now) against rows padded to the widest
(``TargetRunner.pack_rows`` False: before), the same runner, planner and drafter,
``generate_many`` of Spec-Bench prompts taken across the categories, the sides alternating round
by round (the first round of each untimed), every side's outputs checked equal to the other's
and to target-only decoding.

    python scripts/packed_engine_ab.py --sessions 4,8 --drafter mag --json packed-engine.json

torch runs on ``--threads`` threads (default 1: the server's core in the fleet runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

SIDES = ("padded", "packed")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", default="4,8", help="batch sizes, comma-separated")
    p.add_argument("--drafter", default="mag", help="the in-process drafter (default: mag)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, each side once a round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="write every run here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)  # deliberately: the fleet runs' server core
    from edgespec.config import EngineConfig, SamplingParams
    from edgespec.drafters import build_drafter
    from edgespec.drafters.spec_check import check_drafter_arg
    from edgespec.engine.generation import Request
    from edgespec.engine.spec_engine import SpecEngine
    from edgespec.models.loading import encode_prompt, load_model, stop_token_ids
    from edgespec.runner.target_runner import TargetRunner
    from edgespec_cli.bench.run import load_questions

    loaded = load_model("default", "cpu", "float32")
    stop = stop_token_ids(loaded)
    questions = load_questions([], 0, True)
    counts = [int(n) for n in args.sessions.split(",")]
    most = max(counts)
    picked = questions[::max(1, len(questions) // most)][:most]  # across the categories
    prompts = [encode_prompt(loaded.tokenizer, q["prompt"]) for q in picked]
    runner = TargetRunner(loaded.model, n_slots=most,
                          max_len=max(map(len, prompts)) + args.new_tokens + 64)
    runs, table = [], []
    for n in counts:
        reqs = prompts[:n]
        wanted = None
        engines = {}
        for side in SIDES:
            engines[side] = SpecEngine(runner, build_drafter(check_drafter_arg(args.drafter),
                                                             None, None),
                                       EngineConfig(max_sessions=n), stop)
        plain = SpecEngine(runner, None, EngineConfig(max_sessions=n), stop)
        wanted = [r.token_ids for r in plain.generate_many(
            [Request(list(q), args.new_tokens, SamplingParams()) for q in reqs])]
        plain.close()
        walls: dict[str, list[float]] = {s: [] for s in SIDES}
        for rnd in range(args.rounds + 1):
            for side in (SIDES if rnd % 2 == 0 else SIDES[::-1]):
                runner.pack_rows = side == "packed"
                t0 = time.perf_counter()
                res = engines[side].generate_many(
                    [Request(list(q), args.new_tokens, SamplingParams()) for q in reqs])
                wall = time.perf_counter() - t0
                assert [r.token_ids for r in res] == wanted, (side, n)  # lossless both ways
                if rnd:
                    walls[side].append(wall)
                    runs.append({"sessions": n, "side": side, "round": rnd, "s": wall,
                                 "tokens": sum(len(r.token_ids) for r in res)})
        for e in engines.values():
            e.close()
        tokens = sum(len(w) for w in wanted)
        med = {s: statistics.median(v) for s, v in walls.items()}
        table.append((n, tokens / med["padded"], tokens / med["packed"]))
    print(f"{args.drafter}, {args.new_tokens} new tokens a session, torch on {args.threads} "
          f"thread(s), the median of {args.rounds} rounds a side; outputs identical to "
          "target-only on both sides")
    print("sessions  padded tok/s  packed tok/s  ratio")
    for n, a, b in table:
        print(f"{n:8d}  {a:12.1f}  {b:12.1f}  {b / a:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"drafter": args.drafter, "threads": args.threads,
                       "new_tokens": args.new_tokens, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
