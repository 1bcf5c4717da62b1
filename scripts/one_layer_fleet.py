"""The fleet-scale issue's CPU setting: the engine with a real runner over a model whose forward is
nearly free, so that tokens a second show the engine's host work and the runner's own overheads.

A 1-layer, 64-wide Llama (4 query heads, 2 kv heads, a 512-token vocabulary, random weights,
float32), ``EngineConfig(max_sessions=n)``, ``generate_many`` of n prompts of 64 random tokens,
``--new-tokens`` each (default 64), torch on one thread (set here, and printed), each setting
warmed up by one run of its own and then run ``--repeats`` times (the median run's tokens a
second reported, every run's in the JSON). Drafters: ``none`` (target-only, the sessions
batched; always run, first) and in-process drafters such as ``mag`` (a drafter that learns
across sessions, as Cacheback, learns from the warm-up too). Every setting's outputs are
checked token for token against the target-only run of the same prompts (greedy); the exit
code is 1 if any differs. Prints a table and writes JSON.

    python scripts/one_layer_fleet.py --sessions 8,32,64 --drafters none,mag
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one_layer_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, initializer_range=0.3,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def measure(model, prompts: list[list[int]], drafter: str, new_tokens: int, repeats: int
            ) -> dict:
    """One setting: ``repeats`` timed runs after a warm-up; the outputs of the last run."""
    from edgespec.config import EngineConfig, SamplingParams
    from edgespec.drafters import build_drafter
    from edgespec.drafters.spec_check import check_drafter_arg
    from edgespec.engine.generation import Request
    from edgespec.engine.spec_engine import SpecEngine
    from edgespec.runner.target_runner import TargetRunner

    n = len(prompts)
    runner = TargetRunner(model, n_slots=n, max_len=512)
    base, _, option = drafter.partition("@")  # "@ahead": decode steps run ahead
    if option not in ("", "ahead"):
        raise SystemExit(f"unknown drafter option {option!r} (only @ahead)")
    built = None if base == "none" else build_drafter(check_drafter_arg(base), None, None)
    engine = SpecEngine(runner, built, EngineConfig(max_sessions=n,
                                                    decode_ahead=option == "ahead" or None),
                        set())
    try:
        def run():
            reqs = [Request(list(p), new_tokens, SamplingParams()) for p in prompts]
            t0 = time.perf_counter()
            results = engine.generate_many(reqs)
            return time.perf_counter() - t0, results

        run()
        rates, results = [], []
        for _ in range(repeats):
            wall, results = run()
            rates.append(sum(len(r.token_ids) for r in results) / wall)
    finally:
        engine.close()
    return {"sessions": n, "drafter": drafter, "tokens_per_s": statistics.median(rates),
            "tokens_per_s_runs": rates, "outputs": [r.token_ids for r in results],
            "steps_per_session": statistics.mean(r.stats.steps for r in results)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", default="8,32,64", help="session counts (default: %(default)s)")
    p.add_argument("--drafters", default="none,mag",
                   help="comma-separated: none and in-process drafters, each with @ahead for "
                        "decode steps launched a step ahead (off on a CPU by default: "
                        "``engine.decode_ahead``) (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="bench-results/one-layer-fleet.json")
    args = p.parse_args()
    from edgespec.runner.cpu_kind import cpu_kind
    from edgespec.runner.threads import set_threads

    set_threads(1)
    model = one_layer_model()
    rng = random.Random(0)
    rows = []
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    drafters = ["none"] + [d for d in drafters if d != "none"]  # the reference first, always
    if args.new_tokens > 448:
        p.error("--new-tokens is at most 448 (the runner's 512 positions, 64-token prompts)")
    for n in [int(x) for x in args.sessions.split(",")]:
        prompts = [[rng.randrange(512) for _ in range(64)] for _ in range(n)]
        reference = None
        for drafter in drafters:
            print(f"one-layer fleet: {n} sessions, drafter {drafter}", file=sys.stderr,
                  flush=True)
            r = measure(model, prompts, drafter, args.new_tokens, args.repeats)
            if reference is None and drafter == "none":
                reference = r["outputs"]
            r["identical_to_target_only"] = None if reference is None else \
                r["outputs"] == reference
            rows.append(r)
    print(f"machine: {cpu_kind().describe()}; torch on 1 thread; a 1-layer 64-wide Llama")
    print(f"{'sessions':>8} {'drafter':<8} {'tok/s':>8} {'steps/session':>13} {'identical':>9}")
    for r in rows:
        same = {None: "-", True: "yes", False: "NO"}[r["identical_to_target_only"]]
        print(f"{r['sessions']:>8} {r['drafter']:<8} {r['tokens_per_s']:>8.0f} "
              f"{r['steps_per_session']:>13.1f} {same:>9}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": {"new_tokens": args.new_tokens, "threads": 1,
                                          "repeats": args.repeats, "cpu": cpu_kind().as_json()},
                               "results": [{k: v for k, v in r.items() if k != "outputs"}
                                           for r in rows]}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if all(r["identical_to_target_only"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
