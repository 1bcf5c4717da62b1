"""A training run's checkpoint, shared by the draft heads' and the imitation networks' training:
the trained module's own weights (not the target's tensors it binds), the optimiser, the
sampling generator and the progress, written atomically; resumed only by a run of the same
settings on the same data (``ConfigError`` otherwise). Also what both training loops share
besides: the learning-rate schedule, the progress line and the loss summary."""

from __future__ import annotations

import math
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


def set_learning_rate(opt: torch.optim.Optimizer, lr: float, step: int, steps: int,
                      warmup: int) -> None:
    """Step ``step`` of ``steps``: cosine decay from ``lr``, warmed up linearly over the first
    ``warmup`` steps."""
    rate = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
    for group in opt.param_groups:
        group["lr"] = rate * min(1.0, (step + 1) / warmup)


def progress_line(step: int, steps: int, first: int, seconds: float,
                  losses: list[float]) -> str:
    """Where a run stands: the step, the recent loss, steps a second since it (re)started at
    ``first`` ``seconds`` ago, and the time left."""
    rate = (step - first) / max(1e-9, seconds)
    recent = sum(losses[-50:]) / len(losses[-50:])
    return (f"step {step}/{steps}, loss {recent:.3f}, {rate:.1f} steps/s, "
            f"ETA {(steps - step) / max(rate, 1e-9) / 60:.1f} min")


def loss_summary(losses: list[float]) -> dict[str, float]:
    """The mean loss of the first and of the last 20 steps, for a manifest."""
    return {"loss_first": round(sum(losses[:20]) / max(1, len(losses[:20])), 4),
            "loss_last": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4)}
