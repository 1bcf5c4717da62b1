"""What asking for logprobs costs a generation on this machine: the default model, in process
(``LocalGenerator``), one torch thread, greedy, the same prompts with ``logprobs`` None, 0, 5
and 20, in rounds (each round every setting once, the order reversed every other round).
Prints a table of tokens a second (medians over rounds) and writes the figures as JSON.

    python cost.py [--drafter mag] [--rounds 3] [--json cost.json]
"""

import argparse
import json
import statistics
import time

from edgespec.config import SamplingParams
from edgespec.engine.local import LocalGenerator
from edgespec.runner.threads import set_threads

PROMPTS = ["Write a short story about a lighthouse keeper.",
           "Explain how a refrigerator works, step by step.",
           "List ten fruits, one per line."]
SETTINGS = [None, 0, 5, 20]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default="mag")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--json", default="cost.json")
    args = ap.parse_args()
    set_threads(1)  # one torch thread: the machine's other core runs nothing heavy
    gen = LocalGenerator("default", args.drafter, dtype="auto")
    ids = {}
    for p in PROMPTS:  # warm up once each
        ids[p] = gen.generate(p, args.max_new_tokens, SamplingParams()).token_ids
    rates: dict[str, list[float]] = {str(s): [] for s in SETTINGS}
    for r in range(args.rounds):
        for s in (SETTINGS if r % 2 == 0 else SETTINGS[::-1]):
            tokens, t0 = 0, time.perf_counter()
            for p in PROMPTS:
                out = gen.generate(p, args.max_new_tokens, SamplingParams(), logprobs=s)
                assert out.token_ids == ids[p]  # the same output whatever was asked
                tokens += len(out.token_ids)
            rates[str(s)].append(tokens / (time.perf_counter() - t0))
    gen.close()
    base = statistics.median(rates["None"])
    rows = [{"logprobs": s, "tok_s": statistics.median(v), "vs_none": statistics.median(v) / base,
             "rounds": v} for s, v in rates.items()]
    print(f"{'logprobs':>8} {'tok/s':>8} {'vs none':>8}   (drafter {args.drafter}, "
          f"{len(PROMPTS)} prompts x {args.max_new_tokens} tokens, medians of "
          f"{args.rounds} rounds, 1 torch thread, dtype {gen.dtype})")
    for row in rows:
        print(f"{row['logprobs']:>8} {row['tok_s']:>8.1f} {row['vs_none']:>8.3f}")
    with open(args.json, "w") as f:
        json.dump({"drafter": args.drafter, "dtype": gen.dtype, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
