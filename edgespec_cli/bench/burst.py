"""``edgespec bench-burst``: a burst of arrivals against running streams, the verifier's way of
prefilling them compared in one run.

In process, the product's own scheduler and engine over the target (``--model``), target-only
unless ``--drafter``: ``--streams`` sessions stream; once all of them run (their prompts in)
and each has had ``--steady-tokens`` more tokens (the steady gaps: no prefill among them),
``--burst`` requests of ``--prompt-tokens`` (a range: Spec-Bench questions joined and cut to a
length drawn in it) arrive at once, each asking ``--burst-tokens`` tokens. Per mode
(``--modes``):

- ``serial``: every waiting prompt prefilled alone, all of them before the next step (how the
  verifier admitted before chunked prefill);
- ``batched``: all of them before the next step, in shared forwards;
- ``chunked``: the product's default, ``--prefill-budget`` prompt tokens a step in shared
  forwards, the streams verified in every step.

It prints and writes (``--json``) the burst's time to first token (p50, p99, max), the running
streams' inter-token gap before the burst (steady p50) and during it (p99, max, and the max
against the steady p50), what a verification step cost apart from its prefill before the
burst and during it and what a step's prefill cost during it (p50s: the streams' forward grows
with their contexts, which lengthen by a token a step while the burst is taken in), and whether
every burst output is the same in every mode (the serial one is the reference; with
``--prompt-logprobs``, the burst's requests ask for their prompts' logprobs, an evaluation
harness's scoring requests, and those are compared too). Torch runs on
``--threads`` threads (default: all cores).
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from edgespec.config import ConfigError

from ..simulate.report import nearest_rank

MODES = ("serial", "batched", "chunked")
WAIT_S = 600


def add_bench_burst_args(p) -> None:
    p.add_argument("--streams", type=int, default=16,
                   help="sessions streaming when the burst comes (default: %(default)s)")
    p.add_argument("--burst", type=int, default=64,
                   help="requests arriving at once (default: %(default)s)")
    p.add_argument("--prompt-tokens", metavar="LO-HI", default="100-300",
                   help="the burst's prompt lengths, drawn uniformly (default: %(default)s)")
    p.add_argument("--burst-tokens", type=int, default=4,
                   help="tokens each burst request asks for (default: %(default)s)")
    p.add_argument("--steady-tokens", type=int, default=8,
                   help="tokens every stream gets once all of them run (their prompts in) and "
                        "before the burst comes: the steady gaps (default: %(default)s)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, of {', '.join(MODES)} (default: %(default)s)")
    p.add_argument("--prefill-budget", type=int, default=None, metavar="TOKENS",
                   help="chunked mode's prompt tokens a step (default: the engine's)")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                   help="the burst's requests ask for their prompts' logprobs with K "
                        "alternatives each (the completions' echo: an evaluation harness's "
                        "scoring requests); every mode's are compared too (default: none)")
    p.add_argument("--drafter", default="none",
                   help="the in-process drafter, 'none' for target-only (default: %(default)s)")
    p.add_argument("--json", dest="json_out", default="bench-results/burst.json", metavar="FILE",
                   help="where to write the JSON results (default: %(default)s)")


@dataclass
class BurstResult:
    mode: str
    prefill_budget: int | None  # None: every waiting prompt before the next step
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_max_s: float
    steady_gap_p50_s: float  # the streams' inter-token gap before the burst, all of them running
    burst_gap_p99_s: float  # ... and while the burst's first tokens were coming
    burst_gap_max_s: float
    gap_max_vs_steady: float
    prompt_tokens: int
    burst_s: float  # from the burst's arrival to its last first token
    forward_before_p50_s: float  # a step's forward + verification, the last steps before it
    forward_during_p50_s: float  # ... and during the burst
    prefill_during_p50_s: float  # a step's prefill during the burst (steps with prompts waiting)
    outputs: list[list[int]]
    prompt_logprobs: list  # each burst request's (None where not asked for)

    @property
    def prompt_logprob_entries(self) -> int:
        """How many prompt logprobs the burst's requests got in all."""
        return sum(len(p) for p in self.prompt_logprobs if p is not None)


@dataclass
class StepTimes:
    at: float  # monotonic, when the step returned
    prefill_s: float | None  # None: no prompt was waiting
    forward_s: float | None  # None: nothing was verified


BEFORE_STEPS = 32  # the steps before the burst whose forward is its reference


def _percentile(xs: list[float], q: float) -> float:
    """The nearest-rank percentile (``q`` in (0, 1]), as every report of the project takes it;
    0 of none."""
    got = nearest_rank(xs, 100 * q)
    return 0.0 if got is None else got


def burst_prompts(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of lengths drawn in [lo, hi]: Spec-Bench questions joined, then cut."""
    from .run import load_questions

    texts = [q["prompt"] for q in load_questions([], 0, full=True)]
    pool = [t for q in texts for t in tokenizer.encode(q + "\n")]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        at = rng.randrange(0, len(pool) - length)
        out.append(pool[at:at + length])
    return out


def _timed_steps(engine, steps: list[StepTimes]) -> None:
    """Record each of the engine's steps: its prefill time (when prompts were waiting) and its
    forward's."""
    step = engine.step

    def timed():
        waiting = len(engine.prefilling) > 0
        report = step()
        steps.append(StepTimes(time.monotonic(), engine.prefill_s if waiting else None,
                               None if report is None else report.forward_s))
        return report

    engine.step = timed


def _step_p50s(steps: list[StepTimes], steady_from: float, came: float, done: float
               ) -> tuple[float, float, float]:
    """p50 of the forward in the steady steps before ``came`` (the last BEFORE_STEPS), of the
    forward and of the prefill in the steps between ``came`` and ``done``."""
    before = [s.forward_s for s in steps
              if steady_from < s.at <= came and s.forward_s is not None]
    during = [s for s in steps if came < s.at <= done]
    return (_percentile(before[-BEFORE_STEPS:], 0.5),
            _percentile([s.forward_s for s in during if s.forward_s is not None], 0.5),
            _percentile([s.prefill_s for s in during if s.prefill_s is not None], 0.5))


def _serial(runner) -> None:
    """The runner prefills every prompt alone (before shared prefill, each admission was)."""
    parts = runner.prefill_parts

    def alone(slots, rows, reads=None):
        for i, (slot, row) in enumerate(zip(slots, rows)):
            parts([slot], [row], reads=[None if reads is None else reads[i]])

    runner.prefill_parts = alone


def run_burst(loaded, mode: str, streams: list[list[int]], burst: list[list[int]], args
              ) -> BurstResult:
    from edgespec.config import EngineConfig
    from edgespec.drafters import build_drafter
    from edgespec.engine.spec_engine import Request, SpecEngine
    from edgespec.runner.target_runner import TargetRunner
    from verifier_node.scheduler import Scheduler
    from verifier_node.tickets import Ticket

    longest = max(len(p) for p in streams + burst)
    max_len = longest + args.steady_tokens + 2048
    runner = TargetRunner(loaded.model, n_slots=len(streams) + len(burst), max_len=max_len)
    if mode == "serial":
        _serial(runner)
    budget = (EngineConfig().prefill_budget if args.prefill_budget is None
              else args.prefill_budget) if mode == "chunked" \
        else None
    cfg = EngineConfig(max_sessions=len(streams) + len(burst), max_context=max_len,
                       prefill_budget=10 ** 9 if budget is None else budget)
    drafter = build_drafter(args.drafter, loaded, runner, device=args.device)
    arrivals: dict[str, list[float]] = {}
    steps: list[StepTimes] = []
    with SpecEngine(runner, drafter, cfg, stop_ids=set()) as engine:
        _timed_steps(engine, steps)
        sched = Scheduler(engine, max_queue=len(streams) + len(burst))
        sched.start()
        try:
            warm = sched.submit(Ticket(Request(streams[0], 2), None))
            _wait(lambda: warm.ended)
            running = [_follow(sched.submit(Ticket(Request(p, max_len - len(p) - 64), None)),
                               arrivals) for p in streams]
            # steady: every stream running (its own prompt in), then steady_tokens more each
            _wait(lambda: all(t.tokens for t in running))
            steady_from = time.monotonic()
            had = [len(t.tokens) for t in running]
            _wait(lambda: all(len(t.tokens) >= n + args.steady_tokens
                              for t, n in zip(running, had)))
            came = time.monotonic()
            tickets = [Ticket(Request(p, args.burst_tokens,
                                      prompt_logprobs=args.prompt_logprobs), None)
                       for p in burst]
            firsts = {t.session_id: _first_token_at(t) for t in tickets}  # before any token
            for t in tickets:
                sched.submit(t)
            _wait(lambda: all(firsts[t.session_id] or t.ended for t in tickets))
            done = time.monotonic()
            for t in running:
                sched.cancel(t.session_id)
            _wait(lambda: all(t.ended for t in tickets + running))
        finally:
            sched.stop()
    errors = [t.error for t in tickets if t.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} burst request(s) failed: {errors[0]!r}")
    ttft = [firsts[t.session_id][0] - came for t in tickets]
    steady, during = split_gaps(arrivals, steady_from, came, done)
    steady_p50 = _percentile(steady, 0.5)
    return BurstResult(mode, budget, _percentile(ttft, 0.5), _percentile(ttft, 0.99), max(ttft),
                       steady_p50, _percentile(during, 0.99), max(during, default=0.0),
                       max(during, default=0.0) / steady_p50 if steady_p50 else 0.0,
                       sum(len(p) for p in burst), done - came,
                       *_step_p50s(steps, steady_from, came, done),
                       [t.result.token_ids if t.result else [] for t in tickets],
                       [t.result.prompt_logprobs if t.result else None for t in tickets])


def split_gaps(arrivals: dict[str, list[float]], steady_from: float, came: float, done: float
               ) -> tuple[list[float], list[float]]:
    """The streams' inter-token gaps (``arrivals``: each stream's token times) that are steady
    (between ``steady_from``, when every stream ran, and the burst's arrival ``came``) and those
    that end while the burst's first tokens come (after ``came``, by ``done``); the gaps of the
    streams' own prefill, before ``steady_from``, are neither."""
    steady, during = [], []
    for times in arrivals.values():
        for a, b in zip(times, times[1:]):
            if b <= came:
                if a >= steady_from:
                    steady.append(b - a)
            elif b <= done:
                during.append(b - a)
    return steady, during


def _wait(done, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError("the burst did not finish in time")
        time.sleep(0.002)


def _follow(ticket, arrivals: dict[str, list[float]]):
    """Record when each of the ticket's chunks of tokens arrives."""
    times = arrivals.setdefault(ticket.session_id, [])
    seen = [0]

    def on_change() -> None:
        if len(ticket.tokens) > seen[0]:
            seen[0] = len(ticket.tokens)
            times.append(time.monotonic())

    ticket.listeners.append(on_change)
    return ticket


def _first_token_at(ticket) -> list[float]:
    """A list that gets the time of the ticket's first token."""
    at: list[float] = []
    lock = threading.Lock()

    def on_change() -> None:
        with lock:
            if ticket.tokens and not at:
                at.append(time.monotonic())

    ticket.listeners.append(on_change)
    return at


def run_bench_burst(args) -> int:
    from edgespec.models.loading import load_model
    from edgespec_cli.cli_args import set_threads, threads_in_use

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise ConfigError(f"--modes must name some of {', '.join(MODES)}, got {args.modes!r}")
    try:
        lo, hi = (int(x) for x in args.prompt_tokens.split("-"))
    except ValueError:
        raise ConfigError(f"--prompt-tokens must be LO-HI, got {args.prompt_tokens!r}") from None
    for value, option in ((lo, "--prompt-tokens' LO"), (args.streams, "--streams"),
                          (args.burst, "--burst"), (args.burst_tokens, "--burst-tokens"),
                          (args.steady_tokens, "--steady-tokens")):
        if value < 1:
            raise ConfigError(f"{option} must be >= 1, got {value}")
    if hi < lo:
        raise ConfigError(f"--prompt-tokens must be LO-HI with LO <= HI, got "
                          f"{args.prompt_tokens!r}")
    if args.prompt_logprobs is not None:
        from edgespec.protocol.token_logprob import check_top_logprobs

        check_top_logprobs(args.prompt_logprobs, "--prompt-logprobs")
    if args.prefill_budget is not None and args.prefill_budget < 1:  # before any mode runs
        raise ConfigError(f"--prefill-budget must be >= 1, got {args.prefill_budget}")
    from edgespec.drafters.spec_check import check_drafter_arg

    check_drafter_arg(args.drafter)  # before the model loads and a mode runs (was after one)
    threads = set_threads(args.threads)
    loaded = load_model(args.model, args.device, args.dtype)
    threads = threads_in_use() or threads  # a default lowered where the dtype was not exact
    streams = burst_prompts(loaded.tokenizer, args.streams, 20, 60, seed=1)
    burst = burst_prompts(loaded.tokenizer, args.burst, lo, hi, seed=2)
    results = []
    for mode in modes:
        print(f"bench-burst: {mode}: {args.streams} streams, a burst of {args.burst}",
              file=sys.stderr, flush=True)
        results.append(run_burst(loaded, mode, streams, burst, args))
    first = results[0]
    same = [(r.outputs, r.prompt_logprobs) == (first.outputs, first.prompt_logprobs)
            for r in results]
    print(f"torch threads: {threads}; {args.streams} streams, a burst of {args.burst} prompts "
          f"({results[0].prompt_tokens} tokens), {args.burst_tokens} tokens each")
    print(f"{'mode':<9}{'budget':>8}{'ttft p50':>10}{'p99':>8}{'max':>8}"
          f"{'gap p50':>10}{'burst p99':>11}{'max':>8}{'max/p50':>9}"
          f"{'fwd before':>12}{'during':>8}{'prefill':>9}  identical")
    for r, identical in zip(results, same):
        print(f"{r.mode:<9}{r.prefill_budget or '-':>8}{r.ttft_p50_s:>10.3f}{r.ttft_p99_s:>8.3f}"
              f"{r.ttft_max_s:>8.3f}{r.steady_gap_p50_s:>10.3f}{r.burst_gap_p99_s:>11.3f}"
              f"{r.burst_gap_max_s:>8.3f}{r.gap_max_vs_steady:>9.1f}"
              f"{r.forward_before_p50_s:>12.3f}{r.forward_during_p50_s:>8.3f}"
              f"{r.prefill_during_p50_s:>9.3f}  {identical}")
    print("seconds; gap: the streams' inter-token gap; fwd: a step's forward + verification, p50 "
          "of the last steps before the burst and of those during it; prefill: a step's prefill "
          "during it, p50")
    out = {"config": {k: v for k, v in vars(args).items() if k != "func"},
           "threads": threads,
           "results": [{**{k: v for k, v in asdict(r).items()
                           if k not in ("outputs", "prompt_logprobs")},
                        "prompt_logprob_entries": r.prompt_logprob_entries,
                        "identical_to_first": identical} for r, identical in zip(results, same)]}
    path = Path(args.json_out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return 0 if all(same) else 1
