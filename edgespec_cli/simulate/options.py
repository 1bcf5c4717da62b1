"""``edgespec simulate``'s options: defined (``add_simulate_parser``) and checked, every one of
them before anything starts (``check_args``); ``cli`` runs what they ask for."""

from __future__ import annotations

import argparse
import math

from edgespec.config import FILL_DRAFTS, ConfigError, EngineConfig

from ..deployment.link_faults import parse_fault_schedule
from .records import SERVER_ONLY

# --find-capacity's requests per device, where --requests is not given: with 2, runs of under
# 10 s moved the capacity found by a device (docs/measured/edge-vs-server, capacity-39)
CAPACITY_REQUESTS = 4


def add_simulate_parser(sub) -> argparse.ArgumentParser:
    """The ``simulate`` subcommand's parser and its options (``cli.add_simulate_command`` says
    what runs it)."""
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
                               "--find-capacity, requests per device (default: "
                               f"{CAPACITY_REQUESTS} per device)")
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
    s.add_argument("--repeat", metavar="N", type=int, default=1,
                   help="run each device count's modes N times, round by round, every other "
                        "round in the reverse order (an even N runs each mode first equally "
                        "often); the ratios are the medians of the rounds' own, and against "
                        "--baseline server-only each round's throughput ratio is given beside "
                        "them: a machine's speed drifts by 10-20%% between runs minutes apart "
                        "(default: %(default)s)")
    s.add_argument("--seed", metavar="S", type=int, default=0,
                   help="seeds the links' jitter and loss and the order of prompts "
                        "(default: %(default)s)")
    s.add_argument("--address", default=None, metavar="HEAD:PORT",
                   help="join this Ray cluster (its head's IP and Ray port, e.g. 10.8.0.1:6380) "
                        "instead of starting a local one of its own (without it, simulate "
                        "never joins a cluster already running here)")
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
    s.add_argument("--keep-drafting", action="store_true",
                   help="the verifier never rests the boards on its steps' measured speed "
                        "(serve --keep-drafting); without it a batch whose steps commit fewer "
                        "tokens a second while the boards draft than while they rest is "
                        "decoded without drafts (only speed depends on it)")
    s.add_argument("--fill-drafts", choices=FILL_DRAFTS, default=None,
                   help="the verifier's own cheap draft for a session whose board's draft is "
                        "empty when a step asks for one (serve --fill-drafts): auto, mag or "
                        "none (default: the verifier's, auto: mag unless --head)")
    s.add_argument("--timeout", metavar="S", type=float, default=900.0,
                   help="seconds a run may take to come up or a request to finish "
                        "(default: %(default)s)")
    s.add_argument("--link-faults", metavar="SCHEDULE", default="",
                   help="break links during each run, a partition schedule: comma-separated "
                        "FAULT@START[+DURATION][:LINKS][/DEVICE], FAULT one of blackhole "
                        "(forward nothing, sockets open), abandon (the server's side closed, the "
                        "board's left open and silent), reset, refuse (nothing listens), slow "
                        "(0.2 s a chunk); START and DURATION in seconds from the first request; "
                        "LINKS drafters (default), clients or all (the server-only run has no "
                        "board: there all breaks the clients' links and drafters none); DEVICE "
                        "an index (default: every device). E.g. "
                        "blackhole@10+20,abandon@40:clients/0")
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
    s.add_argument("--shape", default=None,
                   help="with --project-on: the sitting's model shape (default: 8b)")
    s.add_argument("--acceptance-from", metavar="FILE", nargs="+", default=[],
                   help="with --project-on: edgespec bench-edge JSON files; each gives its "
                        "drafter's acceptance and one board's drafting speed")
    s.add_argument("--acceptance", metavar="NAME=ALPHA[@TOK_S],...", default="",
                   help="with --project-on: drafters given by hand: their draft tokens' "
                        "acceptance and, optionally, one board's draft tokens/s")
    add_threads_arg(s, f"{SERVER_CORES_THREADS}; with --shared-cpus {THREADS_DEFAULT}")
    add_dtype_arg(s, "the verifier's ")
    add_tree_width_arg(s)
    return s


def parse_devices(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--devices takes counts like 4 or 1,2,4, got {text!r}") from None
    if not counts or counts[0] < 1:
        raise ConfigError("--devices must be >= 1")
    return counts


def check_slo(slo: float | None) -> None:
    if slo is not None and not 0 < slo < math.inf:
        raise ConfigError("--slo must be a finite number > 0")


def check_args(args) -> tuple[list[int], list]:
    from edgespec.drafters.spec_check import check_head_arg
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
    if args.repeat < 1:
        raise ConfigError(f"--repeat must be >= 1, got {args.repeat}")
    if args.repeat > 1 and args.find_capacity:
        raise ConfigError("--repeat is for the device counts of --devices, not --find-capacity "
                          "(its search runs each count once)")
    if args.max_devices < 1:
        raise ConfigError(f"--max-devices must be >= 1, got {args.max_devices}")
    if args.baseline == SERVER_ONLY and args.batching == "off":
        raise ConfigError("--baseline server-only is compared with edge drafting batched: give "
                          "--batching on or both")
    if args.find_capacity and (args.slo is None or not args.slo > 0):
        raise ConfigError("--find-capacity needs --slo TOKENS_PER_S > 0")
    if args.slo is not None and not (args.find_capacity or args.project_on):
        raise ConfigError("--slo is for --find-capacity (or --project-on)")
    check_slo(args.slo)
    if (args.acceptance_from or args.acceptance or args.shape) and not args.project_on:
        raise ConfigError("--shape, --acceptance-from and --acceptance are for --project-on")
    if not 1 <= args.tree_width <= 16:
        raise ConfigError(f"--tree-width must be in [1, 16], got {args.tree_width}")
    if args.fill_drafts is not None:  # the verifier's engine's rule (mag not with a head)
        EngineConfig(fill_drafts=args.fill_drafts, head=args.head)
    check_model_arg(args.model)
    check_head_arg(args.head)  # before a fleet starts: its verifier would refuse it later
    if args.address and args.address != "auto" and "://" not in args.address:
        host, _, port = args.address.rpartition(":")
        if not host or not port.isdigit():  # as ``deploy`` refuses it, before the model loads
            raise ConfigError(f"--address takes HOST:PORT (the Ray head's GCS port), got "
                              f"{args.address[:60]!r}")
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
