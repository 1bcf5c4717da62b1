"""``edgespec distill``: build a distillation dataset from the target itself, then train draft
heads on it.

    edgespec distill --out DIR [--kinds eagle,ctc,specformer,imitation] [--exit-layer L]
                     [--prompts FILE ...] [--max-minutes M] [--threads N] [--seed S] ...

DIR/data holds the dataset (``edgespec.heads.dataset``), DIR/KIND each head folder
(``edgespec.heads.manifest``), DIR/imitation-L an imitation network drafting from layer L
(``edgespec.heads.imitation``; its layer-L states beside the data, DATA/exit-L). Both steps
resume: the harvest from its first missing shard, a head from its last checkpoint; a finished
head is not trained again.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

from edgespec_cli.cli_args import (add_model_args, add_threads_arg, check_at_least, check_within,
                                   set_threads, threads_in_use)
from edgespec.config import HEAD_KINDS, ConfigError

KINDS = (*HEAD_KINDS, "imitation")


def add_distill_command(sub) -> None:
    p = sub.add_parser(
        "distill", help="make draft heads for a target from its own responses",
        description="Generate the target's responses (greedy and sampled) to prompts, record the "
                    "features its LM head reads and its next-token distributions into a sharded "
                    "dataset (OUT/data), then train draft heads on it (OUT/KIND). Resumable: run "
                    "the same command again after a stop.")
    p.add_argument("--out", required=True, metavar="DIR", help="where the data and heads go")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="the dataset folder (default: OUT/data), e.g. another run's, to train "
                        "other heads on the same data")
    p.add_argument("--kinds", metavar="LIST", default=",".join(HEAD_KINDS),
                   help="head kinds to train, comma-separated, of " + ", ".join(KINDS) +
                        " (imitation needs --exit-layer); 'none': only the data "
                        "(default: %(default)s)")
    p.add_argument("--exit-layer", metavar="L", default=None,
                   help="imitation: the target layer its drafts exit after, or a comma-separated "
                        "list (one network each, in OUT/imitation-L)")
    p.add_argument("--imitation-steps", type=int, default=2000, metavar="N",
                   help="imitation: training steps of 256 positions per network "
                        "(default: %(default)s)")
    p.add_argument("--imitation-ffn", type=int, default=1536, metavar="D",
                   help="imitation: the network's feed-forward width d_ff "
                        "(default: %(default)s)")
    p.add_argument("--prompts", nargs="*", default=[], metavar="FILE",
                   help="JSONL prompt files: a line is {\"prompt\": TEXT}, {\"messages\": "
                        "[...]} (chat messages, OpenAI's roles) or {\"turns\": [TEXT, ...]} "
                        "(the first turn)")
    p.add_argument("--no-spec-bench", action="store_true",
                   help="leave out the Spec-Bench questions (by default they are used, except "
                        "the first --hold-out of each category, which benchmarks use)")
    p.add_argument("--hold-out", type=int, default=2, metavar="N",
                   help="Spec-Bench questions per category never trained on, the first N; "
                        "bench's default subset is the first 1 (default: %(default)s)")
    p.add_argument("--samples", type=int, default=1,
                   help="sampled responses per prompt (at least 1), besides the greedy one "
                        "(default: %(default)s)")
    p.add_argument("--temperature", metavar="T", type=float, default=0.8,
                   help="temperature of the sampled responses (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=192,
                   help="longest response harvested (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=768,
                   help="leave out longer prompts: decoding them together with short ones "
                        "slows every row (default: %(default)s)")
    p.add_argument("--slots", type=int, default=16,
                   help="responses decoded together (default: %(default)s)")
    p.add_argument("--per-shard", type=int, default=16,
                   help="responses per shard (default: %(default)s)")
    p.add_argument("--max-minutes", metavar="M", type=float, default=None,
                   help="stop (resumably) after this long, harvest and training together")
    p.add_argument("--train-steps", type=int, default=1500,
                   help="training steps per head kind (default: %(default)s)")
    p.add_argument("--data-share", type=float, default=1.0, metavar="F",
                   help="train on this share of the dataset's training responses, to see how "
                        "acceptance grows with data (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=8192,
                   help="draft vocabulary: the most frequent tokens of the data "
                        "(default: %(default)s)")
    p.add_argument("--hold-out-category", action="append", default=[], metavar="CAT",
                   help="train the heads without this Spec-Bench category's responses (the "
                        "data keeps them), e.g. to measure --learn on a category a head never "
                        "saw (bench-learn); repeatable")
    p.add_argument("--no-harvest", action="store_true",
                   help="train on the shards finished so far, without resuming the harvest")
    p.add_argument("--seed", metavar="S", type=int, default=0,
                   help="seeds the work list, the sampled responses and training "
                        "(default: %(default)s)")
    add_model_args(p)
    add_threads_arg(p)
    p.set_defaults(func=run_distill)


def run_distill(args) -> int:
    threads = set_threads(args.threads)
    kinds = [] if args.kinds == "none" else [k.strip() for k in args.kinds.split(",")]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ConfigError(f"unknown head kind {bad[0]!r}: give some of {', '.join(KINDS)}")
    if "imitation" in kinds:
        from .distill_imitation import check_exit_layers

        check_exit_layers(args.exit_layer, args.model)  # refused before any work
    if not 0 < args.data_share <= 1:  # NaN too; before the harvest, which may take hours
        raise ConfigError(f"--data-share must be in (0, 1], got {args.data_share}")
    check_at_least(args, ("per_shard", "train_steps", "vocab", "max_new_tokens", "slots",
                          "samples", "imitation_steps", "max_prompt_tokens"), 1)
    check_at_least(args, ("hold_out",), 0)
    check_within(args, ("temperature",), 0)
    if args.max_minutes is not None and not args.max_minutes >= 0:  # 0: stop at once, resumably
        raise ConfigError(f"--max-minutes must be >= 0, got {args.max_minutes}")
    from .bench.report import CATEGORIES

    unknown = [c for c in args.hold_out_category if c not in CATEGORIES]
    if unknown:
        raise ConfigError(f"--hold-out-category {unknown[0]!r}: the categories are "
                          f"{', '.join(CATEGORIES)}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} is a file: give a folder")
    if not args.no_harvest:  # the prompt files read before the model loads
        from .distill_data import read_prompt_file

        for path in args.prompts:
            read_prompt_file(path)
    deadline = None if args.max_minutes is None else time.monotonic() + 60 * args.max_minutes
    out = Path(args.out)
    command = "edgespec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    print(f"distill: torch threads {threads}; output in {out}", flush=True)
    from .distill_data import make_dataset

    data = Path(args.data) if args.data else out / "data"
    finished = args.no_harvest or make_dataset(args, data, command, deadline)
    if not finished:
        print("distill: stopped by --max-minutes during the harvest; run the same command "
              "again to resume", flush=True)
        return 0
    from edgespec.heads.manifest import MANIFEST
    from edgespec.heads.training import TargetTensors, TrainSettings, train_head
    from edgespec.models.loading import load_model

    target, exclude = None, None
    for kind in kinds:
        if kind == "imitation":
            from .distill_imitation import run_imitation

            if not run_imitation(args, out, data, command, deadline):
                print("distill: stopped by --max-minutes during the imitation step; run the "
                      "same command again to resume", flush=True)
                return 0
            continue
        if (out / kind / MANIFEST).exists():
            print(f"distill: {kind} head already in {out / kind}", flush=True)
            continue
        if target is None:
            loaded = load_model(args.model, args.device, args.dtype)
            target = TargetTensors.of_model(loaded.model, loaded.name)
            if args.hold_out_category:
                from .distill_data import sequences_tagged

                exclude = sequences_tagged(args, loaded.tokenizer, set(args.hold_out_category))
                print(f"distill: {len(exclude)} responses of "
                      f"{', '.join(args.hold_out_category)} left out of training", flush=True)
        if not 0 < args.data_share <= 1:
            raise ConfigError(f"--data-share must be in (0, 1], got {args.data_share}")
        settings = TrainSettings(kind=kind, vocab=args.vocab, steps=args.train_steps,
                                 seed=args.seed, threads=threads_in_use() or threads,
                                 data_share=args.data_share)
        report = train_head(target, data, out / kind, settings, command, deadline,
                            say=lambda m: print(f"distill: {m}", flush=True), exclude=exclude,
                            data_note={"held_out_categories": args.hold_out_category}
                            if args.hold_out_category else None)
        if report is None:
            print("distill: stopped by --max-minutes during training; run the same command "
                  "again to resume", flush=True)
            return 0
        print(f"distill: {kind} head in {out / kind}: " + json.dumps(report), flush=True)
    return 0
