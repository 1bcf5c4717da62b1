"""Compare lm-evaluation-harness's per-sample outputs of two runs (``--log_samples``): the
multiple-choice task's loglikelihoods (the largest difference, whether each is the same string,
whether the greedy flags agree) and the generation task's answers. Prints a table and writes
``compare.json`` beside this script.

    python docs/measured/echo/lm-eval/compare.py RUN_A RUN_B [RUN_C ...]

Each RUN is an ``--output_path`` folder; the first is the reference.
"""

from __future__ import annotations

import glob
import json
import sys
from pathlib import Path

TASKS = ("edgespec_mc", "edgespec_gen")


def samples(run: str, task: str) -> list[dict]:
    [path] = glob.glob(f"{run}/*/samples_{task}_*.jsonl")
    with open(path) as f:
        return sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])


def compare(reference: str, other: str) -> dict:
    mc_a, mc_b = samples(reference, TASKS[0]), samples(other, TASKS[0])
    worst, same_bits, same_greedy = 0.0, True, True
    for a, b in zip(mc_a, mc_b, strict=True):
        for (la, ga), (lb, gb) in zip(a["filtered_resps"], b["filtered_resps"], strict=True):
            worst = max(worst, abs(float(la) - float(lb)))
            same_bits &= la == lb
            same_greedy &= ga == gb
    gen_a, gen_b = samples(reference, TASKS[1]), samples(other, TASKS[1])
    answers = sum(a["filtered_resps"] == b["filtered_resps"] for a, b in zip(gen_a, gen_b))
    return {"run": other, "choices": sum(len(s["filtered_resps"]) for s in mc_a),
            "max_loglikelihood_diff": worst, "loglikelihoods_identical": same_bits,
            "greedy_flags_identical": same_greedy, "answers_identical": answers,
            "answers": len(gen_a)}


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    rows = [compare(sys.argv[1], run) for run in sys.argv[2:]]
    print(f"reference: {sys.argv[1]}")
    print(f"{'run':<40}{'choices':>8}{'max |diff|':>12}{'identical':>11}{'greedy':>8}"
          f"{'answers':>10}")
    for r in rows:
        print(f"{r['run']:<40}{r['choices']:>8}{r['max_loglikelihood_diff']:>12.2e}"
              f"{str(r['loglikelihoods_identical']):>11}{str(r['greedy_flags_identical']):>8}"
              f"{r['answers_identical']:>6}/{r['answers']}")
    out = Path(__file__).with_name("compare.json")
    out.write_text(json.dumps({"reference": sys.argv[1], "runs": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
