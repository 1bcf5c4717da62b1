"""A training run's checkpoint, shared by the draft heads' and the imitation networks' training:
the trained module's own weights (not the target's tensors it binds), the optimiser, the
sampling generator and the progress, written atomically; resumed only by a run of the same
settings on the same data (``ConfigError`` otherwise)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..config import ConfigError


def save_checkpoint(path: Path, key: str, module: nn.Module, opt: torch.optim.Optimizer,
                    rng: torch.Generator, step: int, spent: float, losses: list[float],
                    settings: dict, data: str) -> None:
    """Write the run's state to ``path`` (via a temporary file); ``key`` names the module's
    weights in it ("head", "net")."""
    tmp = path.with_suffix(".tmp")
    torch.save({key: {k: v for k, v in module.state_dict().items()
                      if not k.startswith("target.")},
                "opt": opt.state_dict(), "rng": rng.get_state(), "step": step, "spent": spent,
                "losses": losses, "settings": settings, "data": data}, tmp)
    tmp.replace(path)


def load_checkpoint(path: Path, key: str, module: nn.Module, opt: torch.optim.Optimizer,
                    rng: torch.Generator, settings: dict, data: str
                    ) -> tuple[int, float, list[float]] | None:
    """Restore ``module``, ``opt`` and ``rng`` from ``path``; (step, seconds spent, losses),
    or None when there is no checkpoint."""
    if not path.exists():
        return None
    state = torch.load(path, weights_only=False)
    if state["settings"] != settings or state["data"] != data:
        raise ConfigError(f"{path} is a checkpoint of other settings or data: delete it "
                          "or give the same options")
    module.load_state_dict(state[key], strict=False)
    opt.load_state_dict(state["opt"])
    rng.set_state(state["rng"])
    return state["step"], state["spent"], state["losses"]
