"""Drafters behind one interface, and the parser for ``--drafter`` specs.

Specs: ``none`` (the verifier decodes alone), ``mag`` (max-gram), ``layers:L`` (the target's first
L layers as a self-draft), ``model:PATH`` (a small causal LM sharing the target's tokenizer).
"""

from __future__ import annotations

from ..config import ConfigError
from .adaptive import DraftLength
from .base import Draft, Drafter, DraftSession
from .mag import MaGDrafter
from .model import ModelDrafter

__all__ = ["Draft", "Drafter", "DraftSession", "DraftLength", "MaGDrafter", "ModelDrafter",
           "build_drafter", "DRAFTER_HELP"]

DRAFTER_HELP = "none | mag | layers:L | model:PATH"


def build_drafter(spec: str, target=None, target_runner=None, n_slots: int = 4,
                  max_len: int = 2048, device: str = "cpu", dtype: str = "float32",
                  loaded=None):
    """Make the drafter a spec names. ``target`` (a LoadedModel) and ``target_runner`` are needed
    by ``layers:L`` (shares the target's weights); with ``target``, ``model:PATH`` is checked
    for the same tokenizer. ``loaded``: the draft model of ``model:PATH``, already loaded."""
    from ..runner import TargetRunner

    spec = (spec or "none").strip()
    if spec == "none":
        return None
    if spec == "mag":
        return MaGDrafter()
    kind, _, arg = spec.partition(":")
    if kind == "layers":
        if target is None:
            raise ConfigError("layers:L needs the target model")
        try:
            n_layers = int(arg)
        except ValueError:
            raise ConfigError(f"layers:L needs an integer L, got {arg!r}") from None
        runner = TargetRunner(target.model, n_slots=n_slots, max_len=max_len, n_layers=n_layers,
                              share_weights=target_runner)
        return ModelDrafter(runner, name=spec)
    if kind == "model":
        from ..models import check_same_tokenizer, load_model

        if not arg:
            raise ConfigError("model:PATH needs a path")
        draft = loaded or load_model(arg, device=device, dtype=dtype)
        if target is not None:
            check_same_tokenizer(target.tokenizer, draft.tokenizer, arg)
        return ModelDrafter(TargetRunner(draft.model, n_slots=n_slots, max_len=max_len),
                            name=spec)
    raise ConfigError(f"unknown drafter {spec!r}; use {DRAFTER_HELP}")
