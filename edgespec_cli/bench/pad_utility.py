"""``edgespec bench-pad``: what PAD (``--verify pad:DIR``, lossy) buys and costs on a task with
exact answers, against target-only decoding and exact speculative decoding with the same drafter,
all measured in one run on the same problems.

    edgespec bench-pad [--classifier DIR] [--task NAME | --tasks-file FILE --scorer S]
                       [--sigmas 0.1,0.2,0.3,0.5] [--problems N] [--drafter SPEC] [--threads N]
                       [--json FILE] [--plot FILE]

The problems are the task's test split, never used for labels (``edgespec.pad.tasks``); the
default task is the one the classifier was labelled on, and any other one measures whether the
classifier transfers. Every method answers every problem greedily, one at a time, after one
untimed warm-up; a method's tokens/s is its tokens over its wall time, and the speed-up is that
over target-only's from the same run. Accuracy carries a 95% Wilson interval;
``identical_share`` is the share of answers token-identical to target-only's (1 for the exact
methods: they are lossless).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from edgespec.config import ConfigError, PadParams, SamplingParams

RECOMMENDED_SIGMA = PadParams.sigma  # the README's recommendation, PAD's default


def add_bench_pad_args(p) -> None:
    p.add_argument("--classifier", metavar="DIR", default="default",
                   help="the PAD classifier: a folder made by edgespec pad-train, or 'default' "
                        "(shipped for the default model) (default: %(default)s)")
    p.add_argument("--task", metavar="NAME", default=None,
                   help="a generated task family (arith, convert, extract, choice); default: "
                        "the one the classifier was labelled on (another one measures "
                        "transfer)")
    p.add_argument("--tasks-file", metavar="FILE", default=None,
                   help="a JSONL file of {\"prompt\", \"answer\"} lines instead; its test split "
                        "(a quarter, by a hash of each prompt) is used")
    p.add_argument("--scorer", default="exact", metavar="S",
                   help="with --tasks-file: exact, number or regex:PATTERN "
                        "(default: %(default)s)")
    p.add_argument("--problems", type=int, default=60,
                   help="test problems answered by every method (default: %(default)s)")
    p.add_argument("--sigmas", default="0.1,0.2,0.3,0.5", metavar="LIST",
                   help="PAD's sigmas to run, comma-separated (default: %(default)s)")
    p.add_argument("--pad-min-prob", metavar="P", type=float, default=PadParams.min_prob,
                   help="PAD's floor on the target's probability of a kept token "
                        "(default: %(default)s)")
    p.add_argument("--drafter", metavar="SPEC", default="mag+cacheback",
                   help="the drafter of the exact and PAD runs; head:DIR or SPEC+head:DIR "
                        "drafts with a head in the verifier (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=48,
                   help="longest answer (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the generated problems (default: %(default)s)")
    p.add_argument("--json", dest="json_out", default="bench-results/pad.json", metavar="FILE",
                   help="where to write the JSON results (default: %(default)s)")
    p.add_argument("--plot", metavar="FILE", default="bench-results/pad.png",
                   help="where to draw accuracy against speed-up, a PNG (needs matplotlib; "
                        "'' for none) (default: %(default)s)")


@dataclass
class MethodRun:
    """One method's answers to every problem."""

    method: str
    ids: list[list[int]]
    correct: list[bool]
    tokens: int
    seconds: float
    drafts: int
    accepted: int
    lenient: int


def wilson(k: int, n: int, z: float = 1.96) -> list[float]:
    """The 95% Wilson score interval [low, high] of a proportion k / n."""
    if n == 0:
        return [0.0, 1.0]
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)]


def parse_sigmas(text: str) -> list[float]:
    try:
        sigmas = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--sigmas must be numbers separated by commas, got {text!r}") from None
    if not sigmas:
        raise ConfigError("--sigmas names no sigma: give one or more, comma-separated")
    for s in sigmas:
        PadParams("check", sigma=s)  # range-checked there
    return sigmas


def run_method(method: str, engine, prompts: list[list[int]], tasks, decode,
               max_new: int) -> MethodRun:
    from edgespec.engine.spec_engine import Request

    run = MethodRun(method, [], [], 0, 0.0, 0, 0, 0)
    for i, (ids, problem) in enumerate(zip(prompts, tasks.problems)):
        t0 = time.perf_counter()
        res = engine.generate(Request(ids, max_new, SamplingParams()))
        run.seconds += time.perf_counter() - t0
        s = res.stats
        run.ids.append(list(res.token_ids))
        run.correct.append(tasks.scorer.correct(decode(res.token_ids), problem.answer))
        run.tokens += len(res.token_ids)
        run.drafts += s.num_drafts
        run.accepted += s.accepted_tokens
        run.lenient += s.lenient_tokens
        if (i + 1) % 10 == 0 or i + 1 == len(prompts):
            print(f"bench-pad: {method}: {i + 1}/{len(prompts)} problems, accuracy "
                  f"{sum(run.correct) / len(run.correct):.3f}", file=sys.stderr, flush=True)
    return run


def row_of(run: MethodRun, base: MethodRun) -> dict:
    n = len(run.correct)
    tps = run.tokens / run.seconds if run.seconds else 0.0
    base_tps = base.tokens / base.seconds if base.seconds else 0.0
    return {"method": run.method, "accuracy": round(sum(run.correct) / max(1, n), 4),
            "ci95": wilson(sum(run.correct), n),
            "identical_share": round(sum(a == b for a, b in zip(run.ids, base.ids))
                                     / max(1, n), 4),
            "mean_acceptance_length": round(1 + run.accepted / run.drafts, 4)
            if run.drafts else 1.0,
            "lenient_tokens": run.lenient, "tokens": run.tokens,
            "seconds": round(run.seconds, 3), "tokens_per_s": round(tps, 3),
            "speedup_vs_target_only": round(tps / base_tps, 4) if base_tps else 0.0}


def run_bench_pad(args) -> int:
    from edgespec_cli.cli_args import set_threads, threads_in_use
    from edgespec.config import EngineConfig
    from edgespec.drafters import build_drafter, parse_drafter_spec
    from edgespec.engine.local import LocalGenerator
    from edgespec.engine.spec_engine import Request, SpecEngine
    from edgespec.pad.classifier import PadManifest
    from edgespec.pad.tasks import family_problems, file_problems
    from edgespec.drafters.spec_check import check_drafter_arg
    from edgespec.pad.verify_rule import resolve_classifier_dir

    sigmas = parse_sigmas(args.sigmas)
    if args.problems < 1:
        raise ConfigError(f"--problems must be >= 1, got {args.problems}")
    PadParams("check", min_prob=args.pad_min_prob)  # range-checked there, before any run
    check_drafter_arg(args.drafter)  # built after the target-only run: checked before it
    from edgespec.pad.tasks import FAMILIES

    if args.task and args.task not in FAMILIES:  # the task and a classifier folder: before
        raise ConfigError(f"unknown task {args.task!r}: give one of {', '.join(FAMILIES)}")
    if args.classifier != "default" and \
            not (resolve_classifier_dir(args.classifier) / "pad.json").exists():  # the load
        raise ConfigError(f"--classifier {args.classifier}: not a PAD classifier folder (no "
                          "pad.json; make one with edgespec pad-train)")
    file_tasks = None
    if args.tasks_file:  # read and checked before the model loads
        file_tasks = file_problems(args.tasks_file, args.scorer, "test")
        file_tasks = replace(file_tasks, problems=file_tasks.problems[:args.problems])
    threads = set_threads(args.threads)
    print(f"bench-pad: torch threads {threads}", file=sys.stderr, flush=True)
    cfg = EngineConfig(max_sessions=1)
    gen = LocalGenerator(args.model, "none", args.device, args.dtype, cfg)
    folder = resolve_classifier_dir(args.classifier, gen.target.name)
    manifest = PadManifest.read(folder)
    trained_on = ",".join(manifest.labels.get("tasks", {}))  # the families it was labelled on
    if file_tasks is not None:
        tasks = file_tasks
    else:
        tasks = family_problems(args.task or trained_on.split(",")[0] or "extract", "test",
                                args.problems, args.seed)
    prompts = [gen.encode(p.prompt) for p in tasks.problems]
    decode = lambda ids: gen.target.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    gen.engine("none").generate(Request(prompts[0], 8, SamplingParams()))  # warm-up, untimed

    def engine_for(verify: str, sigma: float = 0.0) -> SpecEngine:
        drafter = build_drafter(args.drafter, gen.target, gen.runner, n_slots=1,
                                max_len=cfg.max_context, device=gen.device, dtype=gen.dtype)
        pad = PadParams(str(folder), sigma, args.pad_min_prob) if verify == "pad" else \
            PadParams()
        head = parse_drafter_spec(args.drafter).head or ""  # head:DIR, SPEC+head:DIR
        return SpecEngine(gen.runner, drafter, EngineConfig(max_sessions=1, verify=verify,
                                                            pad=pad, head=head), gen.stop_ids)

    runs = [run_method("target_only", gen.engine("none"), prompts, tasks, decode,
                       args.max_new_tokens)]
    plan = [("exact", "exact", 0.0)] + [(f"pad@{s:g}", "pad", s) for s in sigmas]
    for method, verify, sigma in plan:
        with engine_for(verify, sigma) as engine:
            runs.append(run_method(method, engine, prompts, tasks, decode,
                                   args.max_new_tokens))
    gen.close()
    rows = [row_of(r, runs[0]) for r in runs]
    exact = rows[1]
    for r in rows[2:]:
        r["speedup_vs_exact"] = round(r["tokens_per_s"] / exact["tokens_per_s"], 4) \
            if exact["tokens_per_s"] else 0.0
        r["acceptance_vs_exact"] = round(r["mean_acceptance_length"] /
                                         exact["mean_acceptance_length"], 4)
    report = {"config": {"classifier": str(folder), "trained_on": trained_on,
                         "task": tasks.name,
                         "transfer": tasks.name not in trained_on.split(","),
                         "problems": len(prompts), "sigmas": sigmas,
                         "pad_min_prob": args.pad_min_prob, "drafter": args.drafter,
                         "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                         "threads": threads_in_use() or threads, "dtype": gen.dtype,
                         "model": gen.target.name},
              "rows": rows, "recommended_sigma": RECOMMENDED_SIGMA}
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)
    if args.plot:
        plot(rows, args.plot, f"PAD on {tasks.name} ({args.drafter}, {len(prompts)} problems)")
    print(f"bench-pad: wrote {out}" + (f" and {args.plot}" if args.plot else ""),
          file=sys.stderr)
    return 0


def print_table(report: dict) -> None:
    c = report["config"]
    print(f"PAD on {c['task']} (classifier labelled on {c['trained_on'] or '?'}"
          f"{', transfer' if c['transfer'] else ''}), {c['problems']} test problems, drafter "
          f"{c['drafter']}, {c['threads']} threads, {c['dtype']}")
    print(f"{'method':<12}{'accuracy':>9}{'95% CI':>16}{'identical':>10}{'accept len':>11}"
          f"{'tok/s':>8}{'vs target':>10}{'kept by PAD':>12}")
    for r in report["rows"]:
        lo, hi = r["ci95"]
        print(f"{r['method']:<12}{r['accuracy']:>9.3f}{f'[{lo:.2f}, {hi:.2f}]':>16}"
              f"{r['identical_share']:>10.2f}{r['mean_acceptance_length']:>11.2f}"
              f"{r['tokens_per_s']:>8.1f}{r['speedup_vs_target_only']:>9.2f}x"
              f"{r['lenient_tokens']:>12}")


def plot(rows: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench-pad: matplotlib is not installed (the fleet extra): no plot",
              file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, r in enumerate(rows):
        lo, hi = r["ci95"]
        x, y = r["speedup_vs_target_only"], r["accuracy"]
        ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="o", capsize=3)
        # staggered: methods that tie on accuracy and speed stay readable
        ax.annotate(r["method"], (x, y), textcoords="offset points", xytext=(5, 5 + 11 * (i % 4)))
    ax.set_xlabel("speed-up over target-only (tokens/s)")
    ax.set_ylabel("accuracy (95% interval)")
    ax.set_title(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
