"""``edgespec bench``: Spec-Bench first turns, greedy, every method measured in the same run.

Methods: edgespec's own runner with no drafter (target-only), transformers ``generate()``
(target-only), transformers prompt-lookup decoding, transformers assisted generation with the
layer-skip self-draft (``assistant_early_exit``), and edgespec with each drafter asked for.
Prints a table per category and writes JSON. Throughput is end to end (prefill included) for every
method; edgespec rows also carry decode-only figures.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from importlib import resources
from pathlib import Path

import torch

from edgespec.config import ConfigError, SamplingParams

CATEGORIES = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
SPEC_BENCH = {"translation", "summarization", "qa", "math_reasoning", "rag"}  # else mt_bench
BASELINES = ["target_only", "hf_generate", "hf_prompt_lookup", "hf_assisted"]


def add_bench_args(p) -> None:
    p.add_argument("--categories", nargs="+", default=CATEGORIES, choices=CATEGORIES,
                   metavar="CAT", help=f"categories to run (default: all of {' '.join(CATEGORIES)})")
    p.add_argument("--per-category", type=int, default=1,
                   help="prompts per category, the first N of each (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--full", action="store_true",
                   help="all 480 questions (overrides --categories and --per-category)")
    p.add_argument("--drafters", default="mag,layers:4",
                   help="comma-separated edgespec drafters to run (default: %(default)s)")
    p.add_argument("--assist-layers", type=int, default=4,
                   help="layers of the self-draft for transformers' assisted generation "
                        "(default: %(default)s)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each prompt and method; the fastest counts (shields figures "
                        "from a busy machine; drafters do not learn from repeats) "
                        "(default: %(default)s)")
    p.add_argument("--skip-hf", action="store_true",
                   help="skip the transformers baselines (faster; no speedup_vs_hf_* figures)")
    p.add_argument("--json", dest="json_out", default="bench-results/bench.json",
                   help="where to write the JSON results (default: %(default)s)")


def load_questions(categories: list[str], per_category: int, full: bool) -> list[dict]:
    text = resources.files("edgespec_cli.bench").joinpath("spec_bench_questions.jsonl").read_text()
    picked, seen = [], defaultdict(int)
    for line in text.splitlines():
        q = json.loads(line)
        cat = q["category"] if q["category"] in SPEC_BENCH else "mt_bench"
        if not full and (cat not in categories or seen[cat] >= per_category):
            continue
        seen[cat] += 1
        picked.append({"id": q["question_id"], "category": cat, "prompt": q["turns"][0]})
    return picked


class HFBaselines:
    """transformers' own generation paths on the same model object."""

    def __init__(self, model, stop_ids: set[int], assist_layers: int):
        self.model, self.assist_layers = model, assist_layers
        eos = sorted(stop_ids)
        self.common = dict(do_sample=False, eos_token_id=eos or None,
                           pad_token_id=eos[0] if eos else None)

    def run(self, method: str, ids: list[int], max_new: int) -> list[int]:
        extra = {}
        if method == "hf_prompt_lookup":
            extra = {"prompt_lookup_num_tokens": 10}
        elif method == "hf_assisted":
            extra = {"assistant_early_exit": self.assist_layers}
        from transformers import GenerationConfig

        inp = torch.tensor([ids], device=self.model.device)
        config = GenerationConfig(max_new_tokens=max_new, **self.common, **extra)
        with torch.inference_mode():
            out = self.model.generate(inp, attention_mask=torch.ones_like(inp),
                                      generation_config=config)
        return out[0, len(ids):].tolist()


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def run_bench(args) -> int:
    from edgespec.cli_args import check_drafter_arg, check_model_arg, engine_config, set_threads
    from edgespec.local import LocalGenerator

    questions = load_questions(args.categories, args.per_category, args.full)
    if not questions:
        raise ConfigError("no questions selected")
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    check_model_arg(args.model)
    for d in drafters:
        check_drafter_arg(d)
    threads = set_threads(args.threads)
    print(f"torch threads: {threads}", file=sys.stderr)
    gen = LocalGenerator(args.model, "none", args.device, args.dtype, engine_config(args, 2))
    hf = None if args.skip_hf else HFBaselines(gen.target.model, gen.stop_ids, args.assist_layers)
    methods = ["target_only"] + ([] if hf is None else BASELINES[1:]) + \
              [f"edgespec:{d}" for d in drafters]
    greedy = SamplingParams()

    def run_one(method: str, ids: list[int], max_new: int) -> dict:
        t0 = time.perf_counter()
        if method.startswith("hf_"):
            out = hf.run(method, ids, max_new)
            return {"token_ids": out, "seconds": time.perf_counter() - t0}
        drafter = "none" if method == "target_only" else method.split(":", 1)[1]
        g = gen.generate(ids, max_new, greedy, drafter=drafter)
        s = g.stats
        return {"token_ids": g.token_ids, "seconds": time.perf_counter() - t0,
                "decode_seconds": s.elapsed_s - s.prefill_s, "stats": s.to_dict()}

    _log(f"warming up {len(methods)} methods")
    warm_ids = gen.encode("Say hello.")
    for m in methods:
        run_one(m, warm_ids, 4)
    records = []
    total = len(questions) * len(methods)
    done = 0
    t_start = time.perf_counter()
    def run_best(method: str, ids: list[int]) -> dict:
        drafter = gen.engine(method.split(":", 1)[1]).drafter if ":" in method else None
        state = drafter.snapshot() if drafter else None
        best = None
        for i in range(max(1, args.repeat)):
            if drafter is not None and i > 0:
                drafter.restore(state)
            r = run_one(method, ids, args.max_new_tokens)
            if best is not None and r["token_ids"] != best["token_ids"]:
                r["identical_to_target_only"] = False
                return r
            best = r if best is None or r["seconds"] < best["seconds"] else best
        return best

    for q in questions:
        ids = gen.encode(q["prompt"])
        ref = None
        for m in methods:
            r = run_best(m, ids)
            done += 1
            if m == "target_only":
                ref = r["token_ids"]
            r.update(question_id=q["id"], category=q["category"], method=m,
                     prompt_tokens=len(ids), tokens=len(r["token_ids"]),
                     identical_to_target_only=r.get("identical_to_target_only", True)
                     and r["token_ids"] == ref)
            records.append(r)
            eta = (time.perf_counter() - t_start) / done * (total - done)
            _log(f"[{done}/{total}] {q['category']:<15} q{q['id']:<4} {m:<22} "
                 f"{_rate(r['tokens'], r['seconds']):6.1f} tok/s"
                 f"{'' if r['identical_to_target_only'] else '  (differs from target-only)'}"
                 f"  eta {eta:4.0f}s")
    report = summarize(records, methods, drafters)
    report["config"] = {"model": gen.target.name, "device": args.device, "dtype": args.dtype,
                        "max_new_tokens": args.max_new_tokens, "questions": len(questions),
                        "threads": torch.get_num_threads(), "drafters": drafters,
                        "max_draft": args.max_draft, "window": args.window,
                        "repeat": args.repeat}
    report["results"] = records
    print_tables(report, methods)
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    _log(f"wrote {out}")
    gen.close()
    return 0


def _aggregate(rows: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    agg = {"tokens": tokens, "seconds": round(seconds, 3),
           "tokens_per_s": round(_rate(tokens, seconds), 3),
           "identical_to_target_only": all(r["identical_to_target_only"] for r in rows)}
    if rows and "stats" in rows[0]:
        drafts = sum(r["stats"]["num_drafts"] for r in rows)
        drafted = sum(r["stats"]["drafted"] for r in rows)
        accepted = sum(r["stats"]["accepted"] for r in rows)
        steps = sum(r["stats"]["steps"] for r in rows)
        decode = sum(r["decode_seconds"] for r in rows)
        agg.update(mean_acceptance_length=round(1 + accepted / drafts, 3) if drafts else 1.0,
                   acceptance_rate=round(accepted / drafted, 3) if drafted else 0.0,
                   tokens_per_step=round(tokens / steps, 3) if steps else 0.0,
                   decode_tokens_per_s=round(_rate(tokens, decode), 3))
    return agg


def summarize(records: list[dict], methods: list[str], drafters: list[str]) -> dict:
    by = defaultdict(list)
    for r in records:
        by[(r["category"], r["method"])].append(r)
        by[("all", r["method"])].append(r)
    cats = sorted({r["category"] for r in records}, key=CATEGORIES.index) + ["all"]
    table = {c: {m: _aggregate(by[(c, m)]) for m in methods} for c in cats}
    for c in cats:
        for m in methods:
            row = table[c][m]
            for base in BASELINES:
                if base in table[c] and table[c][base]["tokens_per_s"]:
                    row[f"speedup_vs_{base}"] = round(
                        row["tokens_per_s"] / table[c][base]["tokens_per_s"], 3)
    edgespec = [m for m in methods if m.startswith("edgespec:")]
    main = "edgespec:mag" if "edgespec:mag" in methods else (edgespec[0] if edgespec else None)
    summary = {"method": main,
               "lossless": all(r["identical_to_target_only"] for r in records
                               if r["method"].startswith("edgespec:"))}
    if main:
        row = table["all"][main]
        for base in BASELINES:
            if f"speedup_vs_{base}" in row:
                summary[f"speedup_vs_{base}"] = row[f"speedup_vs_{base}"]
        summary["per_category_speedup_vs_target_only"] = {
            c: table[c][main].get("speedup_vs_target_only") for c in cats if c != "all"}
    return {"summary": summary, "categories": table}


def print_tables(report: dict, methods: list[str]) -> None:
    cols = [("tok/s", "tokens_per_s", "{:7.1f}"), ("x target", "speedup_vs_target_only", "{:8.2f}"),
            ("x hf gen", "speedup_vs_hf_generate", "{:8.2f}"),
            ("x hf pld", "speedup_vs_hf_prompt_lookup", "{:8.2f}"),
            ("MAL", "mean_acceptance_length", "{:5.2f}"), ("acc", "acceptance_rate", "{:5.2f}"),
            ("same", "identical_to_target_only", "{!s:>5}")]
    for cat, rows in report["categories"].items():
        print(f"\n== {cat} ==")
        print(f"{'method':<22}" + " ".join(f"{h:>{len(fmt.format(0))}}" for h, _, fmt in cols))
        for m in methods:
            row = rows[m]
            cells = []
            for _, key, fmt in cols:
                width = len(fmt.format(0))
                cells.append(fmt.format(row[key]) if key in row else "-".rjust(width))
            print(f"{m:<22}" + " ".join(cells))
    print("\nsummary:", json.dumps(report["summary"]))


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
