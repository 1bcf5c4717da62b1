"""The drafter an edge device runs, built from a ``--drafter`` spec, and the tokenizer
fingerprint it registers with (``edgespec drafter`` and the fleet's drafter actor use it)."""

from __future__ import annotations

from edgespec.drafters.spec_check import check_drafter_arg
from edgespec.config import ConfigError
from edgespec.drafters import EDGE_KINDS, Drafter, DrafterSpec, build_drafter, parse_drafter_spec


def build_edge_drafter(spec: str, max_sessions: int = 8, max_context: int = 2048,
                       device: str = "cpu", dtype: str = "float32",
                       context_window: int | None = None) -> tuple[Drafter, str]:
    """The drafter an edge device runs, and the tokenizer fingerprint it registers with ("" for
    tokenizer-free drafters: MaG, Cacheback). A cascade registers its model members'
    fingerprint; members with different tokenizers are refused. ``context_window``: what a
    llama.cpp session reads when it opens (None: its default)."""
    parsed = check_drafter_arg(spec, allowed=EDGE_KINDS)
    members = parsed.members or (parsed,)
    prints = {_fingerprint(m) for m in members} - {""}
    if len(prints) > 1:
        raise ConfigError(f"the members of {spec!r} use different tokenizers")
    drafter = build_drafter(parsed, None, None, n_slots=max_sessions, max_len=max_context,
                            device=device, dtype=dtype, context_window=context_window)
    return drafter, prints.pop() if prints else ""


def runs_torch(spec: str) -> bool:
    """Whether the drafter ``spec`` names runs a model in torch (a ``model:`` drafter, alone or
    in a cascade): MaG, Cacheback and llama.cpp do not, so their process need not import it.
    Reads the spec's form alone (no file, no import); ConfigError where the form is wrong."""
    parsed = parse_drafter_spec(spec, EDGE_KINDS)
    return any(m.kind == "model" for m in parsed.members or (parsed,))


def _fingerprint(spec: DrafterSpec) -> str:
    """The tokenizer fingerprint a drafter registers with (transformers reads the tokenizer;
    torch is not needed for it: a llama.cpp board has none)."""
    if spec.kind not in ("model", "llamacpp"):
        return ""
    from transformers import AutoTokenizer

    from edgespec.models.files import reading_model
    from edgespec.models.tokenizer_id import tokenizer_fingerprint

    if spec.kind == "model":
        from edgespec.models.loading import resolve_model_path

        path, gguf = resolve_model_path(spec.arg)
        with reading_model(spec.arg):
            return tokenizer_fingerprint(AutoTokenizer.from_pretrained(path, gguf_file=gguf))
    from edgespec.drafters.llamacpp import import_llama_cpp, resolve_gguf

    import_llama_cpp()  # a missing extra is said before the default GGUF is fetched
    gguf_path = resolve_gguf(spec.arg)
    with reading_model(gguf_path):
        return tokenizer_fingerprint(AutoTokenizer.from_pretrained(gguf_path.parent,
                                                                   gguf_file=gguf_path.name))
