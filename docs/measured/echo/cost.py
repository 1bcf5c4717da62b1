"""The cost of a prompt's logprobs (the completions' ``echo`` with ``logprobs``): a request of
one new token with ``Request.prompt_logprobs`` (its prompt scored as it is prefilled, in parts
of 128 tokens; alone at admission when first measured) against the same request without (the
prefill queue's chunks), on the default model in float32, torch on 2 threads (set here),
prompts cut from Spec-Bench's questions file. Four rounds alternating, the first dropped,
medians. Prints a table and writes ``cost.json`` beside this file.

    python docs/measured/echo/cost.py
"""

import json
import statistics
import time
from pathlib import Path

import torch

from edgespec.config import DEFAULT_MODEL_NAME, EngineConfig
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.models.files import default_model_dir
from edgespec.models.loading import load_model
from edgespec.runner.target_runner import TargetRunner

ROOT = Path(__file__).resolve().parents[3]
LENGTHS = (128, 512, 1000)


def main() -> None:
    torch.set_num_threads(2)
    m = load_model(str(default_model_dir()), dtype="float32")
    runner = TargetRunner(m.model, n_slots=2, max_len=1100)
    text = (ROOT / "edgespec_cli" / "bench" / "spec_bench_questions.jsonl").read_text()
    ids = m.tokenizer.encode(text[:20000])
    out = {}
    print("prompt tokens | plain ms | scored ms | scored / plain")
    for n in LENGTHS:
        times: dict[str, list[float]] = {"plain": [], "scored": []}
        with SpecEngine(runner, None, EngineConfig(max_context=1100), stop_ids=set()) as e:
            for _ in range(4):
                for kind in ("plain", "scored"):
                    t0 = time.perf_counter()
                    e.generate(Request(ids[:n], 1,
                                       prompt_logprobs=1 if kind == "scored" else None))
                    times[kind].append(time.perf_counter() - t0)
        plain, scored = (statistics.median(times[k][1:]) for k in ("plain", "scored"))
        out[n] = {"plain_s": plain, "scored_s": scored, "ratio": scored / plain}
        print(f"{n} | {plain * 1e3:.0f} | {scored * 1e3:.0f} | {scored / plain:.2f}")
    (Path(__file__).parent / "cost.json").write_text(json.dumps(
        {"model": DEFAULT_MODEL_NAME, "dtype": "float32", "threads": 2, "prompts": out},
        indent=1))


if __name__ == "__main__":
    main()
