"""A transformers Llama-family model's weights as the target runner holds them.

The runner keeps no transformers module: each decoder layer becomes a ``LayerWeights`` of two
norm vectors and four ``Linear`` products (q, k and v fused into one, gate and up into one),
whose weights are views of one concatenated tensor the model's own modules are made to view
too (no second copy). The rotary tables are built once for every position the cache holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from .linear import Linear, RowCalls

log = logging.getLogger(__name__)


class LayerWeights:
    """One decoder layer's weights: RMS norm vectors ``ln1`` (before attention) and ``ln2``
    (before the MLP), and the products ``qkv`` (q, k, v fused), ``o``, ``gate_up`` (gate and
    up fused) and ``down``."""

    __slots__ = ("ln1", "qkv", "o", "ln2", "gate_up", "down")

    ln1: torch.Tensor
    qkv: Linear
    o: Linear
    ln2: torch.Tensor
    gate_up: Linear
    down: Linear


def fuse(mods: list[torch.nn.Linear], attr: str = "weight") -> torch.Tensor | None:
    """Concatenate the modules' weights (or biases) along dim 0 and make the modules view it
    (None when any module lacks it: a bias-free layer).

    The transformers model keeps working (its parameters become views into the fused tensor), so
    the weights exist once in memory.
    """
    parts = [getattr(m, attr) for m in mods]
    if any(p is None for p in parts):
        return None
    fused = torch.cat([p.data for p in parts], 0)
    offset = 0
    for p in parts:
        n = p.shape[0]
        p.data = fused[offset:offset + n]
        offset += n
    return fused


def load_layer(hf_layer: Any, calls: RowCalls) -> LayerWeights:
    """``hf_layer``: a transformers decoder layer (its submodules are dynamic attributes);
    ``calls``: how each product sends its rows to the kernel."""
    att, mlp = hf_layer.self_attn, hf_layer.mlp
    layer = LayerWeights()
    layer.ln1 = hf_layer.input_layernorm.weight
    layer.ln2 = hf_layer.post_attention_layernorm.weight
    qkv = [att.q_proj, att.k_proj, att.v_proj]
    qkv_weight, gate_up = fuse(qkv), fuse([mlp.gate_proj, mlp.up_proj])
    assert qkv_weight is not None and gate_up is not None  # linears always have weights
    layer.qkv = calls.linear(qkv_weight, fuse(qkv, "bias"))
    layer.o = calls.linear(att.o_proj.weight)
    layer.gate_up = calls.linear(gate_up)
    layer.down = calls.linear(mlp.down_proj.weight)
    return layer


@dataclass
class RunnerWeights:
    """The products and layers a runner computes with: its own, or those of the runner whose
    weights it shares (the first ``n_layers`` of them)."""

    lm_head: Linear
    layers: list[LayerWeights]
    gemm_plans: str  # CUDA's tiles: which products run Triton kernels at some row counts


def load_weights(model: Any, n_layers: int, calls: RowCalls, gemm: str, fused: bool
                 ) -> RunnerWeights:
    """The first ``n_layers`` decoder layers and the LM head of a transformers Llama-like
    ``model`` as products of ``calls``, each computing with ``gemm`` (``linear.GEMMS``) where
    the fused kernels serve; on CUDA's tiles, with the plans proven for their shapes
    (``gemm_plan``)."""
    lm_head = calls.linear(model.lm_head.weight)
    layers = [load_layer(hf_layer, calls) for hf_layer in model.model.layers[:n_layers]]
    linears = [lm_head] + [m for layer in layers for m in
                           (layer.qkv, layer.o, layer.gate_up, layer.down)]
    for lin in linears:
        lin.gemm = gemm
    plans = ""
    if fused and gemm == "tiles" and lm_head.weight.device.type == "cuda":
        from .gemm_plan import attach_plans  # imports Triton

        plans = attach_plans(linears)
        log.info("products: cuBLAS tiles, %s (kernels giving the tiles' bits)", plans)
    return RunnerWeights(lm_head, layers, plans)


def linear_shapes(model: Any) -> tuple[tuple[int, int], ...]:
    """(out, in) of each linear layer the runner builds of a transformers Llama-like ``model``
    (q, k and v fused, gate and up fused), once each."""
    att, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp

    def fused(*mods) -> tuple[int, int]:
        return sum(m.weight.shape[0] for m in mods), mods[0].weight.shape[1]

    found = [fused(att.q_proj, att.k_proj, att.v_proj), tuple(att.o_proj.weight.shape),
             fused(mlp.gate_proj, mlp.up_proj), tuple(mlp.down_proj.weight.shape),
             tuple(model.lm_head.weight.shape)]
    return tuple(dict.fromkeys(found))


def distinct_linears(layer: LayerWeights, lm_head: Linear) -> list[tuple[str, Linear]]:
    """One linear of each (in, out) shape a model has, with its name: ``layer``'s (the first
    layer's, all layers being alike) and the LM head."""
    found: dict[tuple[int, int], tuple[str, Linear]] = {}
    for name, lin in (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.gate_up),
                      ("down", layer.down), ("lm_head", lm_head)):
        found.setdefault(lin.shape, (name, lin))
    return list(found.values())


def rope_tables(rotary: torch.nn.Module, positions: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding's cos and sin [positions, head_dim] in ``dtype``, from a
    transformers rotary module's ``inv_freq`` (and its ``attention_scaling``, if any)."""
    inv_freq = rotary.inv_freq
    assert isinstance(inv_freq, torch.Tensor)  # a buffer of the rotary embedding module
    inv_freq = inv_freq.float().to(device)  # [head_dim / 2]
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    freqs = torch.outer(torch.arange(positions, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # [positions, head_dim]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
