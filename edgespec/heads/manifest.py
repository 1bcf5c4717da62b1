"""A head folder: ``head.safetensors`` (the trained weights and the draft vocabulary) and
``head.json`` (the manifest: kind, shape, the target it was made for, the dtype of the features it
learned from, the data and command that made it, its validation acceptance).

A head is refused by a target other than its own (``target_fingerprint``); the shipped heads of
the default model live in this package (``head:default``, ``head:eagle`` ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import DEFAULT_MODEL_NAME, ConfigError
from .fingerprint import check_made_for, read_manifest
from .modules import KINDS, DraftHead, HeadConfig, TargetParts

WEIGHTS, MANIFEST = "head.safetensors", "head.json"
SHIPPED = Path(__file__).parent / "shipped"
FORMAT = 1


@dataclass
class HeadManifest:
    config: HeadConfig
    target: str  # the target's fingerprint
    target_name: str
    feature_dtype: str  # the dtype of the features it was trained on
    data: dict = field(default_factory=dict)  # the dataset: folder, tokens, sources
    command: str = ""
    training: dict = field(default_factory=dict)  # steps, seconds, loss, seed
    validation: dict = field(default_factory=dict)  # acceptance on held-out sequences

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "kind": self.config.kind,
                           "config": self.config.as_dict(), "target": self.target,
                           "target_name": self.target_name,
                           "feature_dtype": self.feature_dtype, "data": self.data,
                           "command": self.command, "training": self.training,
                           "validation": self.validation}, indent=1) + "\n"

    @classmethod
    def read(cls, folder: Path) -> "HeadManifest":
        return read_manifest(folder, MANIFEST, lambda raw: cls(
            HeadConfig(**raw["config"]), raw["target"], raw["target_name"],
            raw["feature_dtype"], raw.get("data", {}), raw.get("command", ""),
            raw.get("training", {}), raw.get("validation", {})), "a head", "head",
            "edgespec distill")


def save_head(folder: Path, head: DraftHead, manifest: HeadManifest) -> None:
    """Write the head's trainable weights (bfloat16) and manifest into ``folder``."""
    save_bound(folder, head, head.target.vocab_ids, WEIGHTS, MANIFEST, manifest.to_json())


def save_bound(folder: Path, module: torch.nn.Module, vocab_ids: torch.Tensor, weights: str,
               manifest: str, manifest_text: str) -> None:
    """A module bound to a target's tensors (``bind_target``: its ``target.`` entries are the
    target's, not saved), written into ``folder``: its own weights in bfloat16 and its draft
    vocabulary's ids [D] in ``weights``, ``manifest_text`` in ``manifest``."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous()
               for k, v in module.state_dict().items() if not k.startswith("target.")}
    tensors["vocab_ids"] = vocab_ids.to(torch.int32).contiguous()
    save_file(tensors, str(folder / weights))
    (folder / manifest).write_text(manifest_text)


def resolve_head_dir(spec: str, model_name: str = DEFAULT_MODEL_NAME) -> Path:
    """A head spec: a folder, or a shipped head of the default model: 'default' (its best kind)
    or a kind name."""
    if spec in ("default", *KINDS):
        base = SHIPPED / model_name
        kind = (base / "DEFAULT").read_text().strip() if spec == "default" and \
            (base / "DEFAULT").exists() else spec
        folder = base / kind
        if not (folder / MANIFEST).exists():
            raise ConfigError(f"no shipped {spec!r} head for {model_name} in this install; "
                              "make one with edgespec distill and give its folder")
        return folder
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"head {spec!r} not found: give a head folder (made by edgespec "
                          f"distill), 'default' or a kind ({', '.join(KINDS)})")
    return folder


def load_head(spec: str, runner, device: str | torch.device | None = None) -> DraftHead:
    """The head ``spec`` names, bound to ``runner``'s frozen embedding, LM head and norm; refused
    (ConfigError) when it was made for another target. Runs in float32 on the runner's device."""
    folder = resolve_head_dir(spec)
    manifest = HeadManifest.read(folder)
    check_made_for(runner, manifest.target, manifest.target_name, f"head {folder}",
                   "make a head for it with edgespec distill --model ...")
    weights = load_file(str(folder / WEIGHTS))
    vocab_ids = weights.pop("vocab_ids").long()
    dev = device or runner.device
    head = DraftHead(manifest.config, bind_target(runner.embed, runner.lm_head.weight,
                                                  runner.norm, vocab_ids, torch.float32))
    head.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    head.held_out = float(manifest.validation.get("tokens_per_step", 0.0))
    return head.to(dev).eval()


def bind_target(embed: torch.Tensor, lm_weight: torch.Tensor, norm: torch.Tensor,
                vocab_ids: torch.Tensor, dtype: torch.dtype) -> TargetParts:
    """The frozen target tensors a head reads, its LM head cut to the draft vocabulary."""
    ids = vocab_ids.to(lm_weight.device)
    return TargetParts(embed.detach(), lm_weight.detach()[ids].to(dtype),
                       norm.detach().to(dtype), vocab_ids)
