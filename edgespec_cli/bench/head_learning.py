"""``edgespec bench-learn``: what ``--learn`` does to a head's acceptance over a stream of
requests, against the same stream with learning off (same drafter, same head at the start).

The stream is a Spec-Bench category's questions in order (``--requests`` of them, going round
again sampled at temperature 0.7 when the category has fewer), each answered greedily. Per
request it records the head's accepted tokens per verification step and the head's version; a
table, a JSON file and a chart (matplotlib, when installed) come out.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from edgespec.config import ConfigError, SamplingParams


def add_bench_learn_args(p) -> None:
    p.add_argument("--head", required=True, metavar="DIR",
                   help="the head to start from (required): a head folder, 'default' or a shipped "
                        "kind")
    p.add_argument("--category", metavar="CAT", default="translation",
                   help="the Spec-Bench category of the stream (one the head was not trained "
                        "on: see edgespec distill --hold-out-category) (default: %(default)s)")
    p.add_argument("--requests", type=int, default=100,
                   help="requests in the stream (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="most tokens generated per request (default: %(default)s)")
    p.add_argument("--drafter", metavar="SPEC", default="none",
                   help="the in-process drafter beside the head, in both runs "
                        "(default: %(default)s)")
    p.add_argument("--learn-every", type=int, default=1000, metavar="TOKENS",
                   help="new live tokens between two --learn rounds (default: %(default)s)")
    p.add_argument("--json", dest="json_out", default="bench-results/head-learning.json",
                   metavar="FILE",
                   help="where to write the JSON results (default: %(default)s)")
    p.add_argument("--plot", metavar="FILE", default="bench-results/head-learning.png",
                   help="where to draw the chart, a PNG (needs matplotlib) (default: %(default)s)")


def stream_of(category: str, n: int) -> list[tuple[str, SamplingParams]]:
    from .run import load_questions

    qs = [q for q in load_questions([], 0, full=True) if q["category"] == category]
    if not qs:
        raise ConfigError(f"no Spec-Bench questions in category {category!r}")
    out = []
    for i in range(n):
        lap = i // len(qs)
        params = SamplingParams() if lap == 0 else SamplingParams(temperature=0.7, seed=i)
        out.append((qs[i % len(qs)]["prompt"], params))
    return out


def run_stream(gen, engine, prompts: list[list[int]], params: list[SamplingParams],
               max_new: int, label: str) -> list[dict]:
    from edgespec.engine.spec_engine import Request

    rows = []
    for i, (ids, sp) in enumerate(zip(prompts, params)):
        t0 = time.perf_counter()
        res = engine.generate(Request(ids, max_new, sp))
        s = res.stats
        rows.append({"request": i, "tokens": len(res.token_ids), "steps": s.steps,
                     "head_tokens": s.head_tokens, "head_accepted": s.head_accepted,
                     "head_accepted_per_step": round(s.head_accepted / max(1, s.steps), 4),
                     "tokens_per_step": round(s.tokens_per_step, 4),
                     "version": engine.head.version, "seconds": round(time.perf_counter() - t0, 3)})
        print(f"[{label} {i + 1}/{len(prompts)}] head accepted {s.head_accepted}/"
              f"{s.head_tokens}, {s.tokens_per_step:.2f} tokens/step, head version "
              f"{engine.head.version}", file=sys.stderr, flush=True)
    return rows


def run_bench_learn(args) -> int:
    from edgespec_cli.cli_args import set_threads, threads_in_use
    from edgespec.config import EngineConfig
    from edgespec.drafters import build_drafter
    from edgespec.engine.spec_engine import SpecEngine
    from edgespec.heads.manifest import load_head
    from edgespec.heads.online import LearnSettings
    from edgespec.heads.proposer import HeadProposer
    from edgespec.engine.local import LocalGenerator

    from edgespec_cli.cli_args import check_at_least

    check_at_least(args, ("requests", "learn_every", "max_new_tokens"), 1)  # before any work
    from edgespec.drafters.spec_check import check_head_arg

    check_head_arg(args.head)  # a head that is not there: before the model loads
    threads = set_threads(args.threads)
    print(f"bench-learn: torch threads {threads}", file=sys.stderr, flush=True)
    stream = stream_of(args.category, args.requests)
    cfg = EngineConfig(max_sessions=2)
    gen = LocalGenerator(args.model, "none", args.device, args.dtype, cfg)
    prompts = [gen.encode(p) for p, _ in stream]
    params = [sp for _, sp in stream]
    runs: dict[str, list[dict]] = {}
    for learn in (False, True):
        label = "learn" if learn else "fixed"
        head = HeadProposer(load_head(args.head, gen.runner), source=args.head,
                            learn=LearnSettings(min_new_tokens=args.learn_every)
                            if learn else False)
        drafter = build_drafter(args.drafter, gen.target, gen.runner)
        with SpecEngine(gen.runner, drafter, cfg, gen.stop_ids, head=head) as engine:
            runs[label] = run_stream(gen, engine, prompts, params, args.max_new_tokens, label)
    report = {"config": {"head": args.head, "category": args.category,
                         "requests": args.requests, "max_new_tokens": args.max_new_tokens,
                         "drafter": args.drafter, "learn_every": args.learn_every,
                         "threads": threads_in_use() or threads, "dtype": gen.dtype,
                         "model": gen.target.name},
              "runs": runs, "summary": summarize(runs)}
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print_summary(report["summary"])
    plot(runs, args.plot, f"{args.head} on {args.category}")
    print(f"bench-learn: wrote {out}" + (f" and {args.plot}" if args.plot else ""),
          file=sys.stderr)
    return 0


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Head tokens accepted a step by quarter of the stream, per run."""
    out: dict[str, dict] = defaultdict(dict)
    for label, rows in runs.items():
        q = max(1, len(rows) // 4)
        for k in range(0, len(rows), q):
            part = rows[k:k + q]
            steps = sum(r["steps"] for r in part)
            out[label][f"requests {k + 1}-{k + len(part)}"] = round(
                sum(r["head_accepted"] for r in part) / max(1, steps), 4)
        out[label]["final_version"] = rows[-1]["version"] if rows else 0
    return dict(out)


def print_summary(summary: dict) -> None:
    labels = list(summary)
    keys = [k for k in summary[labels[0]] if k != "final_version"]
    print("head tokens accepted per step, by part of the stream")
    print(f"{'requests':<18}" + "".join(f"{lb:>10}" for lb in labels))
    for k in keys:
        print(f"{k.removeprefix('requests '):<18}" +
              "".join(f"{summary[lb].get(k, 0):>10.3f}" for lb in labels))
    print(f"{'head version':<18}" + "".join(f"{summary[lb]['final_version']:>10}"
                                          for lb in labels))


def plot(runs: dict[str, list[dict]], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench-learn: matplotlib is not installed (the fleet extra): no chart",
              file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in runs.items():
        window = 10
        ys = [r["head_accepted"] / max(1, r["steps"]) for r in rows]
        smooth = [sum(ys[max(0, i - window + 1):i + 1]) / len(ys[max(0, i - window + 1):i + 1])
                  for i in range(len(ys))]
        on = "on" if label == "learn" else "off"
        ax.plot(range(1, len(ys) + 1), smooth, label=f"--learn {on}")
    ax.set_xlabel("request")
    ax.set_ylabel("head tokens accepted per step (mean of 10)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
