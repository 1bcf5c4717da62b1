"""The work of ``edgespec pad-train``: label each task's train problems (resuming), then train,
validate and save the pivot classifier."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

from edgespec.config import ConfigError


def task_sets(args, split: str, n: int) -> list:
    """The ``TaskSet``s the options name, ``n`` problems of each family (a file: all of it)."""
    from edgespec.pad.tasks import FAMILIES, family_problems, file_problems

    if args.tasks_file:
        return [file_problems(args.tasks_file, args.scorer or "exact", split)]
    if args.task != "all" and args.task not in FAMILIES:
        raise ConfigError(f"unknown task {args.task!r}: give one of {', '.join(FAMILIES)} or "
                          "all")
    names = list(FAMILIES) if args.task == "all" else [args.task]
    return [family_problems(name, split, n, args.seed) for name in names]


def _asks_more(args, old, new) -> bool:
    """Whether labels ``new`` (a ``LabelInfo``) ask for more problems of ``old``'s generated
    family with otherwise the same options (its first problems are the same whatever the
    count: ``family_problems``): ``old`` grows into ``new`` where its last shard is whole."""
    return (not args.tasks_file and new.problems > old.problems
            and replace(old, problems=new.problems, command="") == replace(new, command=""))


def labels_grow(args, target, sets, out: Path) -> bool:
    """Whether a generated task's saved labels cover fewer problems than asked (the run
    grows); ConfigError where they cannot grow (made by another target or with other options,
    or ``_refuse_partial_growth``), before the classifier is set aside for a growth that
    would be refused."""
    from edgespec.pad.labels import MANIFEST, LabelInfo

    grows = False
    for tasks in sets:  # every task checked: one refused after another grew would come late
        folder = out / "labels" / tasks.name
        if args.tasks_file or not (folder / MANIFEST).exists():
            continue
        old = LabelInfo.load(folder)
        if old.problems < len(tasks.problems):
            _check_labels_target(folder, target)
            if _made_otherwise(args, tasks.name, tasks.scorer.name, old):
                _refuse_made_otherwise(folder, old)
            _refuse_partial_growth(folder, old)
            grows = True
    return grows


# what a LabelInfo holds that is not a labelling option of the command's own name (the target's
# figures, the task, the count that grows, the command): every other field is one
_NOT_OPTIONS = {"target", "target_name", "hidden", "tap_layers", "task", "scorer", "problems",
                "command"}


def _made_otherwise(args, task: str, scorer: str, old) -> bool:
    """Whether labels ``old`` (a ``LabelInfo``) were made with labelling options other than
    ``args``' for ``task`` (its problem count aside)."""
    return (old.task != task or old.scorer != scorer
            or any(getattr(old, f.name) != getattr(args, f.name) for f in fields(old)
                   if f.name not in _NOT_OPTIONS))


def _refuse_made_otherwise(folder: Path, old) -> None:
    raise ConfigError(f"{folder} holds labels made otherwise ({old.command!r}); give "
                      "another --out or the same labelling options (a generated task "
                      "may grow: a larger --problems continues it when its last shard "
                      "is whole)")


def _refuse_partial_growth(folder: Path, old) -> None:
    """ConfigError where labels ``old`` (a ``LabelInfo``) end in a shard that is not whole: a
    run grows only from a multiple of --per-shard."""
    if old.problems % old.per_shard:
        raise ConfigError(f"{folder} holds {old.problems} problems labelled in shards of "
                          f"{old.per_shard}: its last shard is not whole, so a larger "
                          "--problems cannot continue it (a run grows from a multiple of "
                          "--per-shard); give another --out")


def set_aside_for_growth(out: Path, say) -> None:
    """The labels grow: the classifier made from fewer of them moves to classifier.previous
    (replacing one there), so that a growth stopped before its training leaves no classifier
    that looks finished; the grown run trains a new one."""
    import shutil

    old, aside = out / "classifier", out / "classifier.previous"
    if old.exists():
        shutil.rmtree(aside, ignore_errors=True)
        old.rename(aside)
        say(f"the labels grow: the classifier made before moves to {aside}")


def label_task(args, target, tasks, folder: Path, command: str, deadline, say) -> bool:
    """Label one task set into ``folder`` (resuming); False if the deadline stopped it."""
    from edgespec.heads.fingerprint import runner_fingerprint
    from edgespec.models.loading import encode_prompt, stop_token_ids
    from edgespec.pad.labelling import Labeller, drafter_runner
    from edgespec.pad.labels import LabelInfo
    from edgespec.runner.target_runner import TargetRunner

    encode = lambda text: encode_prompt(target.tokenizer, text)  # noqa: E731
    if not tasks.problems:
        raise ConfigError(f"{tasks.name} has no train problems")
    longest = max(len(encode(p.prompt)) for p in tasks.problems)
    max_len = longest + 2 * args.max_new_tokens + 4
    runner = TargetRunner(target.model, n_slots=args.slots, max_len=max_len)
    try:
        tap_layers = runner.tap_layers(args.tap)
    except ValueError as e:
        raise ConfigError(f"--tap {args.tap}: {e}") from None
    info = LabelInfo(runner_fingerprint(runner), target.name, runner.embed.shape[1], args.tap,
                     tap_layers, tasks.name, tasks.scorer.name, args.drafter,
                     len(tasks.problems), args.per_shard, args.rollouts, args.temperature,
                     args.max_new_tokens, args.max_candidates, args.skip_at, args.seed,
                     command)
    if (folder / "labels.json").exists():
        old = LabelInfo.load(folder)
        if _asks_more(args, old, info):  # a growth ``labels_grow`` allowed (a whole last shard)
            say(f"labels: {tasks.name} grows from {old.problems} to {info.problems} problems "
                "(the first ones are the same)")
            info.save(folder)
        elif replace(old, command="") != replace(info, command=""):
            _refuse_made_otherwise(folder, old)
    else:
        info.save(folder)
    drafter = drafter_runner(args.drafter, target, runner, max_len, target.dtype)
    say(f"labelling {len(tasks.problems)} {tasks.name} problems in {info.shards} shards "
        f"(drafter {args.drafter}, {args.rollouts} rollouts a side)")
    labeller = Labeller(runner, drafter, target.tokenizer, stop_token_ids(target), tasks,
                        encode, info)
    return labeller.run(folder, deadline, say=lambda m: say(f"{tasks.name}: {m}"))


def _check_labels_target(folder: Path, target) -> None:
    """Refuse labels made for another target than ``target`` (a ``LoadedModel``)."""
    from edgespec.heads.fingerprint import target_fingerprint
    from edgespec.pad.labels import LabelInfo

    base = target.model.model  # a transformers causal LM's decoder
    mine = target_fingerprint(base.embed_tokens.weight, base.norm.weight, len(base.layers))
    if LabelInfo.load(folder).target != mine:
        raise ConfigError(f"the labels in {folder} were made for another target")


def label_and_train(args, target, out: Path, command: str, deadline, say) -> dict | None:
    """Label every task, then train; the classifier's manifest as a dict, or None when stopped
    by the deadline or already trained; TooFewLabels (said) without enough labels."""
    import torch

    from edgespec.pad.classifier import MANIFEST, PadConfig, PadManifest, save_classifier
    from edgespec.pad.labels import Candidates, load_labels
    from edgespec.pad.training import TooFewLabels, TrainSettings, train_classifier
    sets = task_sets(args, "train", args.problems)
    if not args.no_label and labels_grow(args, target, sets, out):
        set_aside_for_growth(out, say)
    if (out / "classifier" / MANIFEST).exists():
        say(f"classifier already in {out / 'classifier'}")
        return None
    for tasks in sets:
        folder = out / "labels" / (Path(tasks.name).stem if args.tasks_file else tasks.name)
        if args.no_label:
            _check_labels_target(folder, target)
            continue
        with torch.inference_mode():
            if not label_task(args, target, tasks, folder, command, deadline, say):
                say("stopped by --max-minutes during the labelling; run the same command "
                    "again to resume")
                return None
    parts, counts, info = [], {}, None
    for k, tasks in enumerate(sets):
        folder = out / "labels" / (Path(tasks.name).stem if args.tasks_file else tasks.name)
        labelled = load_labels(folder)
        info = labelled.info
        c = labelled.candidates
        c.problem = c.problem + k * 1_000_000  # held-out problems chosen across tasks
        parts.append(c)
        counts[tasks.name] = {"candidates": len(c), "problems": len(labelled.success),
                              "success": round(float(labelled.success.mean()), 3)
                              if len(labelled.success) else None}
    assert info is not None
    cands = Candidates.concat(parts, info.hidden)
    settings = TrainSettings(alpha=args.alpha, low=args.low, high=args.high,
                             steps=args.train_steps, seed=args.seed)
    cfg = PadConfig(hidden=info.hidden, tap=info.tap, tap_layers=info.tap_layers)
    try:
        model, report = train_classifier(cands, cfg, settings)
    except TooFewLabels as e:
        say(f"no classifier: {e}")
        raise
    # the labels' fingerprint is this target's: label_task refused any other
    manifest = PadManifest(cfg, info.target, target.name,
                           {"tasks": counts, "drafter": info.drafter, "rollouts": info.rollouts,
                            "temperature": info.temperature, **report.counts},
                           command, report.training, report.validation)
    save_classifier(out / "classifier", model, manifest)
    say(f"classifier in {out / 'classifier'}: held-out {report.validation}")
    return {"counts": report.counts, "training": report.training,
            "validation": report.validation}
