"""``edgespec bench-drafters``: how fast each drafter drafts, on the same CPU.

For each drafter spec and Spec-Bench prompt (a chat prompt, as ``edgespec bench`` sends it):
open a draft session (its prefill timed apart), then draft N tokens greedily with the confidence
cut-off off, so every drafted token costs one forward. The fastest of ``--repeat`` runs counts.
Meant for model drafters: ``model:default`` (the default model's float32 weights run by torch)
against ``llamacpp:default`` (the same model's Q4_1 GGUF run by llama.cpp), say. Each row also
says how far its drafts agree with the first drafter's (the common prefix, as a fraction of N).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


from edgespec.config import ConfigError, SamplingParams
from edgespec.engine.stack_choice import accepted_prefix
from edgespec.runner.cpu_kind import cpu_kind

from .run import add_question_args, load_questions

DEFAULT_DRAFTERS = "model:default,llamacpp:default"


def add_bench_drafters_args(p) -> None:
    add_question_args(p)
    p.add_argument("--draft-tokens", type=int, default=64,
                   help="tokens each drafter drafts per prompt (default: %(default)s)")
    p.add_argument("--drafters", metavar="LIST", default=DEFAULT_DRAFTERS,
                   help="comma-separated drafter specs to measure (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each prompt and drafter; the fastest counts "
                        "(default: %(default)s)")
    p.add_argument("--json", dest="json_out", default="bench-results/drafter-speed.json",
                   metavar="FILE",
                   help="where to write the JSON results (default: %(default)s)")


def draft_tokens(drafter, ids: list[int], n: int) -> dict:
    """Open a greedy session on ``ids`` and draft ``n`` tokens; the tokens and the timings."""
    t0 = time.perf_counter()
    session = drafter.open(ids, SamplingParams())
    t1 = time.perf_counter()
    out: list[int] = []
    try:
        while len(out) < n:
            got = session.propose(n - len(out)).tokens
            if not got:  # a drafter with nothing to offer (e.g. mag without a match)
                break
            out += got
    finally:
        t2 = time.perf_counter()
        session.close()
    return {"tokens": out, "prefill_s": t1 - t0, "draft_s": t2 - t1}


def bench_drafters(specs: list[str], target, prompts: list[list[int]], n_tokens: int,
                   repeat: int = 1, target_spec: str = "default") -> dict:
    """Draft ``n_tokens`` after each prompt with each drafter spec. ``target`` (a LoadedModel)
    checks tokenizers and is reused by ``model:`` specs naming ``target_spec``. Returns the
    report: per drafter totals (``drafters``) and per prompt rows (``results``)."""
    from edgespec.drafters import build_drafter, parse_drafter_spec
    from edgespec.runner.target_runner import TargetRunner

    max_len = max(len(p) for p in prompts) + n_tokens + 2
    runner = None
    rows: list[dict] = []
    totals: dict[str, dict] = {}
    first_tokens: dict[int, list[int]] = {}
    for spec in specs:
        parsed = parse_drafter_spec(spec)
        if parsed.kind == "layers" and runner is None:
            runner = TargetRunner(target.model, n_slots=1, max_len=max_len, exact=False)
        drafter = build_drafter(parsed, target, runner, n_slots=1, max_len=max_len,
                                loaded=target if parsed.kind == "model"
                                and parsed.arg == target_spec else None)
        if drafter is None:
            raise ConfigError(f"{spec!r} drafts nothing; give drafters to measure")
        if hasattr(drafter, "min_confidence"):
            drafter.min_confidence = 0.0  # one forward per token, however unsure
        draft_tokens(drafter, prompts[0][:16], 4)  # warm up (first-call costs)
        for i, ids in enumerate(prompts):
            best = min((draft_tokens(drafter, ids, n_tokens) for _ in range(max(1, repeat))),
                       key=lambda r: r["draft_s"])
            first_tokens.setdefault(i, best["tokens"])
            rows.append({"drafter": spec, "prompt": i, "prompt_tokens": len(ids), **best,
                         "prefix_agreement": accepted_prefix(best["tokens"], first_tokens[i])
                         / max(1, n_tokens)})
        if hasattr(drafter, "close"):
            drafter.close()
        mine = [r for r in rows if r["drafter"] == spec]
        drafted = sum(len(r["tokens"]) for r in mine)
        draft_s = sum(r["draft_s"] for r in mine)
        prefill_tokens = sum(r["prompt_tokens"] for r in mine)
        prefill_s = sum(r["prefill_s"] for r in mine)
        totals[spec] = {
            "name": drafter.name, "draft_tokens": drafted, "draft_s": round(draft_s, 3),
            "draft_tokens_per_s": round(drafted / draft_s, 2) if draft_s else 0.0,
            "ms_per_token": round(1000 * draft_s / drafted, 2) if drafted else 0.0,
            "prefill_tokens": prefill_tokens, "prefill_s": round(prefill_s, 3),
            "prefill_tokens_per_s": round(prefill_tokens / prefill_s, 1) if prefill_s else 0.0,
            "prefix_agreement": round(sum(r["prefix_agreement"] for r in mine) / len(mine), 3)}
    return {"drafters": totals, "results": rows}


def print_drafter_table(report: dict) -> None:
    first = next(iter(report["drafters"]), "")
    print(f"\n{'drafter':<22}{'draft tok/s':>12}{'ms/token':>10}{'prefill tok/s':>15}"
          f"{'agree w/ ' + first:>{max(12, len(first) + 11)}}")
    agree_w = max(12, len(first) + 11)
    for spec, t in report["drafters"].items():
        print(f"{spec:<22}{t['draft_tokens_per_s']:>12.1f}{t['ms_per_token']:>10.1f}"
              f"{t['prefill_tokens_per_s']:>15.1f}{t['prefix_agreement']:>{agree_w}.2f}")


def run_bench_drafters(args) -> int:
    import torch

    from edgespec_cli.cli_args import check_model_arg, set_threads
    from edgespec.drafters import parse_drafter_spec
    from edgespec.models.loading import encode_prompt, load_model

    if args.draft_tokens < 1:
        raise ConfigError(f"--draft-tokens must be >= 1, got {args.draft_tokens}")
    if args.repeat < 1:  # as bench's and simulate's --repeat
        raise ConfigError(f"--repeat must be >= 1, got {args.repeat}")
    specs = [d.strip() for d in args.drafters.split(",") if d.strip()]
    if not specs:
        raise ConfigError("--drafters names no drafter")
    for spec in specs:
        parse_drafter_spec(spec)
    questions = load_questions(args.categories, args.per_category, False)
    if not questions:
        raise ConfigError("no questions selected")
    check_model_arg(args.model)
    threads = set_threads(args.threads)
    target = load_model(args.model, args.device, args.dtype)
    prompts = [encode_prompt(target.tokenizer, q["prompt"]) for q in questions]
    print(f"threads: {threads}; {len(prompts)} prompts, {args.draft_tokens} draft tokens each",
          file=sys.stderr)
    report = bench_drafters(specs, target, prompts, args.draft_tokens, args.repeat, args.model)
    report["config"] = {"model": target.name, "device": args.device, "dtype": args.dtype,
                        "threads": torch.get_num_threads(), "draft_tokens": args.draft_tokens,
                        "repeat": args.repeat, "questions": [q["id"] for q in questions],
                        "cpu": cpu_kind().as_json()}
    print(f"machine: {cpu_kind().describe()}")
    print_drafter_table(report)
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["drafters"]))
    print(f"wrote {out}", file=sys.stderr)
    return 0
