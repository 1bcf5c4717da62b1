"""A target model's identity for its heads: a head learned one target's features and is refused by
any other (a different model, or the same architecture with other weights). Also how the
folders of what is learned on a target (heads, imitation networks, PAD classifiers) read their
manifests.

The fingerprint hashes the shape of the model and a sample of its weights rounded to bfloat16,
so the same checkpoint loaded in float32 or bfloat16 (the dtypes the verifier serves) gives the
same fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from ..config import ConfigError

T = TypeVar("T")


def target_fingerprint(embed: torch.Tensor, norm: torch.Tensor, n_layers: int) -> str:
    """From the target's token embedding [V, H], final norm weight [H] and layer count."""
    h = hashlib.sha256()
    h.update(f"{tuple(embed.shape)}|{n_layers}".encode())
    sample = embed[:: max(1, embed.shape[0] // 257)].detach()  # [~257, H]: every 191st row here
    for t in (sample, norm.detach()):
        h.update(t.to("cpu", torch.bfloat16).float().numpy().tobytes())
    return h.hexdigest()[:16]


def runner_fingerprint(runner) -> str:
    """The fingerprint of a ``TargetRunner``'s model (all its layers)."""
    return target_fingerprint(runner.embed, runner.norm, runner.n_total_layers)


def check_made_for(runner, made_for: str, made_for_name: str, what: str, remake: str) -> None:
    """Refuse (ConfigError) something learned on another target than ``runner``'s: ``what``
    names it ("head DIR"), ``made_for``/``made_for_name`` are its manifest's fingerprint and
    target name, ``remake`` says how to make one for this target."""
    mine = runner_fingerprint(runner)
    if made_for != mine:
        raise ConfigError(f"{what} was made for another target ({made_for_name}, fingerprint "
                          f"{made_for}); this one's fingerprint is {mine}: {remake}")


def read_manifest(folder: Path, name: str, build: Callable[[dict], T], folder_kind: str,
                  manifest_kind: str, make_with: str) -> T:
    """The manifest ``folder/name``, built by ``build`` from its JSON; ConfigError when it is
    missing ("FOLDER is not {folder_kind} folder ...; make one with {make_with}") or malformed
    ("... is not a valid {manifest_kind} manifest")."""
    path = folder / name
    try:
        return build(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ConfigError(f"{folder} is not {folder_kind} folder (no {name}); make one with "
                          f"{make_with}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path} is not a valid {manifest_kind} manifest: {e}") from None
