"""``edgespec pad-train``: label pivots on problems with exact answers, then train PAD's pivot
classifier on them.

    edgespec pad-train --out DIR [--task NAME | --tasks-file FILE --scorer S]
                       [--drafter layers:L|model:PATH] [--rollouts N] [--alpha A]
                       [--max-minutes M] [--seed S] [--threads N] ...
    edgespec pad-train --measure N [--task NAME | --tasks-file FILE --scorer S]

DIR/labels holds the labels (``edgespec.pad.labels``), DIR/classifier the classifier
(``edgespec.pad.classifier``). The labelling resumes from its first missing shard; a finished
classifier is not trained again, unless a larger ``--problems`` grows a generated task's labels
(the first problems are the same whatever the count), which trains it again on all of them.
``--measure N``: the target's greedy success rate on N test
problems of each task, and nothing else (is the task one the target can do?).

A command of its own rather than ``distill --kinds pad``: distill's data is the target's
responses to open prompts, read position by position; PAD's is problems with reference answers,
sampled continuations and a scorer, with other options (task, scorer, drafter, rollouts, alpha).
Both share the building blocks: the runner's slots (the heads' harvester), the target's
fingerprint, atomic shards, --max-minutes, --seed and --threads.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

from edgespec_cli.cli_args import (add_model_args, add_threads_arg, check_at_least, check_within,
                                   set_threads, threads_in_use)
from edgespec.config import ConfigError

FAMILY_HELP = "arith, convert, extract, choice, or all (every family)"


def add_pad_train_command(sub) -> None:
    p = sub.add_parser(
        "pad-train", help="label pivot tokens and train PAD's classifier (lossy verification)",
        description="Label pivots for PAD (pivot-aware verification, a lossy opt-in mode): on "
                    "problems with exact answers, where a drafter's greedy token differs from "
                    "the target's, sample continuations from each and score them; then train "
                    "the pivot classifier on the target's hidden state there (OUT/classifier). "
                    "Resumable: run the same command again after a stop. Exits 1 where too "
                    "few labels were made to train a classifier (the labels are kept).")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="where the labels and the classifier go (needed unless --measure)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--task", metavar="NAME", default="extract",
                     help=f"a generated task family: {FAMILY_HELP} (default: %(default)s)")
    src.add_argument("--tasks-file", metavar="FILE", default=None,
                     help="a JSONL file of {\"prompt\": TEXT, \"answer\": TEXT} lines; about a "
                          "quarter of them (by a hash of the prompt) are a test split never "
                          "labelled")
    p.add_argument("--scorer", metavar="S", default=None,
                   help="with --tasks-file: exact, number or regex:PATTERN (default: exact)")
    p.add_argument("--problems", type=int, default=200,
                   help="train problems to label, per family; a larger N on a finished or "
                        "stopped run whose N was a multiple of --per-shard continues it (its "
                        "first problems are the same) and trains the classifier again "
                        "(default: %(default)s)")
    p.add_argument("--drafter", metavar="SPEC", default="layers:28",
                   help="the drafter whose mismatches are labelled: layers:L (the target's "
                        "first L layers) or model:PATH (a small model, same tokenizer); its "
                        "mistakes should be ones a drafter makes: on the default model (30 "
                        "layers) layers:28 agrees with the target on 62%% of answer tokens, "
                        "layers:8 and 20 on 12%% and 20%% with mostly implausible tokens "
                        "(default: %(default)s)")
    p.add_argument("--rollouts", metavar="N", type=int, default=8,
                   help="continuations sampled per side of a candidate, and to measure the "
                        "target's success on a problem (PAD: 20) (default: %(default)s)")
    p.add_argument("--temperature", metavar="T", type=float, default=0.7,
                   help="temperature of the continuations (default: %(default)s)")
    p.add_argument("--alpha", metavar="A", type=float, default=0.8,
                   help="a pivot's draft side succeeds under A times the target side "
                        "(default: %(default)s)")
    p.add_argument("--low", type=float, default=0.5,
                   help="... and at most this often (default: %(default)s)")
    p.add_argument("--high", type=float, default=0.8,
                   help="a non-pivot's draft side succeeds at least this often; candidates "
                        "between are dropped as ambiguous (default: %(default)s)")
    p.add_argument("--skip-at", type=float, default=0.3,
                   help="skip problems the target gets right this often or less "
                        "(default: %(default)s)")
    p.add_argument("--max-candidates", type=int, default=4,
                   help="mismatching positions labelled per problem (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=48,
                   help="longest answer or continuation (default: %(default)s)")
    p.add_argument("--tap", type=int, default=-8,
                   help="the target layer the classifier reads, counted as transformers' "
                        "hidden_states (default: %(default)s)")
    p.add_argument("--slots", type=int, default=16,
                   help="continuations decoded together (default: %(default)s)")
    p.add_argument("--per-shard", type=int, default=4,
                   help="problems per labels shard (default: %(default)s)")
    p.add_argument("--train-steps", type=int, default=400,
                   help="classifier training steps (default: %(default)s)")
    p.add_argument("--no-label", action="store_true",
                   help="train on the labels' shards finished so far, without resuming the "
                        "labelling")
    p.add_argument("--measure", metavar="N", type=int, default=None,
                   help="only print the target's greedy success on N test problems")
    p.add_argument("--max-minutes", metavar="M", type=float, default=None,
                   help="stop (resumably) after this long")
    p.add_argument("--seed", metavar="S", type=int, default=0,
                   help="seeds the problems, the candidates, the continuations and training "
                        "(default: %(default)s)")
    add_model_args(p)
    add_threads_arg(p)
    p.set_defaults(func=run_pad_train)


def run_pad_train(args) -> int:
    threads = set_threads(args.threads)
    if args.measure is None and not args.out:
        raise ConfigError("pad-train needs --out DIR (or --measure N)")
    check_at_least(args, ("per_shard", "measure", "problems", "rollouts", "max_candidates",
                          "max_new_tokens", "slots", "train_steps"), 1)
    check_within(args, ("temperature",), 0)
    check_within(args, ("alpha", "low", "high", "skip_at"), 0, 1)
    if args.low > args.high:
        raise ConfigError(f"--low ({args.low}) must not be above --high ({args.high})")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} is a file: give a folder")
    from edgespec.drafters import parse_drafter_spec

    from .pad_labels import task_sets

    if args.scorer is not None and not args.tasks_file:  # a generated family scores itself
        raise ConfigError("--scorer is for --tasks-file (a task family has its own scorer)")
    parse_drafter_spec(args.drafter, allowed=("layers", "model"))  # refused before loading
    task_sets(args, "test", 1)  # the task, the file and the scorer too
    from edgespec.models.loading import load_model

    t0 = time.monotonic()
    target = load_model(args.model, args.device, args.dtype)
    threads = threads_in_use() or threads  # a default lowered where the dtype was not exact
    say = lambda m: print(f"pad-train: {m}", flush=True)  # noqa: E731
    say(f"torch threads {threads}; {target.name} loaded in {time.monotonic() - t0:.0f} s "
        f"({target.dtype})")
    if args.measure is not None:
        return _measure(args, target, say)
    from .pad_labels import label_and_train

    deadline = None if args.max_minutes is None else time.monotonic() + 60 * args.max_minutes
    command = "edgespec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    from edgespec.pad.training import TooFewLabels

    try:
        report = label_and_train(args, target, Path(args.out), command, deadline, say)
    except TooFewLabels:  # said; the labels are kept for a run that labels more
        return 1
    if report is not None:  # None: stopped by --max-minutes (resumable), or already trained
        say(json.dumps(report))
    return 0


def _measure(args, target, say) -> int:
    from edgespec.models.loading import encode_prompt, stop_token_ids
    from edgespec.pad.rollouts import greedy_success
    from edgespec.runner.target_runner import TargetRunner

    from .pad_labels import task_sets

    sets = task_sets(args, "test", args.measure)
    longest = max(len(encode_prompt(target.tokenizer, p.prompt))
                  for s in sets for p in s.problems)
    runner = TargetRunner(target.model, n_slots=args.slots,
                          max_len=longest + args.max_new_tokens + 4)
    for s in sets:
        problems = s.problems[: args.measure]
        t0 = time.monotonic()
        right = greedy_success(runner, target.tokenizer, stop_token_ids(target),
                               type(s)(s.name, s.scorer, problems),
                               lambda p: encode_prompt(target.tokenizer, p.prompt),
                               args.max_new_tokens)
        say(f"{s.name}: greedy success {sum(right)}/{len(right)} = "
            f"{sum(right) / max(1, len(right)):.3f} on test problems "
            f"({time.monotonic() - t0:.0f} s)")
    return 0
