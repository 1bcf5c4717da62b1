"""Checks of a ``--drafter`` spec before any model loads: an unknown kind, or a model, GGUF file
or head folder that does not exist, is refused with a ConfigError (torch-free: an edge board runs
it; a model path check imports the model loader only when a model is named)."""

from __future__ import annotations

from pathlib import Path

from ..config import DEFAULT_MODEL_NAME, HEAD_KINDS, ConfigError
from . import FORMS, parse_drafter_spec

SHIPPED_HEADS = ("default", *HEAD_KINDS)


def check_head_arg(spec: str | None) -> None:
    """Refuse a head folder (or an imitation network's, ``imitation:DIR``) that does not exist
    before anything loads."""
    if spec and spec.startswith("imitation:"):
        folder = spec.removeprefix("imitation:")
        if folder != "default" and not Path(folder).expanduser().is_dir():
            raise ConfigError(f"imitation network {folder!r} not found: give a folder made by "
                              "edgespec distill --kinds imitation, or 'default' (shipped)")
        return
    if spec and spec not in SHIPPED_HEADS and not Path(spec).expanduser().is_dir():
        raise ConfigError(f"head {spec!r} not found: give a head folder (made by edgespec "
                          f"distill), or one of {', '.join(SHIPPED_HEADS)} (shipped)")


def check_model_arg(spec: str) -> None:
    """Refuse a model path that does not exist before anything loads (the default is pulled
    later, on first use)."""
    if spec not in ("", "default", DEFAULT_MODEL_NAME):
        from ..models.loading import resolve_model_path

        resolve_model_path(spec)


def check_drafter_arg(spec: str, allowed: tuple[str, ...] | None = None):
    """Refuse an unknown drafter spec (``allowed``: the kinds this command runs; None: every
    kind), or a model drafter or GGUF file (a cascade's members included) that is missing,
    before any model loads; returns the parsed ``DrafterSpec``."""
    parsed = parse_drafter_spec(spec, tuple(FORMS) if allowed is None else allowed)
    check_head_arg(parsed.head)
    for member in parsed.members or (parsed,):
        if member.kind == "model":
            check_model_arg(member.arg)
        if member.kind == "llamacpp" and member.arg != "default" and \
                not Path(member.arg).expanduser().is_file():
            raise ConfigError(f"llamacpp drafter: GGUF file {member.arg!r} not found")
    return parsed
