"""The runner's decoder layers through torch's own ops: the CPU path (``fused_forward`` is CUDA's).

A step's rows are chains (each row's tokens one after another from its slot's length) or token
trees (positioned by depth, stored in node order, each node seeing its ancestors alone). Both go
through ``EagerLayers.run``: the keys and values written into the slots, then
``invariant_attention`` over the slots' cached keys under a visibility mask [B, T, keys], whose
key count is a whole number of key blocks, so that a row's bits do not depend on its batch.
Rows that read far fewer key blocks than others attend in groups of their own
(``attention.row_groups``), with the bits of one call. Rows of different lengths are packed
(``packed_tokens``): the products, norms and MLP run on the rows' own tokens alone, so that a
padding token costs no product (on a CPU a token of a product costs about as much as a step's
attention for it: rows of unequal drafts paid for every row as wide as the widest); the kernels
are row-invariant (the start check), so a token's bits are those of the padded call.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .attention import (KEY_BLOCK, RowGroup, TailKeys, call_ends, invariant_attention,
                        padded_keys, pointwise, row_groups)
from .host_transfers import longs_to_device, to_device
from .kv_cache import contiguous_start
from .step_rows import StepRows


class EagerLayers:
    """A runner's weights, KV cache and rotary tables, run by torch's ops."""

    def __init__(self, runner: Any):
        """``runner``: the ``TargetRunner`` whose weights, cache and tables these run (not
        imported here: it imports this module), held weakly: the runner holds these layers,
        and a CPU runner (its KV cache, its model's weights) is freed when its last user lets
        it go, not at the cycle collector's next pass."""
        self.r = weakref.proxy(runner)

    def chains(self, slots: list[int], tokens: torch.Tensor, start_t: torch.Tensor,
               longest: int, slot_index: torch.Tensor | None = None,
               taps: tuple[int, ...] = (), embeds: torch.Tensor | None = None,
               upto: int | None = None, real: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Chains tokens [B, T] at ``slots`` from positions ``start_t`` [B] (``longest``: the
        largest start), each token seeing its slot's prefix and its row's earlier tokens: the
        residual stream [B, T, H] and the states after each of ``taps`` layers (``run``;
        ``real``: the rows' tokens, ``packed_tokens``)."""
        T = tokens.shape[1]
        pos = start_t[:, None] + torch.arange(T, device=start_t.device)[None, :]  # [B, T]
        n_pos = padded_keys(longest + T, self.r.cache.capacity)
        return self.run(slots, tokens, pos, pos, _causal(pos, n_pos), n_pos,
                        slot_index=slot_index, taps=taps, embeds=embeds, upto=upto, real=real)

    def trees(self, rows: StepRows, taps: tuple[int, ...] = (),
              real: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A step's rows holding token trees (``rows.tree``): row b's node i stored at its
        slot's length + i, positioned by depth, seeing the slot's prefix and its ancestors
        (``rows.ancestors``); branch nodes read their ancestors' keys in decoding order
        (``rows.tail``). The residual stream [B, T, H] and the tapped states."""
        T = rows.width
        start_t = rows.start_index
        n_pos = padded_keys(max(rows.starts) + T, self.r.cache.capacity)
        store = start_t[:, None] + torch.arange(T, device=start_t.device)[None, :]  # [B, T]
        seen = rows.ancestors
        assert seen is not None  # built with every tree
        rope = start_t[:, None] + seen.sum(-1) - 1  # positioned by depth
        keys = torch.arange(n_pos, device=start_t.device)
        visible = (keys[None, None, :] < start_t[:, None, None]).expand(-1, T, -1).clone()
        visible.scatter_(2, store[:, None, :].expand(-1, T, -1), seen)  # [B, T, n_pos]
        tail = rows.tail
        if tail is not None:  # branch nodes sum their row's whole blocks, the rest in order
            tail = replace(tail, seen=visible.clone())
            visible[tail.rows, tail.queries] = \
                keys[None, :] < (tail.block0 * KEY_BLOCK)[:, None]
        return self.run(rows.slots, rows.tokens, store, rope, visible, n_pos, tail,
                        slot_index=rows.slot_index, taps=taps, real=real)

    def run(self, slots: list[int], tokens: torch.Tensor, store: torch.Tensor,
            rope: torch.Tensor, visible: torch.Tensor, n_pos: int,
            tail: TailKeys | None = None, slot_index: torch.Tensor | None = None,
            contiguous: bool = True, taps: tuple[int, ...] = (),
            embeds: torch.Tensor | None = None, upto: int | None = None,
            real: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decoder layers over tokens [B, T]: keys/values written at KV positions
        ``store`` [B, T], rotary positions ``rope`` [B, T], ``visible`` [B, T, n_pos] (which of
        the slots' first n_pos positions each token attends to; n_pos a whole number of key
        blocks); ``slot_index``: ``slots`` on the device, when the caller has them there;
        ``contiguous``: read a run of consecutive slots as a view (False: always by gather);
        ``taps``: layer counts after which the hidden state [B, T, H] is returned too;
        ``embeds`` [B, T, H]: the tokens' input embeddings, given (a vision-language prompt's,
        image features at its image tokens) instead of looked up; ``upto``: run only the first
        ``upto`` layers; ``real`` [N]: the flat indices (b * T + t) of the rows' own tokens
        (``packed_tokens``): the layers' products, norms and MLP then run on those N tokens
        alone, and only the attention on the padded [B, T] (a padding token costs a product
        nothing; its keys and values, written past its row's end, are zeros). Returns the last
        hidden states [B, T, H] (after ``upto`` layers when given; zeros at padding when
        packed) and the state after each of ``taps`` layers, in their order."""
        r = self.r
        B, T = tokens.shape
        cos, sin = r.cos[rope][:, None], r.sin[rope][:, None]  # [B, 1, T, hd]
        slot_t = longs_to_device([slots], r.device)[0] if slot_index is None else slot_index
        run_from = contiguous_start(slots) if contiguous else None
        nh, kvh, hd = r.n_heads, r.kv_heads, r.head_dim
        grp = nh // kvh

        if real is None:
            x = F.embedding(tokens, r.embed) if embeds is None else embeds  # [B, T, H]
        else:  # [N, H]: the rows' own tokens
            x = F.embedding(tokens.reshape(-1).index_select(0, real), r.embed) \
                if embeds is None else embeds.reshape(B * T, -1).index_select(0, real)
        kept: dict[int, torch.Tensor] = {}
        # rows reading far fewer key blocks than others attend apart (the CPU; not a tree's
        # tail), else a long call's query ends (its query pieces'): found once for every layer
        groups = row_groups(visible) if tail is None else ()
        ends = call_ends(visible) if tail is None and not groups else None
        for li, layer in enumerate(r.layers[:upto]):
            h = r._rms(x, layer.ln1)
            qkv = layer.qkv(h)
            if real is not None:
                qkv = unpacked(qkv, real, B, T)
            q, k, v = qkv.split([nh * hd, kvh * hd, kvh * hd], dim=-1)
            q = _rotate(q.view(B, T, nh, hd).transpose(1, 2), cos, sin)  # [B, nh, T, hd]
            k = _rotate(k.view(B, T, kvh, hd).transpose(1, 2), cos, sin)
            r.cache.write(li, slot_t, store, k.transpose(1, 2), v.view(B, T, kvh, hd))
            q = (q * r.scale).view(B, kvh, grp, T, hd)
            if groups:
                att = self.grouped_attention(li, q, slot_t, groups)
            else:
                keys, values = r.cache.read(li, slot_t, run_from, n_pos)
                att = invariant_attention(q, keys, values, visible, r.col_tile, tail,
                                          r.attention_products, ends,
                                          r.attention_cols)  # [B, T, nh * hd]
            if real is not None:
                att = att.reshape(B * T, -1).index_select(0, real)  # [N, nh * hd]
            x = x + layer.o(att)
            gate, up = layer.gate_up(r._rms(x, layer.ln2)).chunk(2, dim=-1)
            x = x + layer.down(pointwise(F.silu, gate) * up)
            if li + 1 in taps:
                kept[li + 1] = x
        if real is not None:
            return unpacked(x, real, B, T), [unpacked(kept[n], real, B, T) for n in taps]
        return x, [kept[n] for n in taps]

    def grouped_attention(self, layer: int, q: torch.Tensor, slot_t: torch.Tensor,
                          groups: tuple[RowGroup, ...]) -> torch.Tensor:
        """``invariant_attention`` of q [B, kvh, g, T, hd] a group of rows at a time, each
        group reading its slots' first keys alone (``row_groups``): [B, T, kvh * g * hd], the
        bits of one call."""
        r = self.r
        B, kvh, g, T, hd = q.shape
        out = q.new_empty(B, T, kvh * g * hd)
        for group in groups:
            keys, values = r.cache.read(layer, slot_t[group.rows], None, group.keys)
            out.index_copy_(0, group.rows, invariant_attention(
                q.index_select(0, group.rows), keys, values, group.visible, r.col_tile,
                None, r.attention_products, group.ends, r.attention_cols))
        return out


def packed_tokens(widths: np.ndarray, T: int, device: torch.device | str = "cpu"
                  ) -> torch.Tensor | None:
    """The flat indices (b * T + t, ascending) of the tokens of rows ``widths`` [B] tokens long
    (host integers) laid out [B, T] (each row's tokens first, then padding): [N] long on
    ``device``; None when no row is padded (nothing to pack). Found on the host: the step
    waits for the device once, for its verdicts."""
    if (widths >= T).all():
        return None
    own = np.arange(T)[None, :] < widths[:, None]  # [B, T]
    return to_device([np.flatnonzero(own)], device, torch.long)[0]  # without a wait


def unpacked(x: torch.Tensor, real: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """Packed rows x [N, C] (at ``real``'s flat indices) laid out [B, T, C], zeros between."""
    out = x.new_zeros(B * T, x.shape[-1])
    out.index_copy_(0, real, x)
    return out.view(B, T, -1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def _causal(pos: torch.Tensor, n_pos: int) -> torch.Tensor:
    """[B, T, n_pos] bool: row b's token t sees the keys at positions <= its own ``pos``."""
    return torch.arange(n_pos, device=pos.device)[None, None, :] <= pos[:, :, None]
