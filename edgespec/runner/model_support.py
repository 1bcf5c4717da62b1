"""Which transformers models the runner decodes as transformers does, and what it refuses.

The runner's forward (``target_runner``) is the Llama family's: RMS norms, rotary positions
from the model's own rotary module (its frequencies and attention scaling, read once), biases
on the query, key and value products only, a SiLU-gated MLP, full causal attention. A model whose
config asks for anything else would be decoded as another model, so not as target-only decoding
would: a target's runner (``exact``) refuses it by name before any weight is loaded, with what
to change where the limit is the served context (``max_len``) (a drafter's runner is not held
to it: a draft may be anything, and only its acceptance would suffer):

- an MLP activation other than SiLU (``hidden_act``);
- a bias on the attention's output or the MLP's products (``attention_bias`` puts one on the
  output, ``mlp_bias`` on the MLP's);
- a sliding attention window shorter than the served context (Mistral's ``sliding_window``,
  Qwen2's layers marked ``sliding_attention``, as ``use_sliding_window`` marks them): within
  the window a sliding layer sees what a full one sees, so a context of at most the window is
  served;
- rotary scaling that changes with the sequence's length (``dynamic``, ``longrope``) past the
  length it was trained for: served up to that length.
"""

from __future__ import annotations

from typing import Any

from ..config import ConfigError

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
SILU = ("silu", "swish")
# rotary types whose frequencies transformers recomputes from the sequence's length, past the
# model's original length
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def unsupported_features(model: Any, max_len: int) -> list[str]:
    """What of ``model`` (a transformers causal LM) the runner would not compute as
    transformers does in a context of ``max_len`` tokens; empty when it decodes it exactly."""
    cfg = model.config
    out: list[str] = []
    act = getattr(cfg, "hidden_act", "silu")
    if act not in SILU:
        out.append(f"its MLP activation is {act!r}, the runner's is SiLU")
    layer = model.model.layers[0]
    att, mlp = layer.self_attn, layer.mlp
    biased = [name for name, mod in (("o_proj", att.o_proj), ("gate_proj", mlp.gate_proj),
                                     ("up_proj", mlp.up_proj), ("down_proj", mlp.down_proj))
              if getattr(mod, "bias", None) is not None]
    if biased:
        out.append(f"its {', '.join(biased)} carry biases (attention_bias / mlp_bias), which "
                   f"the runner does not add")
    window = sliding_window(cfg)
    if window is not None and window < max_len:
        out.append(f"its attention slides over {window} tokens, shorter than the {max_len}-token "
                   f"context served (serve a context of at most {window} tokens: --max-context)")
    rotary = model.model.rotary_emb
    rope_type = str(getattr(rotary, "rope_type", "default"))
    trained = rope_length(cfg, rotary)
    if any(kind in rope_type for kind in LENGTH_DEPENDENT_ROPE) and trained is not None and \
            max_len > trained:
        out.append(f"its rotary scaling ({rope_type!r}) changes past {trained} tokens, and "
                   f"{max_len} are served (serve a context of at most {trained}: --max-context)")
    return out


def sliding_window(cfg: Any) -> int | None:
    """The attention window some layer of the model slides in transformers (None: every layer
    sees the whole context): Qwen2 slides the layers its ``layer_types`` mark
    ``sliding_attention``; any other model whose config sets ``sliding_window`` slides
    somewhere (Mistral's attention masks every layer by it, whatever its ``layer_types``; a
    Llama's generation keeps only that many keys in its cache's layers)."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    if cfg.model_type == "qwen2":
        layer_types = getattr(cfg, "layer_types", None) or []
        return int(window) if "sliding_attention" in layer_types else None
    return int(window)


def rope_length(cfg: Any, rotary: Any) -> int | None:
    """The context length past which a length-dependent rotary scaling changes the model's
    frequencies: transformers' ``dynamic`` past the rotary module's original length (the
    config's ``max_position_embeddings``), ``longrope`` past its parameters'
    ``original_max_position_embeddings``."""
    if "longrope" in str(getattr(rotary, "rope_type", "")):
        params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
        if isinstance(params, dict) and params.get("original_max_position_embeddings"):
            return int(params["original_max_position_embeddings"])
    value = getattr(rotary, "original_max_seq_len", None) or \
        getattr(cfg, "max_position_embeddings", None)
    return int(value) if value else None


def check_supported(model: Any, max_len: int, features: bool = True) -> None:
    """Refuse (``ConfigError``) a model the runner would not decode as transformers does in a
    context of ``max_len`` tokens, saying why: a model type it has no forward for, and
    (``features``: a target's runner) a feature of its config it does not compute."""
    kind = model.config.model_type
    if kind not in SUPPORTED_TYPES:
        raise ConfigError(f"the runner supports {', '.join(SUPPORTED_TYPES)} models, not "
                          f"{kind!r}")
    problems = unsupported_features(model, max_len) if features else []
    if problems:
        raise ConfigError("the runner would not decode this model as the model itself does, so "
                          "its output would not be target-only decoding: " +
                          "; ".join(problems))
