"""What a llama.cpp draft session's context window costs and saves: for each Spec-Bench prompt
of the default subset, the target's own greedy output (target-only, the default model), then,
for each window, the time the default model's GGUF takes to open the prompt and the tokens each
verification step would commit (chains of --k drafted from the committed output, the longest
agreeing prefix accepted plus the target's token, as the verifier does).

    python scripts/llamacpp_window_sweep.py --windows 0,512,256,128,64 --json sweep.json

One thread for torch and llama.cpp (set here), pinned to nothing: run it on a quiet machine, or
under ``taskset``. Needs the llamacpp extra.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.runner.threads import set_threads  # noqa: E402

set_threads(1)

from edgespec.config import SamplingParams  # noqa: E402
from edgespec.drafters.draft_lead import apply_fix  # noqa: E402
from edgespec.drafters.llamacpp import LlamaCppDrafter  # noqa: E402
from edgespec.engine.local import LocalGenerator  # noqa: E402
from edgespec_cli.bench.edge_vs_server import _encode  # noqa: E402
from edgespec_cli.bench.report import CATEGORIES  # noqa: E402
from edgespec_cli.bench.run import load_questions  # noqa: E402


def target_outputs(max_new_tokens: int) -> list[dict]:
    """Each prompt's ids and the target's greedy output ids."""
    questions = load_questions(CATEGORIES, 1, False)
    prompts = _encode("default", [q["prompt"] for q in questions])
    gen = LocalGenerator(drafter="none")
    try:
        return [{"category": q["category"], "prompt_ids": p,
                 "output_ids": gen.generate(list(p), max_new_tokens).token_ids}
                for q, p in zip(questions, prompts)]
    finally:
        gen.close()


def replay(drafter: LlamaCppDrafter, prompt: list[int], output: list[int], k: int) -> dict:
    """Open ``prompt``, then draft and commit along ``output`` as the verifier would."""
    t0 = time.perf_counter()
    session = drafter.open(list(prompt), SamplingParams())
    open_s = time.perf_counter() - t0
    pos = steps = accepted = drafted = 0
    while pos < len(output):
        draft = session.propose(k).tokens
        n = 0
        while n < len(draft) and pos + n < len(output) and draft[n] == output[pos + n]:
            n += 1
        end = min(len(output), pos + n + 1)
        apply_fix(session, len(prompt) + pos + n, output[pos + n:end])
        drafted, accepted, steps, pos = drafted + len(draft), accepted + n, steps + 1, end
    session.close()
    return {"open_s": open_s, "steps": steps, "tokens_per_step": len(output) / steps,
            "drafted": drafted, "accepted": accepted}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", default="0,256,128,64",
                    help="context windows to try, 0: the whole prompt (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=128,
                    help="the target's output per prompt (default: %(default)s)")
    ap.add_argument("--k", type=int, default=4, help="tokens a draft (default: %(default)s)")
    ap.add_argument("--json", default="bench-results/llamacpp-window-sweep.json",
                    help="where to write the results (default: %(default)s)")
    args = ap.parse_args()
    outputs = target_outputs(args.max_new_tokens)
    rows = []
    print(f"{'window':>6} {'category':15} {'prompt':>6} {'open ms':>8} {'tok/step':>8} "
          f"{'accepted':>9}")
    for window in (int(w) for w in args.windows.split(",")):
        drafter = LlamaCppDrafter("default", n_slots=1, context_window=window)
        try:
            for o in outputs:
                r = replay(drafter, o["prompt_ids"], o["output_ids"], args.k)
                rows.append({"window": window, "category": o["category"],
                             "prompt_tokens": len(o["prompt_ids"]), **r})
                print(f"{window:6d} {o['category']:15} {len(o['prompt_ids']):6d} "
                      f"{1e3 * r['open_s']:8.0f} {r['tokens_per_step']:8.2f} "
                      f"{r['accepted']:4d}/{r['drafted']:<4d}", flush=True)
        finally:
            drafter.close()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"k": args.k, "threads": 1, "rows": rows}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
