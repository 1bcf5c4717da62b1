"""Random-weight models of real shapes, built from a config in seconds (no download): what a
verifier of that size costs, and the hardest lossless test (random weights put near-ties
everywhere). ``bench-forward --shape``, the GPU sitting and the CUDA tests use them.

The shapes are those of SmolLM2-135M (the default model), SmolLM2-1.7B and Llama-3.1-8B, read from
their published configs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family model's shape (what the runner's cost and kernels depend on)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    tied: bool  # the LM head is the embedding
    rope_theta: float = 10000.0


SHAPES = {
    "135m": ModelShape(hidden=576, layers=30, heads=9, kv_heads=3, mlp=1536, vocab=49152,
                       tied=True, rope_theta=100000.0),
    "1.7b": ModelShape(hidden=2048, layers=24, heads=32, kv_heads=32, mlp=8192, vocab=49152,
                       tied=True, rope_theta=130000.0),
    "8b": ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, mlp=14336, vocab=128256,
                     tied=False, rope_theta=500000.0),
}


def shape_named(name: str) -> ModelShape:
    from ..config import ConfigError

    if name not in SHAPES:
        raise ConfigError(f"unknown model shape {name!r}: one of {', '.join(SHAPES)}")
    return SHAPES[name]


def random_model(name: str, device: str = "cpu", dtype: str = "bfloat16",
                 layers: int | None = None, seed: int = 0) -> Any:
    """A transformers ``LlamaForCausalLM`` of shape ``name`` with random weights, made directly
    on ``device`` in ``dtype`` (an 8B model never exists in float32 on the host). ``layers``
    keeps only the first layers (a dry run on a CPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = shape_named(name)
    cfg = LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.mlp,
                      num_hidden_layers=layers or s.layers, num_attention_heads=s.heads,
                      num_key_value_heads=s.kv_heads, max_position_embeddings=4096,
                      rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta},
                      tie_word_embeddings=s.tied,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    return model.eval()
