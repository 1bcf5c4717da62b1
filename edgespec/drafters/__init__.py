"""Drafters behind one interface, and the parser for ``--drafter`` specs.

Specs: ``none`` (the verifier decodes alone), ``mag`` (max-gram), ``layers:L`` (the target's first
L layers as a self-draft), ``model:PATH`` (a small causal LM sharing the target's tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError
from .adaptive import DraftLength
from .base import Draft, Drafter, DraftSession
from .mag import MaGDrafter
from .model import ModelDrafter

__all__ = ["Draft", "Drafter", "DraftSession", "DraftLength", "MaGDrafter", "ModelDrafter",
           "DrafterSpec", "build_drafter", "parse_drafter_spec", "DRAFTER_HELP"]

FORMS = {"none": "none", "mag": "mag", "layers": "layers:L", "model": "model:PATH"}
DRAFTER_HELP = " | ".join(FORMS.values())


@dataclass(frozen=True)
class DrafterSpec:
    kind: str  # none | mag | layers | model
    arg: str = ""  # layers: L; model: the path


def parse_drafter_spec(spec: str | None, allowed: tuple[str, ...] = tuple(FORMS)
                       ) -> DrafterSpec:
    """Check a ``--drafter`` spec's form (no model is touched); ConfigError if it is wrong."""
    spec = (spec or "none").strip()
    kind, _, arg = spec.partition(":")
    if kind not in allowed or (kind in ("none", "mag") and arg):
        raise ConfigError(f"unknown drafter {spec!r}; use "
                          f"{' | '.join(FORMS[k] for k in allowed)}")
    if kind == "layers" and not arg.isdigit():
        raise ConfigError(f"layers:L needs an integer L, got {arg!r}")
    if kind == "model" and not arg:
        raise ConfigError("model:PATH needs a path")
    return DrafterSpec(kind, arg)


def build_drafter(spec: str, target=None, target_runner=None, n_slots: int = 4,
                  max_len: int = 2048, device: str = "cpu", dtype: str = "float32",
                  loaded=None):
    """Make the drafter a spec names. ``target`` (a LoadedModel) and ``target_runner`` are needed
    by ``layers:L`` (shares the target's weights); with ``target``, ``model:PATH`` is checked
    for the same tokenizer. ``loaded``: the draft model of ``model:PATH``, already loaded."""
    from ..runner import TargetRunner

    parsed = parse_drafter_spec(spec)
    kind, arg = parsed.kind, parsed.arg
    if kind == "none":
        return None
    if kind == "mag":
        return MaGDrafter()
    if kind == "layers":
        if target is None:
            raise ConfigError("layers:L needs the target model")
        runner = TargetRunner(target.model, n_slots=n_slots, max_len=max_len, n_layers=int(arg),
                              share_weights=target_runner)
        return ModelDrafter(runner, name=f"layers:{arg}")
    from ..models import check_same_tokenizer, load_model

    draft = loaded or load_model(arg, device=device, dtype=dtype)
    if target is not None:
        check_same_tokenizer(target.tokenizer, draft.tokenizer, arg)
    return ModelDrafter(TargetRunner(draft.model, n_slots=n_slots, max_len=max_len),
                        name=f"model:{arg}")
