"""The imitation network of FastVLM-style self-speculation: the target drafts for itself from an
intermediate layer L, and a small network makes that layer's hidden state look like the final
layer's before the target's own final norm and LM head read it.

The network (after FastVLM, Bajpai & Hanawal, arXiv 2510.22641): LayerNorm -> Linear(d, d) ->
feed-forward (d -> d_ff -> d, SiLU) -> Linear(d, d), added to its input as a residual. The last
linear starts at zero, so an untrained network is the plain early exit (``layers:L``). Drafting
reads the target's final norm and its LM head cut to a draft vocabulary (the most frequent
tokens of the training data, as the heads do), so a draft token costs L layers, the network
and a [Vd, d] product.

An imitation folder: ``imitation.safetensors`` (the network's weights in bfloat16, and the draft
vocabulary) and ``imitation.json`` (the manifest: the exit layer, the shape, the target's
fingerprint, the data, the command, the training and its validation). The shipped one of the
default model is ``imitation:default``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from ..config import DEFAULT_MODEL_NAME, ConfigError
from .fingerprint import check_made_for, read_manifest
from .manifest import SHIPPED, bind_target, save_bound
from .modules import TargetParts

WEIGHTS, MANIFEST = "imitation.safetensors", "imitation.json"
SHIPPED_DIR = "imitation"  # SHIPPED / model / SHIPPED_DIR: imitation:default
FORMAT = 1


@dataclass(frozen=True)
class ImitationConfig:
    kind: ClassVar[str] = "imitation"  # what the verifier's status reports as the head's kind
    exit_layer: int  # L: the target layer drafts exit after (1..n_layers - 1)
    n_layers: int  # the target's decoder layers
    hidden: int  # d
    ffn: int  # d_ff
    draft_vocab: int  # Vd
    depth: int = 6  # K: most tokens drafted a step
    eps: float = 1e-5  # the target's RMSNorm epsilon

    def as_dict(self) -> dict:
        return asdict(self)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class ImitationNet(nn.Module):
    """Layer L's hidden state [..., d] -> an imitation of the last layer's [..., d], read out
    through the target's final norm and draft-vocabulary LM rows (``target``)."""

    def __init__(self, cfg: ImitationConfig, target: TargetParts):
        super().__init__()
        self.cfg, self.target = cfg, target
        self.held_out = 0.0  # first-draft accuracy on held-out data, where it was measured
        d = cfg.hidden
        self.ln = nn.LayerNorm(d)
        self.inp = nn.Linear(d, d)
        self.up = nn.Linear(d, cfg.ffn)
        self.down = nn.Linear(cfg.ffn, d)
        self.out = nn.Linear(d, d)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., d]: the imitated last-layer hidden state (before the final norm)."""
        y = self.inp(self.ln(h.to(self.inp.weight.dtype)))
        y = self.down(F.silu(self.up(y)))
        return h.to(y.dtype) + self.out(y)

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """Layer L's state [..., d] -> what the LM head reads [..., d] (through the final
        norm)."""
        y = self(h)
        return _rms(y, self.cfg.eps) * self.target.norm.to(y.dtype)

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Features [..., d] -> draft-vocabulary logits [..., Vd]."""
        return feats @ self.target.lm_rows.to(feats.dtype).T

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


@dataclass
class ImitationManifest:
    config: ImitationConfig
    target: str  # the target's fingerprint
    target_name: str
    data: dict = field(default_factory=dict)
    command: str = ""
    training: dict = field(default_factory=dict)
    validation: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "kind": "imitation",
                           "exit_layer": self.config.exit_layer,
                           "config": self.config.as_dict(), "target": self.target,
                           "target_name": self.target_name, "data": self.data,
                           "command": self.command, "training": self.training,
                           "validation": self.validation}, indent=1) + "\n"

    @classmethod
    def read(cls, folder: Path) -> "ImitationManifest":
        return read_manifest(folder, MANIFEST, lambda raw: cls(
            ImitationConfig(**raw["config"]), raw["target"], raw["target_name"],
            raw.get("data", {}), raw.get("command", ""), raw.get("training", {}),
            raw.get("validation", {})), "an imitation", "imitation",
            "edgespec distill --kinds imitation")


def save_imitation(folder: Path, net: ImitationNet, manifest: ImitationManifest) -> None:
    """The network's weights (bfloat16), its draft vocabulary and manifest into ``folder``."""
    save_bound(folder, net, net.target.vocab_ids, WEIGHTS, MANIFEST, manifest.to_json())


def resolve_imitation_dir(spec: str, model_name: str = DEFAULT_MODEL_NAME) -> Path:
    """``default`` (the network shipped for the default model) or a folder."""
    if spec == "default":
        folder = SHIPPED / model_name / SHIPPED_DIR
        if not (folder / MANIFEST).exists():
            raise ConfigError(f"no shipped imitation network for {model_name} in this install; "
                              "make one with edgespec distill --kinds imitation and give its "
                              "folder")
        return folder
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"imitation network {spec!r} not found: give a folder made by "
                          "edgespec distill --kinds imitation, or 'default'")
    return folder


def bind_imitation(cfg: ImitationConfig, runner, vocab_ids: torch.Tensor) -> ImitationNet:
    """A fresh network of ``cfg`` over ``runner``'s final norm and LM head rows (float32)."""
    return ImitationNet(cfg, bind_target(runner.embed, runner.lm_head.weight, runner.norm,
                                         vocab_ids, torch.float32))


def load_imitation(spec: str, runner) -> ImitationNet:
    """The network ``spec`` names, bound to ``runner``'s final norm and LM head; refused
    (ConfigError) when made for another target or for an exit layer the runner lacks.
    Float32, on the runner's device."""
    folder = resolve_imitation_dir(spec)
    manifest = ImitationManifest.read(folder)
    check_made_for(runner, manifest.target, manifest.target_name, f"imitation network {folder}",
                   "make one for it with edgespec distill --kinds imitation --model ...")
    cfg = manifest.config
    if not 1 <= cfg.exit_layer < runner.n_layers:
        raise ConfigError(f"imitation network {folder} exits after layer {cfg.exit_layer}; "
                          f"the target has {runner.n_layers}")
    weights = load_file(str(folder / WEIGHTS))
    vocab_ids = weights.pop("vocab_ids").long()
    net = bind_imitation(cfg, runner, vocab_ids)
    net.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    net.held_out = float(manifest.validation.get("first_draft_accuracy", 0.0))
    return net.to(runner.device).eval()
