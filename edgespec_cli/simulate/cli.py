"""``edgespec simulate``: options, the runs they ask for, the losslessness check, the report."""

from __future__ import annotations

import argparse
import math
import logging
import os
import sys
from dataclasses import replace

from edgespec.config import ConfigError

from ..deployment.link_faults import parse_fault_schedule
from .records import SERVER_ONLY

REAL_PARTS = ["verifier (the real model, batched verification)",
              "draft cache (gRPC service + embedded redis-server)",
              "drafters (real drafter agents in Ray actors)", "gRPC over loopback sockets",
              "Ray (a local cluster, or the one at --address)", "clients (the edgespec SDK)"]


def add_simulate_command(sub) -> None:
    from edgespec_cli.cli_args import (SERVER_CORES_THREADS, THREADS_DEFAULT, add_dtype_arg,
                                       add_threads_arg, add_tree_width_arg)
    from ..deployment.device_profiles import PROFILES

    s = sub.add_parser("simulate", help="a whole fleet on one machine: real verifier, cache "
                                        "and drafters, emulated devices and links")
    s.add_argument("--devices", metavar="N[,N...]", default="4",
                   help="emulated devices; a comma list (1,2,4,8) sweeps device counts "
                        "(default: %(default)s)")
    s.add_argument("--profile", metavar="NAME[,NAME...]", default="rpi5",
                   help=f"device profile(s), comma-separated; a mixed fleet cycles through "
                        f"the list ({', '.join(PROFILES)}) (default: %(default)s)")
    how_long = s.add_mutually_exclusive_group()
    how_long.add_argument("--requests", type=int, default=None,
                          help="requests in all, dealt to devices in turn; with "
                               "--find-capacity, requests per device (default: 2 per device)")
    how_long.add_argument("--duration", metavar="S", type=float, default=None,
                          help="send requests for this many seconds instead")
    s.add_argument("--rate", metavar="R", type=float, default=None,
                   help="open loop: requests per second over the fleet (default: closed loop, "
                        "each device sends its next request when the last finishes)")
    s.add_argument("--batching", choices=["on", "off", "both"], default="both",
                   help="verify the devices' sessions batched in one forward (on), one session "
                        "per forward (off), or both on the same requests (default: %(default)s)")
    s.add_argument("--baseline", choices=["none", SERVER_ONLY], default="none",
                   help="server-only: also run the same requests through the verifier alone, "
                        "no boards, the sessions batched (one token a session a step): what a "
                        "user without edge drafting serves; the report gives edge drafting "
                        "(batching on) against it per device count (default: %(default)s)")
    s.add_argument("--server-cpus", metavar="CPUS", default=None,
                   help="cores of the verifier, the cache and its Redis, e.g. 0 or 0-3 "
                        "(default: the first half of this machine's cores; the verifier's "
                        "torch threads, unless --threads, one a core)")
    s.add_argument("--board-cpus", metavar="CPUS", default=None,
                   help="cores of the drafters (the emulated boards) and the clients "
                        "(default: the cores --server-cpus leaves)")
    s.add_argument("--shared-cpus", action="store_true",
                   help="run the server and the boards on every core, as before the split "
                        "(a drafter then takes its compute from the verifier)")
    s.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens per request (default: %(default)s)")
    s.add_argument("--model", metavar="M", default="default",
                   help="target model: 'default', a transformers directory or a .gguf file "
                        "(default: %(default)s)")
    s.add_argument("--json", metavar="FILE", default=None,
                   help="write the report, as JSON, to this file (default: none)")
    s.add_argument("--plot", metavar="DIR", default=None,
                   help="draw PNG charts into this folder: throughput and p99 inter-token latency "
                        "against device count, batching on against off, per-device acceptance "
                        "(default: none)")
    s.add_argument("--seed", metavar="S", type=int, default=0,
                   help="seeds the links' jitter and loss and the order of prompts "
                        "(default: %(default)s)")
    s.add_argument("--address", default=None, metavar="HEAD:PORT",
                   help="join this Ray cluster (its head's IP and Ray port, e.g. 10.8.0.1:6380) "
                        "instead of starting a local one")
    s.add_argument("--find-capacity", action="store_true",
                   help="add devices until the slowest one's tokens/s falls below --slo; "
                        "report the capacity with batching on and off")
    s.add_argument("--slo", metavar="TOK_S", type=float, default=None,
                   help="per-device tokens/s the capacity search holds (with --find-capacity)")
    s.add_argument("--max-devices", type=int, default=32,
                   help="the capacity search's upper bound (default: %(default)s)")
    s.add_argument("--head", default=None, metavar="DIR",
                   help="a trained draft head in the verifier, drafting from its own forward's "
                        "features beside the devices' drafts: 'default' (shipped), a kind "
                        "(eagle, specformer, ctc) or a head folder (default: none)")
    s.add_argument("--max-batch-tokens", type=int, default=None,
                   help="the verifier's most tokens in one forward (own token + drafts of "
                        "every session; the longest drafts are cut first): a small budget "
                        "shortens drafts as the batch grows (default: the verifier's, 256)")
    s.add_argument("--timeout", metavar="S", type=float, default=900.0,
                   help="seconds a run may take to come up or a request to finish "
                        "(default: %(default)s)")
    s.add_argument("--link-faults", metavar="SCHEDULE", default="",
                   help="break links during each run, a partition schedule: comma-separated "
                        "FAULT@START[+DURATION][:LINKS][/DEVICE], FAULT one of blackhole "
                        "(forward nothing, sockets open), abandon (the server's side closed, the "
                        "board's left open and silent), reset, refuse (nothing listens), slow "
                        "(0.2 s a chunk); START and DURATION in seconds from the first request; "
                        "LINKS drafters (default), clients or all; DEVICE an index (default: "
                        "every device). E.g. blackhole@10+20,abandon@40:clients/0")
    s.add_argument("--device", metavar="D", default="cpu",
                   help="where the verifier runs: cpu, cuda or cuda:N (on a GPU its actor asks "
                        "Ray for one; the losslessness check decodes there too) "
                        "(default: %(default)s)")
    s.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="the verifier's steps replayed as CUDA graphs (default: on with "
                        "--device cuda; see serve --cuda-graphs)")
    s.add_argument("--project-on", metavar="SITTING.json", default=None,
                   help="run no fleet: project one on a GPU server from a GPU sitting's step "
                        "costs (scripts/gpu_sitting.sh's JSON) and drafters' acceptance and "
                        "speed measured here (--acceptance-from, --acceptance), against "
                        "server-only decoding on the same GPU, for each --devices count; a "
                        "projection, printed with its assumptions")
    s.add_argument("--shape", default="8b",
                   help="with --project-on: the sitting's model shape (default: %(default)s)")
    s.add_argument("--acceptance-from", metavar="FILE", nargs="+", default=[],
                   help="with --project-on: edgespec bench-edge JSON files; each gives its "
                        "drafter's acceptance and one board's drafting speed")
    s.add_argument("--acceptance", metavar="NAME=ALPHA[@TOK_S],...", default="",
                   help="with --project-on: drafters given by hand: their draft tokens' "
                        "acceptance and, optionally, one board's draft tokens/s")
    add_threads_arg(s, f"{SERVER_CORES_THREADS}; with --shared-cpus {THREADS_DEFAULT}")
    add_dtype_arg(s, "the verifier's ")
    add_tree_width_arg(s)
    s.set_defaults(func=cmd_simulate)


def parse_devices(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--devices takes counts like 4 or 1,2,4, got {text!r}") from None
    if not counts or counts[0] < 1:
        raise ConfigError("--devices must be >= 1")
    return counts


def _check_slo(slo: float | None) -> None:
    if slo is not None and not 0 < slo < math.inf:
        raise ConfigError("--slo must be a finite number > 0")


def check_args(args) -> tuple[list[int], list]:
    from edgespec_cli.cli_args import check_model_arg
    from ..deployment.device_profiles import parse_profiles

    counts = parse_devices(args.devices)
    profiles = parse_profiles(args.profile)
    for name in ("requests", "duration", "rate", "max_new_tokens", "max_batch_tokens"):
        value = getattr(args, name)
        if value is not None and not value > 0:  # NaN too
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
    if not 0 < args.timeout < math.inf:
        raise ConfigError(f"--timeout must be a finite number of seconds > 0, got "
                          f"{args.timeout}")
    if args.max_devices < 1:
        raise ConfigError(f"--max-devices must be >= 1, got {args.max_devices}")
    if args.baseline == SERVER_ONLY and args.batching == "off":
        raise ConfigError("--baseline server-only is compared with edge drafting batched: give "
                          "--batching on or both")
    if args.find_capacity and (args.slo is None or not args.slo > 0):
        raise ConfigError("--find-capacity needs --slo TOKENS_PER_S > 0")
    if args.slo is not None and not (args.find_capacity or args.project_on):
        raise ConfigError("--slo is for --find-capacity (or --project-on)")
    _check_slo(args.slo)
    if (args.acceptance_from or args.acceptance) and not args.project_on:
        raise ConfigError("--acceptance-from and --acceptance are for --project-on")
    if not 1 <= args.tree_width <= 16:
        raise ConfigError(f"--tree-width must be in [1, 16], got {args.tree_width}")
    check_model_arg(args.model)
    faults = parse_fault_schedule(args.link_faults)  # refused before anything starts
    most = args.max_devices if args.find_capacity else max(counts)
    for f in faults:  # a fault for a device no run has would never be applied
        if f.device is not None and f.device >= most:
            raise ConfigError(f"--link-faults: {f.describe()} names device {f.device}, but "
                              f"the runs have at most {most} device(s) (0-{most - 1})")
    if args.shared_cpus and (args.server_cpus or args.board_cpus):
        raise ConfigError("--shared-cpus runs everything on every core: no --server-cpus or "
                          "--board-cpus with it")
    cpu_split(args)  # a cpu list that is wrong or not here is refused before anything starts
    return counts, profiles


def cpu_split(args):
    """The server's and the boards' cores (None: shared). With --address (a cluster whose
    machines this one cannot see) the cores are shared unless given."""
    from ..deployment.cpu_share import split_cpus

    if args.shared_cpus or (args.address and not (args.server_cpus or args.board_cpus)):
        return None
    return split_cpus(args.server_cpus, args.board_cpus)


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


def start_ray(address: str | None) -> None:
    import ray

    from ..deployment import cluster

    if address:
        cluster.connect(address, namespace="edgespec-simulate")
        return
    ray.init(namespace="edgespec-simulate", include_dashboard=False, log_to_driver=False,
             configure_logging=False, logging_level=logging.WARNING)


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
    _check_slo(args.slo)
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
    report = proj.build_projection(sitting, args.shape, traces, counts, args.slo,
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
            run_settings = replace(settings, requests=(args.requests or 2) * n)
        return FleetRun(roles, run_settings, fleet_of, mode, prompts).run()

    if not args.find_capacity:
        return [run_one(mode, n) for mode in modes for n in counts], {}, []
    runs, probes, capacity = [], [], {}
    for mode in modes:
        capacity[mode], tried = find_capacity(lambda n, m=mode: run_one(m, n), args.slo,
                                              args.max_devices)
        runs += [r for r, _ in tried]
        probes += [{"batching": mode, "devices": r.devices, "slowest_tokens_per_s": v}
                   for r, v in tried]
    return runs, capacity, probes


def _write_outputs(args: argparse.Namespace, report: dict) -> None:
    from . import report as rep

    print(rep.format_table(report))
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
