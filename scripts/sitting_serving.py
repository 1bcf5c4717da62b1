"""The GPU sitting's serving stages (``gpu_sitting``): (b) ``e2e``, one stream target-only and
with MaG + Cacheback, and ``lossless``, 8 sessions batched against each decoded alone; (c)
``hf``, transformers' compiled static-cache ``generate``; (d) ``fleet``, 16-64 sessions with MaG
batched against the same target-only batched and one a forward, each step's time split.
``s`` is the sitting (``gpu_sitting.Sitting``): its device, dry-run flag, budget and data."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import torch

from edgespec.config import EngineConfig, SamplingParams
from edgespec.drafters import build_drafter
from edgespec.engine.spec_engine import Request, SpecEngine
from sitting_common import runner_for, say, sync


def stage_e2e(s, shape: str, model) -> None:
    """(b) one stream, target-only and MaG + Cacheback, graphs on, each step's time split as
    the fleet's (``timed_generate``: the host's share of a step); then 8 sessions lossless."""
    new = 128 if not s.dry else 6
    rng = random.Random(f"e2e-{shape}")
    prompt = [1] + [rng.randrange(3, model.config.vocab_size) for _ in range(40)]
    runner = runner_for(s, model, 1, 256, graphs=True)
    cfg = EngineConfig(max_sessions=1, max_context=256)
    row: dict = {}
    outs = {}
    # target-only with each step launched before the last one's verdicts are read (the
    # default on CUDA, set here so that a dry run on the CPU runs it too: decode_ahead) and
    # without (each step after the host's work)
    for name, spec, engine_cfg in (
            ("target_only", None, replace(cfg, decode_ahead=True)),
            ("target_only_no_ahead", None, replace(cfg, decode_ahead=False)),
            ("mag_cacheback", "mag+cacheback", cfg)):
        with SpecEngine(runner, build_drafter(spec) if spec else None, engine_cfg,
                        stop_ids=set()) as engine:
            engine.generate(Request(prompt, 8))  # warm-up
            (tokens,), dt, split = timed_generate(engine, [Request(prompt, new)], s.device)
        outs[name] = tokens
        row[f"{name}_tok_s"] = round(len(tokens) / dt, 1)
        row[f"{name}_ms_step"] = round(1000 * dt / max(1, split["steps"]), 2)
        row[f"{name}_ms_a_step"] = split["ms_a_step"]  # where a step's time goes, host and device
        row[f"{name}_ahead"] = split["ahead"]
    row["identical"] = outs["target_only"] == outs["mag_cacheback"] == \
        outs["target_only_no_ahead"]
    if not row["identical"]:
        s.mismatch(f"{shape}: the one-stream outputs differ (target-only run ahead and not, "
                   f"MaG + Cacheback)")
    s.data["e2e"][shape] = row
    say(f"   {shape}: {row}")
    del runner
    lossless(s, shape, model)


def lossless(s, shape: str, model) -> None:
    n_prompts, new = (8, 32) if not s.dry else (2, 5)
    runner = runner_for(s, model, n_prompts, 160, graphs=True)
    rng = random.Random(shape)
    prompts = [[1] + [rng.randrange(3, runner.vocab_size) for _ in range(rng.randint(8, 60))]
               for _ in range(n_prompts)]
    cfg = EngineConfig(max_sessions=n_prompts, max_context=160)
    identical = total = 0
    for sampled in (False, True):
        params = [SamplingParams(temperature=0.8, seed=i) if sampled else SamplingParams()
                  for i in range(n_prompts)]
        with SpecEngine(runner, None, cfg, stop_ids={2}) as engine:
            refs = [engine.generate(Request(p, new, q)).token_ids
                    for p, q in zip(prompts, params)]
        for spec in ("mag", "mag+cacheback"):
            with SpecEngine(runner, build_drafter(spec), cfg, stop_ids={2}) as engine:
                got = engine.generate_many([Request(p, new, q) for p, q in zip(prompts, params)])
            identical += sum(r.token_ids == ref for r, ref in zip(got, refs))
            total += len(refs)
    s.data["lossless"][shape] = {"identical": identical, "total": total, "tokens": new,
                                 "graph_replays": runner.graphs.replays}
    if identical != total:
        s.mismatch(f"{shape}: {total - identical} of {total} speculative outputs differ")
    say(f"   {shape}: {identical} of {total} speculative outputs identical to target-only "
        f"({runner.graphs.replays} steps replayed)")


def timed_generate(engine: SpecEngine, reqs: list[Request], device: str
                   ) -> tuple[list[list[int]], float, dict]:
    """``generate_many`` timed: the outputs, the seconds, and each step's time split (ms a
    step): prefill (the prompts', at admission and in the steps), plan + take + propose,
    forward + verification (the device's work and the step's one sync), place + commit, and
    the rest (deciding each row's verdict, the loop's own). A prefill's kernels run while the
    host goes on (``host_transfers``: no wait), so here each prefill is waited for, to be
    timed apart (the split's ``prefill_s``: seconds in all). The split's ``ahead``: the decode
    steps launched a step ahead, claimed and dropped (``engine.decode_ahead``)."""
    split = {"prefill": 0.0, "plan_take_propose": 0.0, "forward_verify": 0.0,
             "place_commit": 0.0}
    steps = [0]
    step, advance = engine.step, engine.prefilling.advance

    def prefilled(budget):
        t = time.perf_counter()
        progress = advance(budget)
        sync(device)
        split["prefill"] += time.perf_counter() - t
        return progress

    def counted():
        report = step()
        steps[0] += 1
        if report is not None:
            split["plan_take_propose"] += report.take_s
            split["forward_verify"] += report.forward_s
            split["place_commit"] += report.commit_s
        return report

    engine.step = counted  # type: ignore[method-assign]
    engine.prefilling.advance = prefilled  # type: ignore[method-assign]
    counts = (engine.ahead.launched, engine.ahead.claimed, engine.ahead.dropped)
    sync(device)
    t = time.perf_counter()
    try:
        out = [r.token_ids for r in engine.generate_many(reqs)]
        sync(device)
    finally:
        engine.step, engine.prefilling.advance = step, advance  # type: ignore[method-assign]
    wall = time.perf_counter() - t
    n = max(1, steps[0])
    ms = {k: round(1e3 * v / n, 3) for k, v in split.items()}
    ms["rest"] = round(1e3 * wall / n - sum(ms.values()), 3)
    ahead = engine.ahead
    return out, wall, {"steps": steps[0], "ms_a_step": ms,
                       "prefill_s": round(split["prefill"], 4),
                       "ahead": {"launched": ahead.launched - counts[0],
                                 "claimed": ahead.claimed - counts[1],
                                 "dropped": ahead.dropped - counts[2]}}


def stage_fleet(s, shape: str, model) -> None:
    """(d) 16, 32 and 64 sessions: MaG drafts batched, the same sessions target-only batched
    (one token a session a step: a server without edge drafting) and, at 16 and 32, one session
    a forward; the same outputs every way; each batched run's step split into prefill, host
    and device time (``timed_generate``)."""
    new = 32 if not s.dry else 4
    counts = (16, 32, 64) if not s.dry else (2, 3)
    alone_counts = (16, 32) if not s.dry else (2,)
    runner = runner_for(s, model, max(counts), 128, graphs=True)
    rng = random.Random(f"fleet-{shape}")
    prompts = [[1] + [rng.randrange(3, runner.vocab_size) for _ in range(rng.randint(10, 50))]
               for _ in range(max(counts))]
    out: dict = {}
    for n in counts:
        reqs = [Request(p, new) for p in prompts[:n]]
        cfg = EngineConfig(max_sessions=n, max_context=128)
        row: dict = {"sessions": n}
        # target-only with decode_ahead as on CUDA by default (set: a dry run on the CPU runs
        # it too), then each step launched after the host's work on the last
        plain_runs = {}
        for ahead in (True, False):
            with SpecEngine(runner, None, replace(cfg, decode_ahead=ahead),
                            stop_ids=set()) as plain:
                plain.generate(Request(prompts[0], 4))  # warm-up
                plain_runs[ahead] = timed_generate(plain, reqs, s.device)
        (target_only, plain_s, plain_split), (one_at_a_time, _, one_split) = \
            plain_runs[True], plain_runs[False]
        with SpecEngine(runner, build_drafter("mag"), cfg, stop_ids=set()) as engine:
            engine.generate(Request(prompts[0], 4))  # warm-up
            together, batched_s, mag_split = timed_generate(engine, reqs, s.device)
            alone, alone_s = None, None
            if n in alone_counts:
                sync(s.device)
                t = time.perf_counter()
                alone = [engine.generate(r).token_ids for r in reqs]
                sync(s.device)
                alone_s = time.perf_counter() - t
        tokens = sum(len(x) for x in together)
        row.update(_decode_against_step(s, shape, n, _decode_rate(*plain_runs[True])))
        row["target_only_no_ahead_decode_tokens_per_s"] = round(
            _decode_rate(*plain_runs[False]), 1)
        row.update({"tokens": tokens, "batched_s": round(batched_s, 2),
                    "target_only_batched_s": round(plain_s, 2),
                    "mag_over_target_only": round(plain_s / batched_s, 2),
                    "target_only_tokens_per_s": round(tokens / plain_s, 1),
                    "mag": mag_split, "target_only": plain_split,
                    "target_only_no_ahead": one_split,
                    "identical": together == target_only == one_at_a_time and
                    alone in (None, together)})
        if alone_s is not None:
            row.update({"one_a_forward_s": round(alone_s, 2),
                        "throughput_ratio": round(alone_s / batched_s, 2)})
        out[str(n)] = row
        if not row["identical"]:
            s.mismatch(f"{shape}: {n} sessions batched (MaG, target-only) and one a forward "
                       f"differ")
        say(f"   {shape} fleet {n}: {row}")
    s.data["fleet"][shape] = out


def _decode_rate(outs: list[list[int]], wall: float, split: dict) -> float:
    """A ``timed_generate`` run's tokens a second with its prefill left out."""
    return sum(map(len, outs)) / (wall - split["prefill_s"])


def _decode_against_step(s, shape: str, n: int, decode_tok_s: float) -> dict:
    """The target-only batched steps' tokens a second (prefill left out) and, where the
    ``graphs`` stage timed the graphed n x 1 step, their share of n / that step's time (what a
    server's decoding could reach if the step were all it did)."""
    out: dict = {"target_only_decode_tokens_per_s": round(decode_tok_s, 1)}
    step = [r["ms"] for r in s.data.get("forward", [])
            if r.get("shape") == shape and (r.get("sessions"), r.get("tokens")) == (n, 1)]
    if step:
        out["target_only_decode_vs_step"] = round(decode_tok_s / (n / (step[0] / 1e3)), 2)
    return out


def stage_hf(s, shape: str, model) -> None:
    """(c) transformers' compiled static-cache generate, warm-up as long as the timed run."""
    new = 128 if not s.dry else 4
    if s.elapsed() > s.budget_s:
        s.data["hf"][shape] = {"skipped": "the sitting's time budget was spent"}
        return
    rng = random.Random(f"e2e-{shape}")
    prompt = [1] + [rng.randrange(3, model.config.vocab_size) for _ in range(40)]
    ids = torch.tensor([prompt], device=s.device)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(ids, **kw)  # compiles; as long as the timed run
        sync(s.device)
        warm = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        sync(s.device)
        dt = time.perf_counter() - t
    s.data["hf"][shape] = {"static_compiled_tok_s": round((out.shape[1] - ids.shape[1]) / dt, 1),
                           "warmup_s": round(warm, 1)}
    say(f"   {shape}: {s.data['hf'][shape]}")
