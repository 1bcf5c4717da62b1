"""Drafters behind one interface, and the parser for ``--drafter`` specs.

Specs: ``none`` (the verifier decodes alone), ``mag`` (max-gram), ``cacheback`` (LRU n-gram
tables, per session, per drafter and fleet-wide), ``mag+cacheback`` (a suffix match first, then
Cacheback), ``layers:L`` (the target's first L layers as a self-draft), ``model:PATH`` (a small
causal LM sharing the target's tokenizer), ``llamacpp:FILE.gguf`` (a GGUF model run by
llama-cpp-python, the optional ``llamacpp`` extra), ``cascade:SPEC,SPEC,...`` (the first member
drafts for the target; each next member drafts for the one before it and fills its later
positions).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError
from .adaptive import DraftLength
from .base import Draft, Drafter, DraftSession
from .mag import MaGDrafter

# ModelDrafter (torch) is importable by name but left out of *: importing the package must not
# load torch
__all__ = ["Draft", "Drafter", "DraftSession", "DraftLength", "MaGDrafter",
           "DrafterSpec", "build_drafter", "parse_drafter_spec", "DRAFTER_HELP"]

FORMS = {"none": "none", "auto": "auto", "mag": "mag", "cacheback": "cacheback",
         "mag+cacheback": "mag+cacheback", "layers": "layers:L", "model": "model:PATH",
         "llamacpp": "llamacpp:FILE.gguf", "cascade": "cascade:SPEC,SPEC,...",
         "head": "head:DIR (or SPEC+head:DIR)",
         "imitation": "imitation:DIR (or SPEC+imitation:DIR)"}
DRAFTER_HELP = " | ".join(FORMS.values())
# what a drafter device (``edgespec drafter``, deploy, simulate) can run: no target on the board
EDGE_KINDS = ("mag", "cacheback", "mag+cacheback", "model", "llamacpp", "cascade")
_NO_ARG = ("none", "auto", "mag", "cacheback", "mag+cacheback")


@dataclass(frozen=True)
class DrafterSpec:
    kind: str  # one of FORMS
    arg: str = ""  # layers: L; model: the path; llamacpp: the GGUF file; cascade: the members
    members: tuple["DrafterSpec", ...] = ()  # cascade: top (drafting for the target) first
    # SPEC+head:DIR: a draft head drafting in the verifier beside the drafter; "imitation:DIR"
    # for imitation drafting (EngineConfig.head)
    head: str = ""


def parse_drafter_spec(spec: str | None, allowed: tuple[str, ...] = tuple(FORMS)
                       ) -> DrafterSpec:
    """Check a ``--drafter`` spec's form (no model is touched); ConfigError if it is wrong."""
    spec = (spec or "none").strip()
    for form in ("head", "imitation"):
        base, plus, head = spec.partition(f"+{form}:")
        if not plus:
            continue
        if not head or form not in allowed:
            raise ConfigError(f"unknown drafter {spec!r}; SPEC+{form}:DIR needs a folder "
                              "(and a command that verifies)")
        drafter = parse_drafter_spec(base, allowed)
        if drafter.head:
            raise ConfigError(f"one head at a time, got {spec!r}")
        return DrafterSpec(drafter.kind, drafter.arg, drafter.members,
                           head=head if form == "head" else f"imitation:{head}")
    kind, _, arg = spec.partition(":")
    if kind not in allowed or (kind in _NO_ARG and arg):
        what = "not a drafter this command runs" if kind in FORMS and not (
            kind in _NO_ARG and arg) else "unknown drafter"
        raise ConfigError(f"{what} {spec!r}; use "
                          f"{' | '.join(FORMS[k] for k in allowed if k in FORMS)}")
    if kind == "layers" and not arg.isdigit():
        raise ConfigError(f"layers:L needs an integer L, got {arg!r}")
    if kind in ("model", "llamacpp", "head", "imitation") and not arg:
        raise ConfigError(f"{FORMS[kind]} needs a path")
    if kind == "head":
        return DrafterSpec(kind, arg, head=arg)
    if kind == "imitation":
        return DrafterSpec(kind, arg, head=f"imitation:{arg}")
    if kind == "cascade":
        inner = tuple(k for k in allowed
                      if k not in ("none", "auto", "cascade", "head", "imitation"))
        members = tuple(parse_drafter_spec(m, inner) for m in arg.split(",") if m.strip())
        if len(members) < 2:
            raise ConfigError(f"cascade:SPEC,SPEC,... needs at least two drafters, got {arg!r}")
        return DrafterSpec(kind, arg, members)
    return DrafterSpec(kind, arg)


def __getattr__(name):
    # the model drafter needs torch: imported when asked for, so that the package (MaG,
    # Cacheback, llama.cpp) loads on a board without it
    if name == "ModelDrafter":
        from .model import ModelDrafter

        return ModelDrafter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_drafter(spec: str | DrafterSpec, target=None, target_runner=None, n_slots: int = 4,
                  max_len: int = 2048, device: str = "cpu", dtype: str = "float32",
                  loaded=None, fleet=None, context_window: int | None = None):
    """Make the drafter a spec names. ``target`` (a LoadedModel) and ``target_runner`` are needed
    by ``layers:L`` (shares the target's weights); with ``target``, ``model:PATH`` and
    ``llamacpp:FILE`` are checked for the same tokenizer. ``loaded``: the draft model of
    ``model:PATH``, already loaded. ``fleet``: a ``FleetTable`` that Cacheback drafters read the
    fleet's n-grams from (None: per session and per drafter only). ``context_window``: how
    many tokens a ``llamacpp:`` session reads when it opens (None: its default)."""
    parsed = spec if isinstance(spec, DrafterSpec) else parse_drafter_spec(spec)
    kind, arg = parsed.kind, parsed.arg
    if kind in ("none", "head", "imitation"):  # they draft in the verifier (EngineConfig.head)
        return None
    if kind == "mag":
        return MaGDrafter()
    if kind in ("cacheback", "mag+cacheback", "auto"):  # auto: with a head, chosen per step
        from .cacheback import CachebackDrafter

        return CachebackDrafter(fleet=fleet, with_mag=kind != "cacheback")
    if kind == "layers":
        if target is None:
            raise ConfigError("layers:L needs the target model")
        from ..runner.target_runner import TargetRunner
        from .model import ModelDrafter

        runner = TargetRunner(target.model, n_slots=n_slots, max_len=max_len, n_layers=int(arg),
                              share_weights=target_runner, exact=False)
        return ModelDrafter(runner, name=f"layers:{arg}")
    if kind == "llamacpp":
        from .llamacpp import LlamaCppDrafter

        return LlamaCppDrafter(arg, n_slots=n_slots, max_len=max_len,
                               target_tokenizer=target.tokenizer if target else None,
                               context_window=context_window)
    if kind == "cascade":
        from .cascade import CascadeDrafter

        return CascadeDrafter([build_drafter(m, target, target_runner, n_slots, max_len, device,
                                             dtype, fleet=fleet, context_window=context_window)
                               for m in parsed.members])
    from ..models.loading import check_same_tokenizer, load_model
    from ..runner.target_runner import TargetRunner
    from .model import ModelDrafter

    draft = loaded or load_model(arg, device=device, dtype=dtype, exact=False)
    if target is not None:
        check_same_tokenizer(target.tokenizer, draft.tokenizer, arg)
    return ModelDrafter(TargetRunner(draft.model, n_slots=n_slots, max_len=max_len, exact=False),
                        name=f"model:{arg}")
