"""``edgespec bench-forward``: what one verification forward costs, by dtype, sessions and tokens.

For each dtype served exactly here (``--dtypes``, default every one whose probe passes), the
target runner gets ``max(--batches)`` KV slots, each prefilled with a random ``--context``-token
prefix; then for every (sessions B, tokens a row T) the forward over B slots of T new tokens each
is timed ``--repeat`` times (the slots' lengths are never moved, so every run sees the same
context) and the median counts. The table gives milliseconds, the cost relative to the same
dtype's 1 x 1 forward (what a wider forward costs on top of a decode step) and to float32's.
``--profile B,T`` splits one such forward into linear layers, attention, the LM head and the rest
(norms, rotary, KV writes and reads, masks), timed by wrapping those calls. On a GPU every timed
forward (and every profiled part) ends with a device synchronisation, so the clock reads what the
GPU did, not when the kernels were launched. ``--shape 135m|1.7b|8b`` times a random-weight model
of that shape, built on the device from its config (no download; ``edgespec.models.shapes``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path


from edgespec.config import ConfigError


def add_bench_forward_args(p) -> None:
    p.add_argument("--dtypes", metavar="LIST", default=None,
                   help="comma-separated dtypes (default: every dtype that is exact on "
                        "--device here)")
    p.add_argument("--batches", metavar="LIST", default="1,2,4,8,16",
                   help="sessions in the forward, comma-separated (default: %(default)s)")
    p.add_argument("--tokens", metavar="LIST", default="1,2,5,9",
                   help="tokens a session adds, comma-separated: 1 is a decode step, 1 + k "
                        "verifies a k-token draft (default: %(default)s)")
    p.add_argument("--context", type=int, default=300,
                   help="tokens already in every KV slot (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=6,
                   help="timed runs per cell; the median counts (default: %(default)s)")
    p.add_argument("--profile", metavar="B,T", default="8,5",
                   help="B,T of the forward split into linear / attention / head / other "
                        "('' for none; default: %(default)s)")
    p.add_argument("--shape", default=None,
                   help="time a random-weight model of this shape instead of --model: "
                        "135m, 1.7b or 8b (built on --device from its config, no download)")
    p.add_argument("--json", dest="json_out", default="bench-results/forward-cost.json",
                   metavar="FILE",
                   help="where to write the JSON results (default: %(default)s)")


def _prepared_runner(model, slots: int, context: int, max_len: int):
    import torch

    from edgespec.runner.target_runner import TargetRunner

    runner = TargetRunner(model, n_slots=slots, max_len=max_len)
    g = torch.Generator().manual_seed(0)
    for s in range(slots):
        runner.new_slot()
        ids = torch.randint(0, runner.vocab_size, (context,), generator=g).tolist()
        runner.prefill(s, ids)
    return runner


def synchronize(device) -> None:
    """Wait for the device's queued work (a GPU runs kernels after their launch returns)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _time_forward(runner, B: int, T: int, repeat: int) -> float:
    """Median seconds of a forward over slots 0..B-1 with T new tokens each, synchronised."""
    rows = [[(7 * b + t) % runner.vocab_size for t in range(T)] for b in range(B)]
    runner.forward(list(range(B)), rows)  # warm-up (first-touch, oneDNN's primitive cache)
    synchronize(runner.device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        runner.forward(list(range(B)), rows)
        synchronize(runner.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextmanager
def _timed_parts(runner, totals: dict[str, float]):
    """Accumulate wall time of the runner's linear layers, LM head and attention calls."""
    import edgespec.runner.eager_forward as runner_mod  # the attention the layers call
    from edgespec.runner.linear import Linear

    lin_call = Linear.__call__
    attention = runner_mod.invariant_attention
    head = runner.lm_head

    dev = runner.device

    def timed_linear(self, x):
        synchronize(dev)
        t0 = time.perf_counter()
        out = lin_call(self, x)
        synchronize(dev)
        totals["head" if self is head else "linear"] += time.perf_counter() - t0
        return out

    def timed_attention(*a, **k):
        synchronize(dev)
        t0 = time.perf_counter()
        out = attention(*a, **k)
        synchronize(dev)
        totals["attention"] += time.perf_counter() - t0
        return out

    Linear.__call__ = timed_linear  # type: ignore[method-assign]  # timing patch
    runner_mod.invariant_attention = timed_attention
    try:
        yield
    finally:
        Linear.__call__ = lin_call  # type: ignore[method-assign]  # undone
        runner_mod.invariant_attention = attention


def profile_forward(runner, B: int, T: int, repeat: int) -> dict[str, float]:
    """Milliseconds of one B x T forward split into linear / attention / head / other (medians
    of ``repeat`` runs)."""
    rows = [[(7 * b + t) % runner.vocab_size for t in range(T)] for b in range(B)]
    runner.forward(list(range(B)), rows)
    runs = []
    for _ in range(repeat):
        parts = {"linear": 0.0, "attention": 0.0, "head": 0.0}
        with _timed_parts(runner, parts):
            synchronize(runner.device)
            t0 = time.perf_counter()
            runner.forward(list(range(B)), rows)
            synchronize(runner.device)
            total = time.perf_counter() - t0
        parts["other"] = total - sum(parts.values())
        parts["total"] = total
        runs.append(parts)
    return {k: 1000 * statistics.median(r[k] for r in runs) for k in runs[0]}


def run_bench_forward(args) -> int:
    from edgespec_cli.cli_args import positive_ints, set_threads, threads_in_use
    from edgespec.runner.cpu_kind import cpu_kind
    from edgespec.runner.dtype_probe import DTYPES, exact_here
    from edgespec.runner.dtype_choice import resolve_dtype
    from edgespec.models.loading import load_model
    from edgespec.models.shapes import random_model, shape_named

    threads = set_threads(args.threads)
    if args.repeat < 1 or args.context < 0:
        raise ConfigError(f"--repeat must be >= 1 and --context >= 0, got {args.repeat} and "
                          f"{args.context}")
    batches = positive_ints(args.batches, "--batches")
    tokens = positive_ints(args.tokens, "--tokens")
    if args.dtypes:
        dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        for d in dtypes:
            if d not in DTYPES:
                raise ConfigError(f"--dtypes takes {', '.join(DTYPES)}, got {d!r}")
    else:
        dtypes = [d for d in DTYPES if exact_here(d, args.device)] or ["float32"]
    if args.shape:
        shape_named(args.shape)  # an unknown shape is refused before anything is built
    profile = positive_ints(args.profile, "--profile") if args.profile else None
    if profile and len(profile) != 2:
        raise ConfigError("--profile takes B,T")
    slots = max(batches + ([profile[0]] if profile else []))
    width = max(tokens + ([profile[1]] if profile else []))
    cells, profiles, states = [], {}, {}
    for dt in dtypes:
        print(f"bench-forward: {dt}: loading and prefilling {slots} slots of {args.context} "
              "tokens", file=sys.stderr, flush=True)
        if args.shape:
            resolve_dtype(dt, args.device)  # refused where it is not exact, as a model would be
            model = random_model(args.shape, args.device, dt)
        else:
            model = load_model(args.model, args.device, dt).model
        runner = _prepared_runner(model, slots, args.context, args.context + width + 1)
        for B in batches:
            for T in tokens:
                ms = 1000 * _time_forward(runner, B, T, args.repeat)
                cells.append({"dtype": dt, "sessions": B, "tokens": T, "ms": ms})
                print(f"  {dt:9s} {B:3d} x {T}: {ms:8.2f} ms", file=sys.stderr, flush=True)
        if profile:
            profiles[dt] = profile_forward(runner, profile[0], profile[1], args.repeat)
        states[dt] = runner.run_state()
        del runner, model
    base = {c["dtype"]: c["ms"] for c in cells if c["sessions"] == 1 and c["tokens"] == 1}
    f32 = {(c["sessions"], c["tokens"]): c["ms"] for c in cells if c["dtype"] == "float32"}
    for c in cells:
        c["vs_decode_step"] = c["ms"] / base[c["dtype"]] if c["dtype"] in base else None
        ref = f32.get((c["sessions"], c["tokens"]))
        c["vs_float32"] = c["ms"] / ref if ref else None
    report = {"model": f"random {args.shape}" if args.shape else args.model,
              "device": _device_name(args.device), "threads": threads_in_use() or threads,
              "context": args.context,
              "cpu": cpu_kind().as_json(),
              "repeat": args.repeat, "cells": cells, "runner": states,
              "profile": {"sessions": profile[0], "tokens": profile[1], "ms": profiles}
              if profile else None,
              "command": "edgespec " + " ".join(sys.argv[1:])}
    print(f"machine: {cpu_kind().describe()}")
    print(format_table(report))
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"bench-forward: wrote {out}", file=sys.stderr)
    return 0


def _device_name(device: str) -> str:
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def format_table(report: dict) -> str:
    lines = [f"forward cost, {report['model']} on {report.get('device', 'cpu')}, "
             f"{report['context']}-token contexts, "
             f"{report['threads']} threads, median of {report['repeat']}",
             f"{'dtype':9s} {'sessions':>8s} {'tokens':>6s} {'ms':>9s} {'x decode step':>13s} "
             f"{'x float32':>9s}"]
    for c in report["cells"]:
        vs32 = f"{c['vs_float32']:.2f}" if c["vs_float32"] else "-"
        step = f"{c['vs_decode_step']:.2f}" if c["vs_decode_step"] else "-"
        lines.append(f"{c['dtype']:9s} {c['sessions']:8d} {c['tokens']:6d} {c['ms']:9.2f} "
                     f"{step:>13s} {vs32:>9s}")
    prof = report.get("profile")
    if prof:
        lines.append(f"one {prof['sessions']} x {prof['tokens']} forward, ms: "
                     "linear / attention / head / other (total)")
        for dt, p in prof["ms"].items():
            lines.append(f"  {dt:9s} {p['linear']:.1f} / {p['attention']:.1f} / {p['head']:.1f}"
                         f" / {p['other']:.1f} ({p['total']:.1f})")
    return "\n".join(lines)
