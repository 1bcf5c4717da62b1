"""``edgespec bench-net``: the distributed path on loopback against the in-process engine.

Starts ``edgespec serve`` (embedded Redis) and one ``edgespec drafter`` as separate processes on
this machine, then for each Spec-Bench prompt runs, one after the other, the in-process engine
and a client call pinned to that drafter, both greedy with the same drafter. Reports tokens/s of
both, their ratio, and where a distributed step's time goes: taking drafts from the cache
(includes waiting for the drafter), the forward, and the commit to Redis, in ms per step.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from edgespec.config import ConfigError, SamplingParams
from edgespec.runner.cpu_kind import cpu_kind
from edgespec.wire.channels import free_port
from ..terminated import raise_terminated
from .run import add_question_args, load_questions


def add_bench_net_args(p) -> None:
    add_question_args(p)
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="most tokens generated per prompt (default: %(default)s)")
    p.add_argument("--drafter", metavar="SPEC", default="mag",
                   help="the drafter process's drafter, as edgespec drafter's --drafter takes "
                        "it (default: %(default)s)")
    p.add_argument("--json", dest="json_out", default="bench-results/bench-net.json",
                   metavar="FILE",
                   help="where to write the JSON results (default: %(default)s)")


def spawn_edgespec(args: list, log: Path) -> subprocess.Popen:
    """``python -m edgespec_cli ARGS`` as a process, its output into ``log``."""
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-m", "edgespec_cli", *map(str, args)],
                                stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))


def stops_its_processes_on_sigterm(run: Callable[..., int]) -> Callable[..., int]:
    """``run`` (a command that starts ``edgespec`` processes and stops them in ``finally``
    blocks) with SIGTERM raising ``Terminated`` while it runs, whatever handler the program
    that called it has: Python's default for SIGTERM ends the interpreter without running
    those blocks, leaving the processes running (a ``bench-net`` killed so left its server
    holding its port); ``main`` then says so and answers 143."""

    @functools.wraps(run)
    def wrapped(*args, **kwargs) -> int:
        if threading.current_thread() is not threading.main_thread():  # no handler there
            return run(*args, **kwargs)
        before = signal.signal(signal.SIGTERM, raise_terminated)
        try:
            return run(*args, **kwargs)
        finally:  # None: a handler set outside Python, which cannot be set back
            signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)

    return wrapped


def wait_for_line(log: Path, needle: str, proc: subprocess.Popen, timeout: float = 180
                  ) -> None:
    """Wait until ``needle`` shows in ``log``; a ConfigError when ``proc`` exits first or the
    time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in log.read_text():
            return
        if proc.poll() is not None:
            raise ConfigError(f"a benchmark process exited early:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    raise ConfigError(f"timed out waiting for {needle!r} in {log}")


# the engine's options bench-net takes, as serve takes them: the spawned verifier runs with the
# same as the in-process engine (--draft-thread is the in-process engine's alone)
SERVE_ENGINE_OPTIONS = ("max_draft", "window", "chunk", "draft_wait_ms", "late_after",
                        "prefill_budget", "max_context", "tree_nodes", "head", "threads")
SERVE_ENGINE_FLAGS = ("no_adaptive", "learn", "auto")


def serve_engine_args(args) -> list[str]:
    """The command line's engine options, as ``edgespec serve`` options (those left unset
    stay the server's defaults, the in-process engine's as well)."""
    out: list[str] = []
    for name in SERVE_ENGINE_OPTIONS:
        value = getattr(args, name, None)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    out += [f"--{name.replace('_', '-')}" for name in SERVE_ENGINE_FLAGS
            if getattr(args, name, False)]
    # the in-process engine never fills a board's empty draft: nor does the server compared
    out += ["--fill-drafts", "none"]
    wanted = getattr(args, "cuda_graphs", None)
    if wanted is not None:
        out.append("--cuda-graphs" if wanted else "--no-cuda-graphs")
    return out


def _per_step_ms(stats: dict, key: str) -> float:
    return 1000 * stats[key] / stats["steps"] if stats["steps"] else 0.0


@stops_its_processes_on_sigterm
def run_bench_net(args) -> int:
    import edgespec

    from edgespec_cli.cli_args import check_model_arg, engine_config, set_threads
    from edgespec.engine.local import LocalGenerator

    from edgespec.drafters import EDGE_KINDS
    from edgespec.drafters.spec_check import check_drafter_arg

    check_model_arg(args.model)
    check_drafter_arg(args.drafter, allowed=EDGE_KINDS)  # a board's: before any process starts
    if args.max_new_tokens < 1:  # 0 on the wire would be the server's default
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    engine_config(args, 2)  # its options (--max-draft, --window ...) too
    set_threads(args.threads)
    questions = load_questions(args.categories, args.per_category, False)
    if not questions:
        raise ConfigError("no questions selected")
    out_dir = Path(args.json_out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    address = f"127.0.0.1:{port}"
    # the in-process side first: its dtype, --dtype auto settled here (a probe of this
    # machine and thread count), is the one the server is given, so both decode alike
    gen = LocalGenerator(args.model, args.drafter, args.device, args.dtype,
                         engine_config(args, 2))
    common = ["--model", args.model, "--device", args.device, "--dtype", gen.dtype]
    serve_log, drafter_log = out_dir / "bench-net-serve.log", out_dir / "bench-net-drafter.log"
    print(f"starting edgespec serve on {address} and one drafter ({args.drafter})",
          file=sys.stderr, flush=True)
    serve = drafter = None
    try:  # the processes started in it, stopped in its ``finally`` (SIGTERM too)
        serve = spawn_edgespec(["serve", "--listen", address, "--max-sessions", "2", *common,
                                *serve_engine_args(args)], serve_log)
        wait_for_line(serve_log, "listening on", serve)
        drafter = spawn_edgespec(["drafter", "--cache", address, "--device-id", "bench",
                          "--drafter", args.drafter], drafter_log)
        wait_for_line(drafter_log, "attached to", drafter)
        client = edgespec.Client(address, timeout=600)
        greedy = SamplingParams()
        warm = gen.encode("Say hello.")
        gen.generate(warm, 4, greedy)
        client.generate(prompt_ids=warm, max_new_tokens=4, device_id="bench")
        rows = []
        for i, q in enumerate(questions, 1):
            ids = gen.encode(q["prompt"])
            t0 = time.perf_counter()
            local = gen.generate(ids, args.max_new_tokens, greedy)
            t_local = time.perf_counter() - t0
            t0 = time.perf_counter()
            remote = client.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens,
                                     device_id="bench")
            t_remote = time.perf_counter() - t0
            ls, rs = local.stats.to_dict(), remote.stats
            row = {"question_id": q["id"], "category": q["category"], "prompt_tokens": len(ids),
                   "tokens": len(remote.token_ids),
                   "identical": remote.token_ids == local.token_ids,
                   "inprocess_tokens_per_s": len(local.token_ids) / t_local,
                   "distributed_tokens_per_s": len(remote.token_ids) / t_remote,
                   "inprocess_steps": ls["steps"], "distributed_steps": rs["steps"],
                   "inprocess_ms_per_step": {k: _per_step_ms(ls, k + "_s")
                                             for k in ("take", "forward", "commit")},
                   "distributed_ms_per_step": {k: _per_step_ms(rs, k + "_s")
                                               for k in ("take", "forward", "commit")},
                   "distributed_mean_acceptance_length": rs["mean_acceptance_length"],
                   "inprocess_mean_acceptance_length": ls["mean_acceptance_length"]}
            rows.append(row)
            print(f"[{i}/{len(questions)}] {q['category']:<15} in-process "
                  f"{row['inprocess_tokens_per_s']:6.1f} tok/s  distributed "
                  f"{row['distributed_tokens_per_s']:6.1f} tok/s"
                  f"{'' if row['identical'] else '  (outputs differ!)'}", file=sys.stderr,
                  flush=True)
        client.close()
        gen.close()
    finally:
        for p in (drafter, serve):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:  # a drain that outlasts its wait
                    p.kill()
                    p.wait()
    report = _summarize(rows)
    report["config"] = {"model": args.model, "drafter": args.drafter,
                        "max_new_tokens": args.max_new_tokens, "questions": len(rows),
                        "cpu": cpu_kind().as_json()}
    report["results"] = rows
    print(f"machine: {cpu_kind().describe()}")
    _print(report)
    Path(args.json_out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json_out}", file=sys.stderr)
    return 0


def _summarize(rows: list[dict]) -> dict:
    def total_rate(key):
        toks = sum(r["tokens"] for r in rows)
        secs = sum(r["tokens"] / r[key] for r in rows if r[key])
        return toks / secs if secs else 0.0

    local, remote = total_rate("inprocess_tokens_per_s"), total_rate("distributed_tokens_per_s")

    def mean_ms(side, k):
        steps = sum(r[f"{side}_steps"] for r in rows)
        return sum(r[f"{side}_ms_per_step"][k] * r[f"{side}_steps"] for r in rows) / steps

    per_step = {side: {k: round(mean_ms(side, k), 3) for k in ("take", "forward", "commit")}
                for side in ("inprocess", "distributed")}
    overhead = (per_step["distributed"]["take"] + per_step["distributed"]["commit"]
                - per_step["inprocess"]["take"] - per_step["inprocess"]["commit"])
    return {"summary": {"inprocess_tokens_per_s": round(local, 3),
                        "distributed_tokens_per_s": round(remote, 3),
                        "distributed_vs_inprocess": round(remote / local, 3) if local else 0.0,
                        "ms_per_step": per_step,
                        "transport_and_cache_overhead_ms_per_step": round(overhead, 3),
                        "lossless": all(r["identical"] for r in rows)}}


def _print(report: dict) -> None:
    s = report["summary"]
    print(f"\n{'category':<15} {'tokens':>6} {'in-proc tok/s':>13} {'distrib tok/s':>13} "
          f"{'ratio':>6} {'same':>5}")
    for r in report["results"]:
        print(f"{r['category']:<15} {r['tokens']:>6} {r['inprocess_tokens_per_s']:>13.1f} "
              f"{r['distributed_tokens_per_s']:>13.1f} "
              f"{r['distributed_tokens_per_s'] / r['inprocess_tokens_per_s']:>6.2f} "
              f"{r['identical']!s:>5}")
    print(f"{'all':<15} {'':>6} {s['inprocess_tokens_per_s']:>13.1f} "
          f"{s['distributed_tokens_per_s']:>13.1f} {s['distributed_vs_inprocess']:>6.2f} "
          f"{s['lossless']!s:>5}")
    print("\nms per step       take(wait+read)   forward   commit")
    for side in ("inprocess", "distributed"):
        m = s["ms_per_step"][side]
        print(f"{side:<17} {m['take']:>15.2f} {m['forward']:>9.2f} {m['commit']:>8.2f}")
    print(f"transport + cache overhead per step: "
          f"{s['transport_and_cache_overhead_ms_per_step']:.2f} ms")
