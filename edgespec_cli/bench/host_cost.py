"""``edgespec bench-host``: the engine's host work per step and session, apart from the device.

The verifier's step does host work that does not depend on the model: planning, taking drafts
from the store, proposing, building rows, the verification's host part, deciding, placing tree
paths, committing, applying. On a GPU the forward is fast and this work bounds a fleet. Here it
is measured alone: ``InstantRunner`` stands in for the target runner (the real KV cache's slots
and lengths with no layers, no weights) and answers a step at once with deterministic logits,
each row's next token a fixed function of its context (the token before it and its position):
with probability ``--right`` the next step of a cycle MaG can learn, else a hashed token, so
drafts are right about that often. Everything else is the product's own: the engine, the
in-process store with its drafting thread (MaG, Cacheback, trees), or the Redis store (embedded
Redis, target-only: no board drafts through it here).

Per setting (store x drafter x sessions) it runs ``generate_many`` of that many prompts,
``--new-tokens`` each, after a warm-up of the same size, ``--repeats`` times (the run of
median tokens per second is reported, every run's tokens per second beside it; each repeat's
host figures are its engine's median of ``PLAIN_RUNS`` runs), with torch on
one thread, and times each stage of every step by wrapping the engine's own stage methods:
microseconds a step and a session-step for plan, take, propose, verify (rows + the runner's
answer + the verification's host part; the runner's own time is reported apart as
``runner``), decide, place and commit (with apply), and tokens per second. The stages' times
are the wall's: in process, the drafting thread shares the interpreter's lock with the
verifier, and a stage that lets go of it (a tensor operation, a wait) can wait for the
drafter's work. So each thread's CPU time is reported apart too: the verifier's (the runner's
answers left out) and the drafting thread's, a session-step each, and the verifier's by stage
(a second table; ``cpu_us_per_step`` in the JSON). Each engine, once built, has the heap then
alive frozen out of the garbage collector's passes, as a server does at start
(``edgespec.runner.process_heap``).
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar, cast

from edgespec.config import ConfigError, EngineConfig

from .instant_runner import VOCAB, InstantRunner

if TYPE_CHECKING:  # torch is imported where it runs: the parser is built without it
    from edgespec.runner.target_runner import TargetRunner

T = TypeVar("T")
STAGES = ("plan", "take", "propose", "verify", "decide", "place", "commit")
PLAIN_RUNS = 5  # runs timed without stopwatches per engine: the median's is reported


def add_bench_host_args(p) -> None:
    p.add_argument("--sessions", default="1,8,64,256", metavar="N[,N...]",
                   help="sessions decoded together (default: %(default)s)")
    p.add_argument("--drafters", default="none;mag;mag+cacheback;mag@tree4", metavar="LIST",
                   help="';'-separated drafters of the in-process store (','-separated where "
                        "the list has no ';' and no cascade, whose members are ','-separated; "
                        "SPEC@treeN: token "
                        "trees of width N; SPEC@thread: a cheap drafter in its drafting "
                        "thread, not in the verifier's) (default: %(default)s)")
    p.add_argument("--stores", default="local,redis", metavar="LIST",
                   help="local: the in-process store and its drafter; redis: the Redis store "
                        "(embedded Redis), target-only (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=64,
                   help="tokens per session (default: %(default)s)")
    p.add_argument("--right", type=float, default=0.9,
                   help="how often the target's next token follows the cycle MaG can learn "
                        "(default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each setting (each after its own warm-up); the table shows "
                        "the run of median tokens/s (default: %(default)s)")
    p.add_argument("--json", dest="json_out", default="bench-results/bench-host.json",
                   metavar="FILE", help="where to write the JSON results (default: %(default)s)")


def _settings(args) -> list[tuple[str, str, int]]:
    try:
        counts = sorted({int(x) for x in args.sessions.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--sessions takes counts like 1,8,64, got {args.sessions!r}") \
            from None
    if not counts or counts[0] < 1 or counts[-1] > 1024:
        raise ConfigError("--sessions must be in [1, 1024]")
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if not stores or set(stores) - {"local", "redis"}:
        raise ConfigError(f"--stores takes local and/or redis, got {args.stores!r}")
    if not 0 <= args.right <= 1:
        raise ConfigError("--right must be in [0, 1]")
    if args.new_tokens < 1:
        raise ConfigError("--new-tokens must be >= 1")
    if args.repeats < 1:
        raise ConfigError("--repeats must be >= 1")
    from .methods import split_drafters

    drafters = split_drafters(args.drafters)
    if not drafters:
        raise ConfigError("--drafters names no drafter (give none, mag, ...; ';'-separated)")
    from edgespec.drafters.spec_check import check_drafter_arg

    for d in drafters:  # a malformed one refused before anything runs
        spec = drafter_options(d)[0]
        if spec != "none":
            check_drafter_arg(spec)
    out = []
    for store in stores:
        for d in drafters if store == "local" else ["none"]:
            out += [(store, d, n) for n in counts]
    return out


def drafter_options(drafter: str) -> tuple[str, int, bool]:
    """``SPEC[@treeN][@thread]`` as (spec, tree width, drafting inline); the suffixes are read
    from the end, so SPEC itself may hold an @."""
    m = re.fullmatch(r"(.+?)((?:@tree\d+|@thread)*)", drafter)
    if m is None:
        raise ConfigError("--drafters: an empty drafter")
    spec, width, inline = m[1], 1, True
    for option in re.findall(r"@(tree\d+|thread)", m[2]):
        if option == "thread":
            inline = False
        elif int(option[4:]) >= 1:
            width = int(option[4:])
        else:
            raise ConfigError(f"--drafters: {drafter!r}: a tree is at least 1 wide")
    return spec, width, inline


def _engine(store: str, drafter: str, n: int, right: float, wait_ms: float = 0.0):
    from edgespec.drafters import build_drafter
    from edgespec.drafters.spec_check import check_drafter_arg
    from edgespec.engine.spec_engine import SpecEngine

    spec, width, inline = drafter_options(drafter)
    runner = InstantRunner(n, right)
    target = cast("TargetRunner", runner)  # the runner's interface, answered at once
    # rest_drafters off: this measures every stage's host work, and a batch whose drafting the
    # engine found slower than resting (here, where a forward costs nothing, it is) would skip
    # the drafting stages
    cfg = EngineConfig(max_sessions=n, tree_width=width, draft_wait_ms=wait_ms,
                       draft_inline=inline, rest_drafters=False)
    if store == "redis":
        from cache_service.redis_conn import RedisHandle
        from cache_service.store import RedisSessionStore

        handle = RedisHandle()
        redis_store = RedisSessionStore(handle.client, ttl_s=600)
        engine = SpecEngine(target, None, cfg, set(), store=redis_store)

        def close() -> None:
            redis_store.shutdown()  # its threads first, then the Redis they read
            handle.close()

        return engine, runner, close
    built = None if spec == "none" else build_drafter(check_drafter_arg(spec), None, None)
    return SpecEngine(target, built, cfg, set()), runner, lambda: None


def _tables_kept(engine, run: Callable[[], T]) -> T:
    """``run()``, then the drafter's learned tables put back as they were before it (the next
    run must not draft from what this one taught it) and the run's closed sessions recorded in
    the Redis store's fleet table (not while the next run's steps use Redis). The warm-up, and
    the run of the host's totals before the run of the stages."""
    drafter = engine.drafter
    state = drafter.snapshot() if drafter is not None else None
    out = run()
    if drafter is not None:
        drafter.restore(state)
    finish = getattr(engine.store, "finish_recording", None)
    if finish is not None:  # the Redis store: its fleet table taught before the next run
        finish()
    return out


def _timed(engine, times: dict[str, float], cpu: dict[str, float]) -> None:
    """Wrap the engine's stage methods so that each adds its wall seconds to ``times`` and
    its seconds of the calling thread's CPU to ``cpu``."""
    names = {"plan": "_plan", "take": "_take", "propose": "_propose", "verify": "_verify",
             "decide": "_decide", "place": "_place", "commit": "_commit"}
    for stage, attr in names.items():
        inner = getattr(engine, attr)

        # the thread's CPU clock (a system call: ~2 us here) read outside the wall's window
        def timed(*a, _inner=inner, _stage=stage, **kw):
            c0 = time.thread_time()
            t0 = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                t1 = time.perf_counter()
                times[_stage] += t1 - t0
                cpu[_stage] += time.thread_time() - c0

        setattr(engine, attr, timed)


def _prompts(n: int, runner: InstantRunner) -> list[list[int]]:
    """n prompts of 64 tokens that follow the target's own choices (MaG finds its cycles)."""
    import torch

    out = []
    for i in range(n):
        ids = [int((i * 37) % VOCAB)]
        for pos in range(1, 64):
            ids.append(int(runner.next_token(torch.tensor([ids[-1]]), torch.tensor([pos]))[0]))
        out.append(ids)
    return out


def measure(store: str, drafter: str, n: int, new_tokens: int, right: float,
            wait_ms: float = 0.0) -> dict:
    """One setting's figures. ``wait_ms``: how long a step waits for drafts (0, the
    benchmark's: the host work alone, never a wait)."""
    from edgespec.config import SamplingParams
    from edgespec.engine.generation import Request
    from edgespec.runner.process_heap import freeze_startup_heap, thaw_heap

    engine, runner, close = _engine(store, drafter, n, right, wait_ms)
    freeze_startup_heap()  # as a server does once started (``edgespec serve``)
    try:
        prompts = _prompts(n, runner)

        def run() -> tuple[float, int, list]:
            reqs = [Request(list(p), new_tokens, SamplingParams()) for p in prompts]
            t0 = time.perf_counter()
            results = engine.generate_many(reqs)
            return time.perf_counter() - t0, sum(len(r.token_ids) for r in results), results

        _tables_kept(engine, run)  # the warm-up
        counted = {"steps": 0, "session_steps": 0}
        step = engine.step

        def counting_step():
            counted["session_steps"] += len(engine.active)
            counted["steps"] += 1
            return step()

        engine.step = counting_step
        drafter_clock = _cpu_clock(engine.worker)

        def timed_run() -> dict:
            counted["steps"] = counted["session_steps"] = 0
            runner.runner_s = runner.runner_cpu_s = 0.0
            cpu0 = time.thread_time(), _cpu_s(drafter_clock)
            wall, tokens, results = run()
            return {"wall": wall, "tokens": tokens, "results": results, **counted,
                    "runner_s": runner.runner_s, "runner_cpu_s": runner.runner_cpu_s,
                    "verifier_cpu": time.thread_time() - cpu0[0] - runner.runner_cpu_s,
                    "drafter_cpu": _cpu_s(drafter_clock) - cpu0[1]
                    if drafter_clock is not None else None}

        # the host's total from runs with no stopwatch in the engine (a stage's two clock
        # reads and its wrapper cost ~4 us a stage and step here: ~30 us a step, a tenth of
        # one session's host work): the run of median host time a session-step of
        # PLAIN_RUNS, each drafting from the same tables (one run of 64 sessions is ~20 ms:
        # alone, a moment's noise on a shared machine moves it by a tenth); the stages from
        # one more run
        plains = [_tables_kept(engine, timed_run) for _ in range(PLAIN_RUNS)]
        plains.sort(key=_host_per_session_step)
        plain = plains[len(plains) // 2]
        times: dict[str, float] = defaultdict(float)
        cpu: dict[str, float] = defaultdict(float)
        _timed(engine, times, cpu)
        staged = timed_run()
    finally:
        engine.close()
        close()
        thaw_heap()  # this engine's objects collectable again
    steps, sess = max(1, plain["steps"]), max(1, plain["session_steps"])
    staged_steps = max(1, staged["steps"])
    # deciding runs inside the verify stage (the verdicts decided as they are read): each
    # stage's figure is its own
    times["verify"] -= times["decide"]
    cpu["verify"] -= cpu["decide"]
    # the runner answers inside the verify stage: its time is its own column, the stage's the
    # host part alone (wall and CPU alike)
    times["verify"] -= staged["runner_s"]
    cpu["verify"] -= staged["runner_cpu_s"]
    stage_us = {k: 1e6 * times[k] / staged_steps for k in STAGES}
    stage_us["runner"] = 1e6 * staged["runner_s"] / staged_steps
    stage_cpu_us = {k: 1e6 * cpu[k] / staged_steps for k in STAGES}
    host_s = plain["wall"] - plain["runner_s"]
    results, wall, tokens = plain["results"], plain["wall"], plain["tokens"]
    drafted = sum(r.stats.draft_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    return {"store": store, "drafter": drafter, "sessions": n, "steps": plain["steps"],
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else None,
            "us_per_step": stage_us, "cpu_us_per_step": stage_cpu_us,
            "host_us_per_step": 1e6 * host_s / steps,
            "host_us_per_session_step": 1e6 * _host_per_session_step(plain),
            # every plain run's, ascending (the figure above is their median)
            "host_us_per_session_step_runs": [1e6 * _host_per_session_step(p) for p in plains],
            # the stages' run: its steps, and its host time a step with the stopwatches in it
            "staged_steps": staged["steps"],
            "staged_host_us_per_step":
                1e6 * (staged["wall"] - staged["runner_s"]) / staged_steps,
            "us_per_session_step": {k: v * staged_steps / max(1, staged["session_steps"])
                                    for k, v in stage_us.items()},
            # CPU time: the verifier's thread (the runner's answers left out) and the in-process
            # drafting thread (None without one, or where threads' clocks cannot be read)
            "verifier_cpu_us_per_session_step": 1e6 * plain["verifier_cpu"] / sess,
            "drafter_cpu_us_per_session_step": None if plain["drafter_cpu"] is None
            else 1e6 * plain["drafter_cpu"] / sess,
            "acceptance_rate": accepted / drafted if drafted else None}


def _host_per_session_step(run: dict) -> float:
    """A run's host seconds a session-step: its wall less the runner's answers."""
    return (run["wall"] - run["runner_s"]) / max(1, run["session_steps"])


def median_run(runs: list[dict]) -> dict:
    """Of a setting's runs, the one of median tokens per second (the upper of two middles),
    with every run's tokens per second beside it: on a shared machine one run of a few
    hundred steps moves by half."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"] or 0.0)
    return {**ordered[len(ordered) // 2],
            "tokens_per_s_runs": [r["tokens_per_s"] for r in runs],
            "host_us_per_session_step_repeats": [r["host_us_per_session_step"] for r in runs]}


def _cpu_clock(worker) -> int | None:
    """The CPU-time clock of the in-process drafting thread (None without one, or where a
    thread's clock cannot be read: ``time.pthread_getcpuclockid`` is Unix's)."""
    if worker is None or worker.ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    try:
        return time.pthread_getcpuclockid(worker.ident)
    except OSError:
        return None


def _cpu_s(clock: int | None) -> float:
    return time.clock_gettime(clock) if clock is not None else 0.0


def run_bench_host(args) -> int:
    from edgespec.runner.cpu_kind import cpu_kind
    from edgespec.runner.threads import set_threads

    settings = _settings(args)
    set_threads(1)
    print("bench-host: torch on 1 thread; the runner answers at once (InstantRunner); the heap "
          "alive once each engine is built is frozen out of the garbage collector's passes and "
          "its youngest generation collected less often, as a server's at start",
          file=sys.stderr, flush=True)
    rows = []
    for store, drafter, n in settings:
        print(f"bench-host: {store} store, drafter {drafter}, {n} session(s)", file=sys.stderr,
              flush=True)
        rows.append(median_run([measure(store, drafter, n, args.new_tokens, args.right)
                                for _ in range(args.repeats)]))
    report = {"config": {"new_tokens": args.new_tokens, "right": args.right, "threads": 1,
                         "gc": "the heap alive once each engine is built frozen (gc.freeze), "
                               "the youngest generation's threshold raised "
                               "(process_heap.YOUNG_THRESHOLD), as a server's at start",
                         "repeats": args.repeats, "cpu": cpu_kind().as_json()},
              "results": rows}
    print(f"machine: {cpu_kind().describe()}")
    print(format_table(report))
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json_out}", file=sys.stderr)
    return 0


def format_table(report: dict) -> str:
    head = (f"{'store':<6} {'drafter':<14} {'sess':>4} {'tok/s':>8} {'host us/step':>12} "
            f"{'us/sess-step':>12} {'cpu: verifier':>13} {'drafter':>7}  "
            + " ".join(f"{s:>7}" for s in (*STAGES, "runner")))
    lines = [head, "(us/sess-step: wall; cpu: each thread's CPU microseconds a session-step; "
                   "stage columns: wall microseconds a step, from a second run with a stopwatch "
                   "around each stage, the totals from one without)"]
    for r in report["results"]:
        us = r["us_per_step"]
        lines.append(
            f"{r['store']:<6} {r['drafter']:<14} {r['sessions']:>4} "
            f"{r['tokens_per_s'] or 0:>8.0f} {r['host_us_per_step']:>12.0f} "
            f"{r['host_us_per_session_step']:>12.1f} "
            f"{r['verifier_cpu_us_per_session_step']:>13.1f} "
            f"{_or_dash(r['drafter_cpu_us_per_session_step']):>7}  "
            + " ".join(f"{us[s]:>7.0f}" for s in (*STAGES, "runner")))
    lines += ["", f"host us/sess-step of each repeat (each the median of its engine's "
                  f"{PLAIN_RUNS} runs; the table's is the repeat of median tokens/s)"]
    for r in report["results"]:
        lines.append(f"{r['store']:<6} {r['drafter']:<14} {r['sessions']:>4}  "
                     + " ".join(f"{x:.1f}" for x in r["host_us_per_session_step_repeats"]))
    lines += ["", "the verifier thread's CPU microseconds a step, by stage (in process the "
                  "wall above also holds the drafting thread's turns; verify: its host part)",
              f"{'store':<6} {'drafter':<14} {'sess':>4}  " + " ".join(f"{s:>7}" for s in STAGES)]
    for r in report["results"]:
        cpu = r["cpu_us_per_step"]
        lines.append(f"{r['store']:<6} {r['drafter']:<14} {r['sessions']:>4}  "
                     + " ".join(f"{cpu[s]:>7.0f}" for s in STAGES))
    return "\n".join(lines)


def _or_dash(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"
