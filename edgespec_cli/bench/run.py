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

import importlib.util
import json
import sys
import time
from collections import defaultdict
from importlib import resources
from pathlib import Path


from edgespec.config import ConfigError, SamplingParams

from .drift import first_reference, task_score, token_match_rate
from .report import CATEGORIES, LOOSE_PREFIX, TREE_TAG, print_tables, summarize

SPEC_BENCH = {"translation", "summarization", "qa", "math_reasoning", "rag"}  # else mt_bench
HF_METHODS = ["hf_generate", "hf_prompt_lookup", "hf_assisted"]
FLOAT32_TARGET = "target_only_float32"  # float32 target-only beside another served dtype
LLAMACPP_METHODS = ["llamacpp_target_only", "llamacpp_prompt_lookup"]
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
    p.add_argument("--max-new-tokens", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--full", action="store_true",
                   help="all 480 questions (overrides --categories and --per-category)")
    p.add_argument("--drafters", default=DEFAULT_DRAFTERS,
                   help="edgespec drafters to run, separated by ';' (or by ',' when no cascade "
                        "is among them); llamacpp:default is added when llama-cpp-python is "
                        "installed (default: %(default)s)")
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
    p.add_argument("--temperature", type=float, default=0.0,
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
    p.add_argument("--json", dest="json_out", default="bench-results/bench.json",
                   help="where to write the JSON results (default: %(default)s)")


def split_drafters(text: str) -> list[str]:
    sep = ";" if ";" in text else ","
    return [d.strip() for d in text.split(sep) if d.strip()]


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


class HFBaselines:
    """transformers' own generation paths on the same model object."""

    def __init__(self, model, stop_ids: set[int], assist_layers: int):
        self.model, self.assist_layers = model, assist_layers
        eos = sorted(stop_ids)
        self.common = dict(do_sample=False, eos_token_id=eos or None,
                           pad_token_id=eos[0] if eos else None)

    def run(self, method: str, ids: list[int], max_new: int) -> list[int]:
        import torch

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


def llamacpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def run_bench(args) -> int:
    from edgespec_cli.cli_args import check_drafter_arg, check_model_arg, engine_config, set_threads
    from edgespec.engine.local import LocalGenerator

    questions = load_questions(args.categories, args.per_category, args.full)
    if not questions:
        raise ConfigError("no questions selected")
    drafters = split_drafters(args.drafters)
    if getattr(args, "head", None):  # the head alone, and beside each drafter
        drafters += [f"head:{args.head}"] + [f"{d}+head:{args.head}" for d in drafters
                                             if d != "none" and "+head:" not in d]
    use_llamacpp = llamacpp_installed() and not args.skip_llamacpp and args.temperature <= 0
    if use_llamacpp and not any(d.startswith("llamacpp:") for d in drafters):
        drafters.append("llamacpp:default")
    loose = None if args.loose in ("", "none") else args.loose
    trees = [] if args.trees in ("", "none") else split_drafters(args.trees)
    check_model_arg(args.model)
    for d in drafters + trees + ([loose] if loose else []):
        check_drafter_arg(d)
    if trees and not 2 <= args.bench_tree_width <= 16:
        raise ConfigError(f"--tree-width must be in [2, 16], got {args.bench_tree_width}")
    from dataclasses import replace

    threads = set_threads(args.threads)
    _log(f"torch threads: {threads}")
    cfg = replace(engine_config(args, 2), head="", learn=False)  # heads: per row
    gen = LocalGenerator(args.model, "none", args.device, args.dtype, cfg)

    loose_gen = tree_gen = None
    if loose:
        loose_gen = LocalGenerator(gen.target, "none", args.device, args.dtype,
                                   replace(cfg, verify="loose"))
    if trees:
        tree_gen = LocalGenerator(gen.target, "none", args.device, args.dtype,
                                  replace(cfg, tree_width=args.bench_tree_width))
    # another dtype than float32: float32 target-only runs beside it, and transformers'
    # baselines run in float32 (what a user would otherwise run)
    f32 = None if gen.dtype == "float32" else LocalGenerator(args.model, "none", args.device,
                                                             "float32", cfg)
    gens = {"loose": loose_gen, "tree": tree_gen, "float32": f32}
    skip_hf = args.skip_hf or args.temperature > 0
    hf = None if skip_hf else HFBaselines((f32 or gen).target.model, gen.stop_ids,
                                          args.assist_layers)
    gguf = None
    if use_llamacpp:
        from edgespec.models.files import default_model_gguf

        gguf = default_model_gguf()
    methods = ["target_only"] + ([FLOAT32_TARGET] if f32 else []) + \
              ([] if hf is None else HF_METHODS) + \
              (LLAMACPP_METHODS if gguf else []) + [f"edgespec:{d}" for d in drafters] + \
              [f"edgespec:{d}{TREE_TAG}{args.bench_tree_width}" for d in trees] + \
              ([f"{LOOSE_PREFIX}{loose}"] if loose else [])
    sampled = args.temperature > 0

    def params_for(ids: list[int]) -> SamplingParams:
        if not sampled:
            return SamplingParams()
        return SamplingParams(temperature=args.temperature, seed=len(ids) * 7919 + sum(ids))

    def run_one(method: str, ids: list[int], max_new: int) -> dict:
        t0 = time.perf_counter()
        if method.startswith("hf_"):
            assert hf is not None  # hf_ methods are run only when the baselines loaded
            out = hf.run(method, ids, max_new)
            return {"token_ids": out, "seconds": time.perf_counter() - t0}
        if method.startswith("llamacpp_"):
            from .llamacpp_baseline import llamacpp_prompt_lookup, llamacpp_target_only

            run = llamacpp_prompt_lookup if method.endswith("lookup") else llamacpp_target_only
            out = run(gguf, ids, max_new, gen.stop_ids)
            return {"token_ids": out, "seconds": time.perf_counter() - t0}
        g, drafter = _generator_for(method, gen, gens)
        res = g.generate(ids, max_new, params_for(ids), drafter=drafter)
        s = res.stats
        return {"token_ids": res.token_ids, "seconds": time.perf_counter() - t0,
                "decode_seconds": s.elapsed_s - s.prefill_s, "stats": s.to_dict()}

    _log(f"warming up {len(methods)} methods")
    warm_ids = gen.encode("Say hello.")
    for m in methods:
        run_one(m, warm_ids, 4)

    def run_best(method: str, ids: list[int]) -> dict:
        drafter = None
        if method.startswith(("edgespec:", LOOSE_PREFIX)):
            g, spec = _generator_for(method, gen, gens)
            drafter = g.engine(spec).drafter
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
        assert best is not None  # at least one repeat
        return best

    records, refs, encoded = [], {}, []
    total, done, t_start = len(questions) * len(methods), 0, time.perf_counter()
    for q in questions:
        ids = gen.encode(q["prompt"])
        encoded.append(ids)
        for m in methods:
            r = run_best(m, ids)
            done += 1
            if m == "target_only":
                refs[q["id"]] = r["token_ids"]
            ref = refs[q["id"]]
            r.update(question_id=q["id"], category=q["category"], method=m,
                     prompt_tokens=len(ids), tokens=len(r["token_ids"]),
                     identical_to_target_only=r.get("identical_to_target_only", True)
                     and r["token_ids"] == ref,
                     token_match_rate=round(token_match_rate(r["token_ids"], ref), 4))
            if q["reference"] is not None:
                text = gen.target.tokenizer.decode(r["token_ids"], skip_special_tokens=True)
                r["task_score"] = round(task_score(text, q["reference"]), 4)
            records.append(r)
            eta = (time.perf_counter() - t_start) / done * (total - done)
            _log(f"[{done}/{total}] {q['category']:<15} q{q['id']:<4} {m:<26} "
                 f"{r['tokens'] / max(r['seconds'], 1e-9):6.1f} tok/s"
                 f"{'' if r['identical_to_target_only'] else '  (differs from target-only)'}"
                 f"  eta {eta:4.0f}s")
    report = summarize(records, methods)
    levels = {m: g.engine(spec).drafter.level_stats() for m in methods
              if m.startswith("edgespec:cascade:")
              for g, spec in [_generator_for(m, gen, gens)]}
    if levels:
        report["cascade_levels"] = levels
    if not args.no_fleet_warm and any("cacheback" in d for d in drafters):
        from .fleet_warm import run_fleet_warm

        report["fleet_warm"] = run_fleet_warm(gen, questions, encoded, refs,
                                              args.max_new_tokens, _log)
    report["config"] = {"model": gen.target.name, "device": args.device, "dtype": gen.dtype,
                        "max_new_tokens": args.max_new_tokens, "questions": len(questions),
                        "temperature": args.temperature,
                        "threads": threads, "drafters": drafters,
                        "loose": loose, "loose_params": vars(cfg.loose), "trees": trees,
                        "tree_width": args.bench_tree_width,
                        "max_draft": args.max_draft, "window": args.window,
                        "repeat": args.repeat}
    report["results"] = records
    print_tables(report, methods)
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    _log(f"wrote {out}")
    gen.close()
    for g in gens.values():
        if g is not None:
            g.close()
    return 0


def _generator_for(method: str, gen, gens: dict):
    """(the LocalGenerator, the drafter spec) an edgespec method runs with; ``gens``: the
    loose and tree generators."""
    if method == "target_only":
        return gen, "none"
    if method == FLOAT32_TARGET:
        return gens["float32"], "none"
    if method.startswith(LOOSE_PREFIX):
        return gens["loose"], method[len(LOOSE_PREFIX):]
    spec = method.split(":", 1)[1]
    if TREE_TAG in spec:
        return gens["tree"], spec.rsplit(TREE_TAG, 1)[0]
    return gen, spec


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
