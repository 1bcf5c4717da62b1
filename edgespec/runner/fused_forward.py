"""The runner's decoder layers through the fused kernels (``fused_kernels``): the GPU path.

One layer is nine launches (gpt-fast's shape of a step, with batch-invariant kernels):

    h = add_rms_norm(x, delta, ln1)        # the previous layer's residual add, then the norm
    qkv = qkv.tiles(h)                      # cuBLAS, 128-row tiles (``Linear.tiles``)
    q = rope_write_kv(qkv)                  # keys and values into their slots
    att = slot_attention(q)                 # ``fused_attention``: lengths, tree paths on device
    h = add_rms_norm(x, o.tiles(att), ln2)
    delta = down.tiles(silu_mul(gate_up.tiles(h)))

Every path of the runner (decode, chains, trees, prefill, taps, early exits, the graph buckets)
goes through ``FusedLayers.hidden`` on such a runner, so target-only and speculative rows meet
the same kernels. Each staging buffer holds whole tiles of rows; nothing reads a padding row's
output. No host sync, no host-dependent control flow beyond the shapes: capturable as is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from . import fused_kernels as fk
from .fused_attention import slot_attention
from .fused_kernels import FusedStep
from .host_transfers import longs_to_device
from .step_rows import Scored


class FusedLayers:
    """A runner's weights, KV cache and rotary tables, run through the fused kernels."""

    def __init__(self, runner: Any):
        """``runner``: the ``TargetRunner`` whose weights, cache and tables these run (not
        imported here: it imports this module)."""
        self.r = runner

    def hidden(self, tokens: torch.Tensor, step: FusedStep, embeds: torch.Tensor | None = None,
               taps: tuple[int, ...] = (), upto: int | None = None
               ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
        """tokens [B, T] long (or ``embeds`` [B, T, H]) at ``step``'s slots and positions.
        Returns the residual stream after the last layer run [B T, H], the states after each
        of ``taps`` layers (in their order, [B T, H] each), and the final norm's output
        [padded rows, H] (None when ``upto`` stops early: those rows need no head)."""
        r = self.r
        nh, kvh, hd = r.n_heads, r.kv_heads, r.head_dim
        R = step.rows
        if embeds is None:
            x = F.embedding(tokens.reshape(R), r.embed)  # [R, H], its own memory
        else:
            x = embeds.reshape(R, -1).to(r.dtype).clone(memory_format=torch.contiguous_format)
        kept: dict[int, torch.Tensor] = {}
        layers = r.layers[:upto]
        delta: torch.Tensor | None = None
        for li, layer in enumerate(layers):
            h = fk.add_rms_norm(x, delta, layer.ln1, r.eps)  # x after li layers
            if li in taps:
                kept[li] = x.clone()
            q = fk.rope_write_kv(layer.qkv.tiles(h, R), r.cos, r.sin, step, r.cache.k[li],
                                 r.cache.v[li], nh, kvh, hd)
            att = slot_attention(q, step, r.cache.k[li], r.cache.v[li], nh, kvh, hd, r.scale,
                                 kernel=r.attention)
            h = fk.add_rms_norm(x, layer.o.tiles(att, R), layer.ln2, r.eps)
            delta = layer.down.tiles(fk.silu_mul(layer.gate_up.tiles(h, R), R), R)
        feats = fk.add_rms_norm(x, delta, r.norm, r.eps)  # the last residual add, the norm
        if len(layers) in taps:
            kept[len(layers)] = x.clone()
        full = upto is None or upto >= len(r.layers)
        return x, [kept[n] for n in taps], feats if full else None

    def chain_step(self, slots: list[int], starts: torch.Tensor, width: int,
                   slot_index: torch.Tensor | None = None, keys: int | None = None
                   ) -> FusedStep:
        """A step of chains at ``slots`` (``slot_index``: them on the device, when the caller
        has them there) from ``starts`` [B] (device); ``keys``: the largest start + width,
        where the host knows it."""
        index = slot_index if slot_index is not None else \
            longs_to_device([slots], self.r.device)[0]
        return FusedStep.chains(index, starts, width, keys)

    def scored(self, tokens: torch.Tensor, step: FusedStep, tap_after: int | None = None
               ) -> Scored:
        """Every row's logits [B, T, V] float32 and features [B, T, H] (and, with
        ``tap_after``, the state after that many layers [B, T, H])."""
        B, T = step.batch, step.width
        _, kept, feats = self.hidden(tokens, step, taps=() if tap_after is None else
                                     (tap_after,))
        assert feats is not None
        R = B * T
        logits = self.r.lm_head.tiles(feats, R)[:R].float().view(B, T, -1)
        tapped = kept[0].view(B, T, -1) if kept else None
        return Scored(logits, feats[:R].view(B, T, -1), tapped)

