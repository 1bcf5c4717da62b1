"""The pivot classifier: is a draft token that differs from the target's choice a pivot (one after
which the answer goes wrong)? Its folder on disk, and ``pad_keep``, the keep rule verification
applies with it.

Input, at a draft position: the target's hidden state after ``tap_layers`` decoder layers (PAD
reads layer -8, a middle-to-late one), the entropy of the target's distribution there and the
probability it gives the draft token. The hidden state goes to 64 units, the two scalars to 16,
their concatenation to 128, ReLU, then 2 logits (not a pivot, a pivot). Inputs are standardised by
means and spreads measured on the training labels and stored with the weights.

A folder holds ``pad.safetensors`` (weights, float32) and ``pad.json`` (the manifest: the target's
fingerprint, the tap, the labels and command that made it, its held-out validation). A classifier
made for another target is refused (``ConfigError``), as draft heads are.

PAD is lossy: a token it keeps may differ from what the target alone would emit. It is opt-in
(``--verify pad:DIR``, ``edgespec.pad.verify_rule``); nothing here changes exact verification.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..config import PadParams
from ..heads.fingerprint import check_made_for, read_manifest

WEIGHTS, MANIFEST = "pad.safetensors", "pad.json"
FORMAT = 1
DEFAULT_SIGMA = PadParams.sigma  # keep a mismatch whose pivot probability is at most this
DEFAULT_MIN_PROB = PadParams.min_prob  # ... and that the target gives at least this probability


@dataclass(frozen=True)
class PadConfig:
    hidden: int  # H of the target
    tap: int  # the tap as asked (-8: transformers' hidden_states[-8])
    tap_layers: int  # decoder layers run before the tap (TargetRunner.tap_layers(tap))
    hidden_units: int = 64
    scalar_units: int = 16
    mix_units: int = 128


class PivotClassifier(nn.Module):
    """features [..., H], entropy [...], token_prob [...] -> logits [..., 2] (1: a pivot)."""

    feature_mean: torch.Tensor  # [H] buffers: the input standardisation
    feature_std: torch.Tensor  # [H]
    scalar_mean: torch.Tensor  # [2]: entropy, token probability
    scalar_std: torch.Tensor  # [2]

    def __init__(self, cfg: PadConfig):
        super().__init__()
        self.cfg = cfg
        self.hidden_in = nn.Linear(cfg.hidden, cfg.hidden_units)
        self.scalar_in = nn.Linear(2, cfg.scalar_units)
        self.mix = nn.Linear(cfg.hidden_units + cfg.scalar_units, cfg.mix_units)
        self.out = nn.Linear(cfg.mix_units, 2)
        self.register_buffer("feature_mean", torch.zeros(cfg.hidden))
        self.register_buffer("feature_std", torch.ones(cfg.hidden))
        self.register_buffer("scalar_mean", torch.zeros(2))
        self.register_buffer("scalar_std", torch.ones(2))

    def fit_scales(self, features: torch.Tensor, scalars: torch.Tensor) -> None:
        """Standardise inputs by the training rows: features [M, H], scalars [M, 2]."""
        self.feature_mean.copy_(features.float().mean(0))
        self.feature_std.copy_(features.float().std(0).clamp_min(1e-4) if len(features) > 1
                               else torch.ones_like(self.feature_std))
        self.scalar_mean.copy_(scalars.float().mean(0))
        self.scalar_std.copy_(scalars.float().std(0).clamp_min(1e-4) if len(scalars) > 1
                              else torch.ones_like(self.scalar_std))

    def forward(self, features: torch.Tensor, entropy: torch.Tensor, token_prob: torch.Tensor
                ) -> torch.Tensor:
        f = (features.float() - self.feature_mean) / self.feature_std  # [..., H]
        s = torch.stack([entropy.float(), token_prob.float()], -1)  # [..., 2]
        s = (s - self.scalar_mean) / self.scalar_std
        z = torch.cat([self.hidden_in(f), self.scalar_in(s)], -1)  # [..., 80]
        return self.out(torch.relu(self.mix(z)))  # [..., 2]

    @torch.no_grad()
    def pivot_prob(self, features: torch.Tensor, entropy: torch.Tensor,
                   token_prob: torch.Tensor) -> torch.Tensor:
        """The probability [...] float32 that each position is a pivot."""
        return self(features, entropy, token_prob).softmax(-1)[..., 1]


def position_inputs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The classifier's scalar inputs at every position: logits [..., V] (the target's raw
    scores) -> (log-probabilities [..., V] float32, entropy [...] nats), at temperature 1. The
    labels and the verification step both compute them here, so they agree."""
    logp = logits.float().log_softmax(-1)
    return logp, -(logp.exp() * logp).nansum(-1)


def pad_keep(classifier: PivotClassifier, features: torch.Tensor, entropy: torch.Tensor,
             token_prob: torch.Tensor, sigma: float = DEFAULT_SIGMA,
             min_prob: float = DEFAULT_MIN_PROB) -> torch.Tensor:
    """PAD's keep rule for draft tokens the exact rule rejects: features [B, N, H] (the tap's
    hidden state at the position scoring draft token i), entropy [B, N] (nats, of the target's
    distribution there), token_prob [B, N] (the target's probability of draft token i; both at
    temperature 1, before any sampling filter, as the labels were made) ->
    keep [B, N] bool: the pivot probability is at most ``sigma`` and the target gives the token
    at least ``min_prob``. A NaN anywhere in a row's inputs is never kept. The caller keeps a
    token when the exact rule keeps it or this does, and stops at the first it keeps neither."""
    p = classifier.pivot_prob(features, entropy, token_prob)  # [B, N]
    return (p <= sigma) & (token_prob >= min_prob)


@dataclass
class PadManifest:
    config: PadConfig
    target: str  # the target's fingerprint
    target_name: str
    labels: dict = field(default_factory=dict)  # the labelling: task, drafter, counts
    command: str = ""
    training: dict = field(default_factory=dict)  # steps, seconds, best step, seed
    validation: dict = field(default_factory=dict)  # held-out AUC, accuracy, loss

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "config": asdict(self.config),
                           "target": self.target, "target_name": self.target_name,
                           "labels": self.labels, "command": self.command,
                           "training": self.training, "validation": self.validation},
                          indent=1) + "\n"

    @classmethod
    def read(cls, folder: Path) -> "PadManifest":
        return read_manifest(folder, MANIFEST, lambda raw: cls(
            PadConfig(**raw["config"]), raw["target"], raw["target_name"],
            raw.get("labels", {}), raw.get("command", ""), raw.get("training", {}),
            raw.get("validation", {})), "a PAD classifier", "PAD", "edgespec pad-train")


def save_classifier(folder: Path, classifier: PivotClassifier, manifest: PadManifest) -> None:
    """Write the weights (float32) and the manifest into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().contiguous() for k, v in classifier.state_dict().items()},
              str(folder / WEIGHTS))
    (folder / MANIFEST).write_text(manifest.to_json())


def load_classifier(folder: str | Path, runner) -> PivotClassifier:
    """The classifier in ``folder`` for ``runner``'s target (a ``TargetRunner``), float32, eval
    mode, on the runner's device; ConfigError when it was made for another target."""
    folder = Path(folder).expanduser()
    manifest = PadManifest.read(folder)
    check_made_for(runner, manifest.target, manifest.target_name, f"PAD classifier {folder}",
                   "make one for it with edgespec pad-train --model ...")
    classifier = PivotClassifier(manifest.config)
    classifier.load_state_dict(load_file(str(folder / WEIGHTS)))
    return classifier.to(runner.device).eval()
