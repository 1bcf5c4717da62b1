"""``edgespec generate``: a prompt through the engine in this process, streamed or as one JSON
object (``--json``), with the sampling, penalty, logit bias and logprob options of the served
API; its parser (``add_generate``) and its run (``cmd_generate``)."""

from __future__ import annotations

import json
import sys
from dataclasses import fields

from edgespec.config import ConfigError, SamplingParams
from edgespec.drafters import DRAFTER_HELP
from edgespec.protocol.token_logprob import check_top_logprobs
from edgespec_cli.cli_args import (add_engine_args, add_model_args, add_threads_arg,
                                   add_tree_width_arg, add_verify_args, check_drafter_arg,
                                   check_model_arg, engine_config, set_threads, warn_if_lossy)


def read_prompt(args) -> str:
    """The prompt from the command line or ``--prompt-file`` (``-``: standard input); exactly
    one of them."""
    if args.prompt is not None and args.prompt_file is not None:
        raise ConfigError("give the prompt on the command line or with --prompt-file, not both")
    if args.prompt is None and args.prompt_file is None:
        raise ConfigError("no prompt: give it on the command line or with --prompt-file PATH "
                          "(- for standard input)")
    if args.prompt_file is None:
        return args.prompt
    if args.prompt_file == "-":
        return sys.stdin.read()
    try:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read the prompt file {args.prompt_file}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"the prompt file {args.prompt_file} is not UTF-8 text") from None


def logit_bias_arg(text: str) -> tuple[tuple[int, float], ...]:
    """``--logit-bias`` ("ID=B,ID=B") as (token id, bias) pairs; their ranges are
    ``SamplingParams``' to check."""
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        token, _, bias = part.partition("=")
        try:
            if not (token.strip().isascii() and token.strip().isdigit()):
                raise ValueError(token)
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise ConfigError(f"--logit-bias takes ID=BIAS pairs, comma-separated (198=-100), "
                              f"got {part[:40]!r}") from None
    return tuple(pairs)


def cmd_generate(args) -> int:
    from edgespec.engine.local import LocalGenerator, print_stream
    from edgespec.models.images import read_image_file

    args.prompt = read_prompt(args)  # "" is a prompt; one of zero tokens (--raw) is refused
    if args.max_new_tokens < 0 or (args.max_new_tokens == 0 and args.prompt_logprobs is None):
        raise ConfigError(f"--max-new-tokens must be >= 1 (0 only with --prompt-logprobs: the "
                          f"prompt scored alone), got {args.max_new_tokens}")
    try:
        params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed,
                                args.presence_penalty, args.frequency_penalty,
                                logit_bias_arg(args.logit_bias))
    except ConfigError as e:  # its errors name a field: said with the option's name
        field = str(e).split(" ", 1)[0].rstrip(":")
        if field not in {f.name for f in fields(SamplingParams)}:
            raise
        raise ConfigError(f"--{field.replace('_', '-')}{str(e)[len(field):]}") from None
    for option, k in (("--logprobs", args.logprobs), ("--prompt-logprobs", args.prompt_logprobs)):
        if k is not None:
            if not args.json:
                raise ConfigError(f"{option} is printed with --json: give both")
            try:
                check_top_logprobs(k, option)
            except ValueError as e:
                raise ConfigError(str(e)) from None
    cfg = engine_config(args, max_sessions=2)
    check_model_arg(args.model)
    check_drafter_arg(args.drafter)
    set_threads(args.threads)
    warn_if_lossy(cfg)
    images = [read_image_file(path) for path in args.image]  # before the model loads
    gen = LocalGenerator(args.model, args.drafter, args.device, args.dtype, cfg)
    try:
        out = gen.generate(args.prompt, args.max_new_tokens, params, raw=args.raw,
                           stream=None if args.json else print_stream, images=images,
                           logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs)
    finally:
        gen.close()
    if args.json:
        print(json.dumps(out.to_dict()))
    else:
        s = out.stats
        print(f"\n[{s.tokens} tokens, {s.tokens_per_s:.1f} tok/s, drafted {s.draft_tokens}, "
              f"accepted {s.accepted_tokens}, mean acceptance length "
              f"{s.mean_acceptance_length:.2f}, lossless: {str(not s.lossy).lower()}"
              + (f" ({s.verify}: {s.lenient_tokens} draft tokens kept that exact "
                 "verification rejects)" if s.lossy else "") + "]",
              file=sys.stderr)
    return 0


def add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt, speculatively, in process",
                       description="Generate text from a prompt, speculatively, in process. "
                                   "The prompt is the PROMPT argument or the contents of "
                                   "--prompt-file PATH (--prompt-file - reads standard input, "
                                   "e.g. `cat notes.txt | edgespec generate --prompt-file -`); "
                                   "give exactly one.")
    g.add_argument("prompt", nargs="?", default=None,
                   help="the prompt: one user message through the chat template (or give "
                        "--prompt-file)")
    g.add_argument("--prompt-file", metavar="PATH", default=None,
                   help="read the prompt from this UTF-8 file, '-' for standard input "
                        "(instead of PROMPT; newlines are kept)")
    g.add_argument("--drafter", metavar="SPEC", default="mag",
                   help=f"who drafts: {DRAFTER_HELP} (default: %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=128,
                   help="most tokens generated; 0 with --prompt-logprobs: none, the prompt "
                        "scored alone (default: %(default)s)")
    g.add_argument("--temperature", metavar="T", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy (default: 0)")
    g.add_argument("--top-k", metavar="K", type=int, default=0,
                   help="sample from the K most likely tokens only; 0: off (default: 0)")
    g.add_argument("--top-p", metavar="P", type=float, default=1.0,
                   help="sample from the smallest set of tokens with probability >= P; 1: off "
                        "(default: 1)")
    g.add_argument("--seed", metavar="S", type=int, default=None,
                   help="sampling seed: the same seed gives the same tokens with any drafter "
                        "(default: a random seed per session)")
    g.add_argument("--presence-penalty", metavar="X", type=float, default=0.0,
                   help="OpenAI's presence penalty, -2 to 2: the logit of each token the output "
                        "already holds moves down by X (default: 0)")
    g.add_argument("--frequency-penalty", metavar="X", type=float, default=0.0,
                   help="OpenAI's frequency penalty, -2 to 2: a token's logit moves down by X "
                        "for each time the output holds it (default: 0)")
    g.add_argument("--logit-bias", metavar="ID=B[,ID=B...]", default="",
                   help="add B (-100 to 100) to token ID's logit at every position, e.g. "
                        "'198=-100' all but bans token 198 (default: none)")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    g.add_argument("--image", metavar="PATH", action="append", default=[],
                   help="an image for a vision-language --model (SmolVLM); repeat for several, "
                        "in the order of the prompt's <image> marks (none: all before the "
                        "prompt's text); a text-only model refuses it")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object (token_ids, text, finish_reason, prompt_tokens, "
                        "dtype, stats; with --logprobs, logprobs; with --prompt-logprobs, "
                        "prompt_logprobs) instead of streaming")
    g.add_argument("--logprobs", metavar="K", type=int, default=None,
                   help="with --json: each token's logprob under the target (the model's own "
                        "distribution, before temperature and filters; target-only decoding's "
                        "value exactly) and the K most likely tokens beside it, 0-20, as "
                        "'logprobs': [{token_id, logprob, top: [[id, logprob], ...]}] "
                        "(default: none)")
    g.add_argument("--prompt-logprobs", metavar="K", type=int, default=None,
                   help="with --json: the prompt's logprobs too (each prompt token's after the "
                        "first, given the tokens before it, read as the prompt is prefilled; "
                        "the output is the same either way) with K alternatives, 0-20, as "
                        "'prompt_logprobs', shaped as 'logprobs' (default: none)")
    add_model_args(g)
    add_threads_arg(g)
    add_engine_args(g)
    add_tree_width_arg(g)
    add_verify_args(g)
    g.set_defaults(func=cmd_generate)
