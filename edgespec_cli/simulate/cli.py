"""``edgespec simulate``: the runs its options (``options``) ask for, the losslessness check,
the report."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace

from edgespec.config import ConfigError

from ..deployment.link_faults import parse_fault_schedule
from .options import (CAPACITY_REQUESTS, add_simulate_parser, check_args, check_slo, cpu_split,
                      parse_devices)
from .records import SERVER_ONLY

REAL_PARTS = ["verifier (the real model, batched verification)",
              "draft cache (gRPC service + embedded redis-server)",
              "drafters (real drafter agents in Ray actors)", "gRPC over loopback sockets",
              "Ray (a local cluster, or the one at --address)", "clients (the edgespec SDK)"]


def load_prompts(target, seed: int, max_new_tokens: int):
    """Spec-Bench first turns in a seeded order, those that fit the context with their
    output (a verifier slot holds EngineConfig.max_context tokens)."""
    import random

    from edgespec.config import EngineConfig
    from edgespec.models.loading import encode_prompt

    from ..bench.run import load_questions
    from .run import Prompt

    limit = min(EngineConfig().max_context,
                getattr(target.model.config, "max_position_embeddings", None) or 10**9)
    questions = load_questions([], 0, full=True)
    random.Random(seed).shuffle(questions)
    prompts = [Prompt(q["category"], encode_prompt(target.tokenizer, q["prompt"]))
               for q in questions]
    fitting = [p for p in prompts if len(p.ids) + max_new_tokens <= limit]
    if not fitting:
        raise ConfigError(f"no Spec-Bench prompt fits {limit} tokens with --max-new-tokens "
                          f"{max_new_tokens}")
    return fitting


def add_simulate_command(sub) -> None:
    add_simulate_parser(sub).set_defaults(func=cmd_simulate)


def start_ray(address: str | None) -> None:
    import ray

    from ..deployment import cluster
    from ..terminated import keeping_sigterm

    if address:
        cluster.connect(address, namespace="edgespec-simulate")
        return
    print("simulate: starting a local Ray cluster", file=sys.stderr, flush=True)
    # "local": a cluster of its own. With no address, ray.init joins the cluster a `ray start`
    # on this machine last recorded (/tmp/ray), and that cluster's stop cancels the fleet.
    with keeping_sigterm():  # ray.init's handler would exit 15 without the cleanup's line
        ray.init(address="local", namespace="edgespec-simulate", include_dashboard=False,
                 log_to_driver=False, configure_logging=False, logging_level=logging.WARNING)


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run the fleet (each device count, batching on and/or off), check the outputs against
    target-only, and report (or, with --project-on, project one)."""
    if args.project_on:
        return cmd_project(args)
    _prepare_ray_env(args)
    counts, profiles = check_args(args)
    try:
        import matplotlib  # noqa: F401
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError("edgespec simulate needs Ray and matplotlib, the fleet extra: "
                          "pip install -e '.[fleet]' in the edgespec repository") from None
    from edgespec_cli.cli_args import set_threads
    from edgespec.config import EngineConfig
    from edgespec.models.loading import load_model

    from . import report as rep
    from .check import check_lossless

    split = cpu_split(args)
    set_threads(args.threads)
    print("simulate: loading the model for prompts and the losslessness check",
          file=sys.stderr, flush=True)
    target = load_model(args.model, device=args.device, dtype=args.dtype)
    check_fleet_fits(target, args.max_devices if args.find_capacity else max(counts))
    modes = ["on", "off"] if args.batching == "both" else [args.batching]
    if args.baseline == SERVER_ONLY:
        modes.append(SERVER_ONLY)
    if split is not None:
        from ..deployment.cpu_share import pin_process

        print(f"simulate: {split.describe()}", file=sys.stderr, flush=True)
        # this process (the clients, their links' relays) and the Ray processes it starts on
        # the boards' cores; the server's actors move themselves to the server's
        pin_process(split.boards)
    start_ray(args.address)
    runs, capacity, probes = _run_fleets(args, counts, profiles, modes,
                                         _settings(args, target.dtype, split),
                                         load_prompts(target, args.seed, args.max_new_tokens))
    lossless = check_lossless(target, runs, args.max_new_tokens)  # every run, whatever its mode
    emulated = {p.name: {"drafter": p.drafter, "compute_slowdown": p.compute_slowdown,
                         "tokens_per_s": p.tokens_per_s,
                         "link": p.link.describe(), "how": "TCP delaying proxy (LinkProxy) on "
                         "the drafter's link to the cache and the client's link to the "
                         "verifier; drafting slowed by sleeping (slowdown - 1) x its time, or "
                         "paced to at most tokens_per_s where given"}
                for p in profiles}
    config = {k: v for k, v in vars(args).items() if k != "func"}
    # the verifier's fill as it ran: its default when not given ("auto": mag with boards)
    config["fill_drafts"] = args.fill_drafts or EngineConfig().fill_drafts
    config["cpu_split"] = split.describe() if split else "shared"
    report = rep.build_report(runs, lossless=lossless, emulated=emulated, real=REAL_PARTS,
                              config=config)
    if args.find_capacity:
        rep.add_capacity(report, capacity, args.slo, probes)
    _write_outputs(args, report)
    if lossless["mismatches"]:
        print("simulate: error: an output differs from target-only decoding", file=sys.stderr)
        return 1
    if not lossless["ok"]:
        print("simulate: warning: some devices finished no request, so their output was not "
              "checked (see error_samples in the report)", file=sys.stderr)
    return 0


def check_fleet_fits(target, devices: int) -> None:
    """The verifier's KV cache, a slot a device, must fit this machine's memory: refused before
    Ray starts a process (100,000 devices had started to start as many)."""
    import torch

    from edgespec.config import EngineConfig
    from edgespec.runner.kernel_set import HeadLayout
    from edgespec.runner.kv_cache import check_cache_fits

    cfg = target.model.config
    heads = HeadLayout.of_config(cfg)
    try:
        check_cache_fits(cfg.num_hidden_layers, devices, EngineConfig().max_context,
                         heads.kv_heads, heads.head_dim, target.model.dtype,
                         torch.device(target.model.device),
                         advice="simulate fewer devices (--devices, --max-devices)")
    except ConfigError as e:
        raise ConfigError(f"{devices} devices need a verifier with as many KV slots: {e}") \
            from None


def cmd_project(args: argparse.Namespace) -> int:
    """--project-on: the fleet on a GPU server, projected (``projection``); no fleet runs."""
    import json

    from . import projection as proj
    from .report import write_json

    counts = parse_devices(args.devices)
    check_slo(args.slo)
    try:
        with open(args.project_on) as f:
            sitting = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--project-on {args.project_on}: {e}") from None
    traces = proj.traces_from_bench_edge(args.acceptance_from) + \
        proj.parse_acceptance(args.acceptance)
    if not traces:
        raise ConfigError("--project-on needs drafters: --acceptance-from bench-edge JSON "
                          "files, or --acceptance NAME=ALPHA")
    report = proj.build_projection(sitting, args.shape or "8b", traces, counts, args.slo,
                                   args.max_devices)
    report["sitting"] = args.project_on
    print(proj.format_projection(report))
    if args.json:
        print(f"simulate: projection written to {write_json(report, args.json)}",
              file=sys.stderr)
    return 0


def _prepare_ray_env(args: argparse.Namespace) -> None:
    if not args.address:  # a local cluster on loopback only (see docs/architecture.md)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    else:
        from ..deployment.cluster import use_token_auth_if_present

        use_token_auth_if_present()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _settings(args: argparse.Namespace, dtype: str, split=None):
    from .run import SimSettings

    return SimSettings(model=args.model, max_new_tokens=args.max_new_tokens, cpus=split,
                       requests=args.requests, duration_s=args.duration, rate=args.rate,
                       threads=args.threads, dtype=dtype, device=args.device, seed=args.seed,
                       timeout_s=args.timeout, tree_width=args.tree_width,
                       link_faults=parse_fault_schedule(args.link_faults),
                       engine={**({"max_batch_tokens": args.max_batch_tokens}
                                  if args.max_batch_tokens else {}),
                               **({"head": args.head} if args.head else {}),
                               **({"rest_drafters": False} if args.keep_drafting else {}),
                               **({"fill_drafts": args.fill_drafts} if args.fill_drafts else {}),
                               **({"cuda_graphs": args.cuda_graphs}
                                  if args.cuda_graphs is not None else {})})


def _run_fleets(args: argparse.Namespace, counts, profiles, modes: list[str], settings,
                prompts) -> tuple[list, dict, list]:
    """The fleet runs: each device count per batching mode, or the capacity search. Returns
    (runs, capacity per mode, the capacity probes)."""
    from ..deploy import role_actors
    from ..deployment.device_profiles import fleet_profiles
    from .run import FleetRun

    roles = role_actors()

    def run_one(mode: str, n: int):
        fleet_of = fleet_profiles([p.name for p in profiles], n)
        run_settings = settings
        if args.find_capacity:  # --requests is per device there: every probe loads each alike
            run_settings = replace(settings,
                                   requests=(args.requests or CAPACITY_REQUESTS) * n)
        return FleetRun(roles, run_settings, fleet_of, mode, prompts).run()

    if not args.find_capacity:
        done = {}
        for mode, n, k in run_order(counts, modes, args.repeat):
            done[mode, n, k] = replace(run_one(mode, n), round=k, rounds=args.repeat)
        return [done[mode, n, k] for mode in modes for n in counts
                for k in range(1, args.repeat + 1)], {}, []
    runs, probes, capacity = [], [], {}
    for mode in modes:
        capacity[mode], tried = find_capacity(lambda n, m=mode: run_one(m, n), args.slo,
                                              args.max_devices)
        runs += [r for r, _ in tried]
        probes += [{"batching": mode, "devices": r.devices, "slowest_tokens_per_s": v}
                   for r, v in tried]
    return runs, capacity, probes


def run_order(counts: list[int], modes: list[str], repeat: int) -> list[tuple[str, int, int]]:
    """(mode, devices, round) in the order run: a device count's rounds one after another,
    each round its modes in turn, every other round in the reverse order. A machine's speed
    drifts over minutes (a step of the server alone 14% shorter half an hour later here): runs
    of the modes compared kept close, and alternated, put a drift on both sides alike (with an
    even ``repeat``, each mode first as often). The report lists them mode by mode."""
    order = []
    for n in counts:
        for k in range(1, repeat + 1):
            order += [(mode, n, k) for mode in (modes if k % 2 else modes[::-1])]
    return order


def _write_outputs(args: argparse.Namespace, report: dict) -> None:
    from . import report as rep
    from .report_text import format_table

    print(format_table(report))
    if args.json:
        print(f"simulate: report written to {rep.write_json(report, args.json)}",
              file=sys.stderr)
    if args.plot:
        from .charts import write_plots

        for path in write_plots(report, args.plot):
            print(f"simulate: chart {path}", file=sys.stderr)


def find_capacity(run, slo: float, max_devices: int):
    """The most devices whose slowest device still decodes at >= ``slo`` tokens/s: double
    until one fails, then bisect. Returns (capacity, [(run, slowest rate), ...])."""
    from .report import summarize_run

    tried = []

    def ok(n: int) -> bool:
        r = run(n)
        rates = [d["decode_tokens_per_s"] or 0.0 for d in summarize_run(r)["per_device"]]
        slowest = min(rates) if rates else 0.0
        tried.append((r, slowest))
        return len(rates) == n and slowest >= slo

    good, n = 0, 1
    while n <= max_devices and ok(n):
        good, n = n, n * 2
    bad = min(n, max_devices + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good, tried
