"""The imitation step of ``edgespec distill --kinds imitation --exit-layer L``: the layer-L states
of the dataset's responses (``edgespec.heads.exit_states``, beside the data in DATA/exit-L), then
the imitation network trained on them (``edgespec.heads.imitation_training``) into
OUT/imitation-L. Both resume: the states from their first missing shard, the network from its
last checkpoint; a finished network is not trained again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgespec.config import ConfigError


def parse_exit_layers(text: str | None) -> list[int]:
    """``--exit-layer``: one layer or a comma-separated list (each trains its own network)."""
    from edgespec_cli.cli_args import positive_ints

    if not text:
        raise ConfigError("--kinds imitation needs --exit-layer L (the layer drafts exit after)")
    return positive_ints(text, "--exit-layer", "layer numbers")


def check_exit_layers(text: str | None, model: str) -> list[int]:
    """``--exit-layer`` parsed and held to the target's layers (1..layers - 1) from its config
    alone, before the harvest (hours) rather than after it; a GGUF target's layers are known
    once it is loaded (checked then)."""
    from transformers import AutoConfig

    from edgespec.models.loading import resolve_model_path

    layers = parse_exit_layers(text)
    folder, gguf = resolve_model_path(model)
    if gguf is None:
        cfg: Any = AutoConfig.from_pretrained(folder).get_text_config()
        check_within_layers(layers, int(cfg.num_hidden_layers))
    return layers


def check_within_layers(layers: list[int], n_layers: int) -> None:
    bad = [L for L in layers if not 1 <= L < n_layers]
    if bad:
        raise ConfigError(f"--exit-layer must be in 1..{n_layers - 1} for this target, "
                          f"got {bad[0]}")


def imitation_dir(out: Path, layer: int) -> Path:
    return out / f"imitation-{layer}"


def run_imitation(args, out: Path, data: Path, command: str, deadline: float | None
                  ) -> bool:
    """Every ``--exit-layer``'s network; False when the deadline stopped it (resumable)."""
    from edgespec.heads.exit_states import make_exit_states
    from edgespec.heads.imitation import MANIFEST
    from edgespec.heads.imitation_training import ImitationSettings, train_imitation
    from edgespec.heads.training import TargetTensors
    from edgespec.models.loading import load_model
    from edgespec.runner.target_runner import TargetRunner

    from .distill_data import distill_work

    def say(m: str) -> None:
        print(f"distill: {m}", flush=True)

    layers = parse_exit_layers(args.exit_layer)
    todo = [L for L in layers if not (imitation_dir(out, L) / MANIFEST).exists()]
    for L in layers:
        if L not in todo:
            say(f"imitation network (layer {L}) already in {imitation_dir(out, L)}")
    if not todo:
        return True
    loaded = load_model(args.model, args.device, args.dtype)
    model_cfg: Any = loaded.model.config  # a transformers config
    n_layers = int(model_cfg.num_hidden_layers)
    check_within_layers(todo, n_layers)
    items, _ = distill_work(args, loaded.tokenizer)
    prompts = [w.prompt_ids for w in items]
    longest = max(len(p) for p in prompts)
    runner = TargetRunner(loaded.model, n_slots=1, max_len=longest + args.max_new_tokens + 2,
                          n_layers=max(todo), exact=False)
    target = TargetTensors.of_model(loaded.model, loaded.name)
    if not make_exit_states(runner, data, prompts, todo, deadline, say):  # one pass for all
        return False
    for L in todo:
        settings = ImitationSettings(exit_layer=L, ffn=args.imitation_ffn, vocab=args.vocab,
                                     steps=args.imitation_steps, seed=args.seed)
        report = train_imitation(target, n_layers, data, imitation_dir(out, L), settings,
                                 command, deadline, say)
        if report is None:
            return False
        say(f"imitation network (layer {L}) in {imitation_dir(out, L)}: " + json.dumps(report))
    return True
