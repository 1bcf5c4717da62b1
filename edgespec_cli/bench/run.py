"""``edgespec bench``: Spec-Bench first turns, greedy (or keyed-sampled with --temperature),
every method measured in the same run.

Methods: edgespec's own runner with no drafter (target-only), transformers ``generate()``
(target-only), transformers prompt-lookup decoding, transformers assisted generation with the
layer-skip self-draft (``assistant_early_exit``), llama.cpp alone and its prompt lookup (when
``llama-cpp-python`` is installed; they decode the GGUF, a quantised model, so their outputs
differ), edgespec with each drafter asked for, the drafters asked for with token trees
(``SPEC@treeN``: chunks with up to N - 1 branches), and edgespec with loose verification (lossy,
marked so). Prints a table per category and writes JSON. Throughput is end to end (prefill
included) for every method; edgespec rows also carry decode-only figures. With a Cacheback
drafter, the fleet table's warm-up is measured too (``fleet_warm``).
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from importlib import resources
from pathlib import Path


from edgespec.config import ConfigError

from .drift import first_reference, task_score, token_match_rate
from .methods import BenchMethods, MethodPlan, plan_methods
from .report import CATEGORIES, print_tables, summarize

SPEC_BENCH = {"translation", "summarization", "qa", "math_reasoning", "rag"}  # else mt_bench
DEFAULT_DRAFTERS = "mag;cacheback;mag+cacheback;layers:4;cascade:layers:4,mag"


def add_question_args(p) -> None:
    """The Spec-Bench question selection every benchmark command takes."""
    p.add_argument("--categories", nargs="+", default=CATEGORIES, choices=CATEGORIES,
                   metavar="CAT",
                   help=f"categories to run (default: all of {' '.join(CATEGORIES)})")
    p.add_argument("--per-category", type=int, default=1,
                   help="prompts per category, the first N of each (default: %(default)s)")


def add_bench_args(p) -> None:
    add_question_args(p)
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="most tokens generated per question (default: %(default)s)")
    p.add_argument("--full", action="store_true",
                   help="all 480 questions (overrides --categories and --per-category)")
    p.add_argument("--drafters", metavar="LIST", default=DEFAULT_DRAFTERS,
                   help="edgespec drafters to run, separated by ';' (or by ',' when no cascade "
                        "is among them); llamacpp:default is added when llama-cpp-python is "
                        "installed; head:DIR, SPEC+head:DIR and auto are drafters too "
                        "(default: %(default)s)")
    p.add_argument("--trees", default="mag+cacheback", metavar="SPECS",
                   help="also run these drafters (';'-separated) drafting token trees, as "
                        "SPEC@treeN rows; 'none' skips them (default: %(default)s)")
    p.add_argument("--tree-width", dest="bench_tree_width", type=int, default=4,
                   help="N of the --trees rows: up to N - 1 branches per chunk "
                        "(default: %(default)s)")
    p.add_argument("--loose", default="mag", metavar="SPEC",
                   help="also run this drafter with loose verification (lossy: reported with "
                        "its drift from target-only); 'none' skips it (default: %(default)s)")
    p.add_argument("--assist-layers", type=int, default=4,
                   help="layers of the self-draft for transformers' assisted generation "
                        "(default: %(default)s)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each prompt and method; the fastest counts (shields figures "
                        "from a busy machine; drafters do not learn from repeats) "
                        "(default: %(default)s)")
    p.add_argument("--temperature", metavar="T", type=float, default=0.0,
                   help="sample every edgespec row at this temperature with per-question keyed "
                        "seeds, so target-only and every drafter draw the same tokens; "
                        "transformers' and llama.cpp's baselines are greedy and are skipped "
                        "(default: 0, greedy)")
    p.add_argument("--skip-hf", action="store_true",
                   help="skip the transformers baselines (faster; no speedup_vs_hf_* figures)")
    p.add_argument("--skip-llamacpp", action="store_true",
                   help="skip llama.cpp's baselines and drafter even when it is installed")
    p.add_argument("--no-fleet-warm", action="store_true",
                   help="skip the Cacheback fleet-table warm-up run")
    p.add_argument("--json", metavar="FILE", dest="json_out", default="bench-results/bench.json",
                   help="where to write the JSON results (default: %(default)s)")


def load_questions(categories: list[str], per_category: int, full: bool) -> list[dict]:
    text = resources.files("edgespec_cli.bench").joinpath("spec_bench_questions.jsonl").read_text()
    picked: list[dict] = []
    seen: defaultdict[str, int] = defaultdict(int)
    for line in text.splitlines():
        q = json.loads(line)
        cat = q["category"] if q["category"] in SPEC_BENCH else "mt_bench"
        if not full and (cat not in categories or seen[cat] >= per_category):
            continue
        seen[cat] += 1
        picked.append({"id": q["question_id"], "category": cat, "prompt": q["turns"][0],
                       "reference": first_reference(q)})
    return picked


def run_bench(args) -> int:
    """Every method on every selected question: a table per category and the JSON report."""
    from dataclasses import replace

    from edgespec.runner.cpu_kind import cpu_kind
    from edgespec_cli.cli_args import check_within, engine_config, set_threads, threads_in_use

    questions = load_questions(args.categories, args.per_category, args.full)
    if not questions:
        raise ConfigError("no questions selected")
    if args.repeat < 1:
        raise ConfigError(f"--repeat takes runs >= 1, got {args.repeat}")
    if args.max_new_tokens < 1:  # before the methods warm up
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_within(args, ("temperature",), 0)  # NaN too: as every surface refuses it
    if args.assist_layers < 1:
        raise ConfigError(f"--assist-layers takes layers >= 1, got {args.assist_layers}")
    plan = plan_methods(args)
    threads = set_threads(args.threads)
    _log(f"torch threads: {threads}")
    cfg = replace(engine_config(args, 2), head="", learn=False)  # heads: per row
    runner = BenchMethods(args, cfg, plan)
    try:
        methods = plan.methods(runner.has_float32, runner.hf is not None,
                               runner.gguf is not None, args.bench_tree_width)
        _log(f"warming up {len(methods)} methods")
        warm_ids = runner.gen.encode("Say hello.")
        for m in methods:
            runner.run_one(m, warm_ids, 4)
        records, refs, encoded = run_questions(runner, questions, methods)
        report = summarize(records, methods)
        levels = runner.cascade_levels(methods)
        if levels:
            report["cascade_levels"] = levels
        if not args.no_fleet_warm and any("cacheback" in d for d in plan.drafters):
            from .fleet_warm import run_fleet_warm

            report["fleet_warm"] = run_fleet_warm(runner.gen, questions, encoded, refs,
                                                  args.max_new_tokens, _log)
        # the count served: a default lowered where the dtype was not exact at it
        report["config"] = _config(args, runner, plan, cfg, threads_in_use() or threads,
                                   len(questions))
        report["config"]["cpu"] = cpu_kind().as_json()
        report["config"]["runner"] = runner.gen.runner.run_state()
        report["results"] = records
        print(f"machine: {cpu_kind().describe()}")
        print_tables(report, methods)
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        _log(f"wrote {out}")
    finally:
        runner.close()
    return 0


def run_questions(runner: BenchMethods, questions: list[dict], methods: list[str]
                  ) -> tuple[list[dict], dict, list[list[int]]]:
    """Every method on every question, with progress: (records, target-only outputs by
    question id, the encoded prompts)."""
    records: list[dict] = []
    refs: dict = {}
    encoded: list[list[int]] = []
    total, done, t_start = len(questions) * len(methods), 0, time.perf_counter()
    from edgespec.engine.session_lifecycle import output_room

    cfg, max_new = runner.gen.cfg, runner.args.max_new_tokens
    prompts = [runner.gen.encode(q["prompt"]) for q in questions]
    too_long = [(q["id"], len(ids)) for q, ids in zip(questions, prompts)
                if max_new > output_room(cfg.max_context, len(ids), cfg.max_draft)]
    if too_long:  # said before any is run, not after a run of minutes with no report
        raise ConfigError(f"{len(too_long)} question(s) do not fit --max-context "
                          f"{cfg.max_context} with --max-new-tokens {max_new} (the longest: "
                          f"question {too_long[0][0]}, "
                          f"{max(n for _, n in too_long)} prompt tokens): raise --max-context")
    for q, ids in zip(questions, prompts):
        encoded.append(ids)
        for m in methods:
            r = runner.run_best(m, ids)
            done += 1
            if m == "target_only":
                refs[q["id"]] = r["token_ids"]
            _score(r, q, m, ids, refs[q["id"]], runner.gen)
            records.append(r)
            eta = (time.perf_counter() - t_start) / done * (total - done)
            _log(f"[{done}/{total}] {q['category']:<15} q{q['id']:<4} {m:<26} "
                 f"{r['tokens'] / max(r['seconds'], 1e-9):6.1f} tok/s"
                 f"{'' if r['identical_to_target_only'] else '  (differs from target-only)'}"
                 f"  eta {eta:4.0f}s")
    return records, refs, encoded


def _score(r: dict, q: dict, method: str, ids: list[int], ref: list[int], gen) -> None:
    """A run's record: against target-only's output, and the task's reference where there is
    one."""
    r.update(question_id=q["id"], category=q["category"], method=method,
             prompt_tokens=len(ids), tokens=len(r["token_ids"]),
             identical_to_target_only=r.get("identical_to_target_only", True)
             and r["token_ids"] == ref,
             token_match_rate=round(token_match_rate(r["token_ids"], ref), 4))
    if q["reference"] is not None:
        text = gen.target.tokenizer.decode(r["token_ids"], skip_special_tokens=True)
        r["task_score"] = round(task_score(text, q["reference"]), 4)


def _config(args, runner: BenchMethods, plan: MethodPlan, cfg, threads: int,
            questions: int) -> dict:
    return {"model": runner.gen.target.name, "device": args.device, "dtype": runner.gen.dtype,
            "max_new_tokens": args.max_new_tokens, "questions": questions,
            "temperature": args.temperature, "threads": threads, "drafters": plan.drafters,
            "loose": plan.loose, "loose_params": vars(cfg.loose), "trees": plan.trees,
            "tree_width": args.bench_tree_width, "max_draft": args.max_draft,
            "window": args.window, "repeat": args.repeat}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
