"""The target runner: a lean forward pass over many sessions' KV slots at once.

It runs the weights of a transformers Llama-family model (llama, mistral, qwen2: RMSNorm, rotary
positions, grouped-query attention, gated SiLU MLP) with its own static KV cache, so that

- a session's cache lives in a slot between steps and is never re-prefilled;
- one forward verifies a draft of k tokens ([last committed token] + draft);
- one forward serves many sessions with different context and draft lengths (rows are padded to
  the longest; each row has its own positions and causal mask);
- rejected positions are dropped by moving the slot's length pointer back;
- a token tree (``edgespec.verify.trees``) is verified in one forward with a tree attention mask
  (``forward_tree``), and its accepted path moved into place (``compact``).

The layer-skip self-draft is the same runner over the first L layers, with the final norm and head.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence, overload

import numpy as np
import torch

from ..config import MAX_TREE_NODES, ConfigError
from .attention import KEY_BLOCK
from .dtype_probe import linear_options
from .eager_forward import EagerLayers, packed_tokens, unpacked
from .kernel_set import HeadLayout, KernelSet, runner_kernel_set
from .host_transfers import longs_to_device, to_device
from .kv_cache import KVCache, check_cache_fits
from .linear import Linear, RowCalls
from .model_support import check_supported
from .model_weights import (LayerWeights, RunnerWeights, linear_shapes, load_weights,
                            rope_tables)
from .slot_prompts import PREFILL_CHUNK, SlotPrompts
from .start_check import check_at_start
from .step_graphs import GRAPH_SLACK, StepGraphs
from .step_rows import DraftShape, Scored, StepRows, TreeShape, pad_rows

MAX_QUERY = MAX_TREE_NODES + 1  # the most tokens one session sends in one step: a tree + root


class TargetRunner(SlotPrompts):
    def __init__(self, model: torch.nn.Module, n_slots: int = 4, max_len: int = 2048,
                 n_layers: int | None = None, pack: bool = True, exact: bool = True,
                 share_weights: "TargetRunner | None" = None, max_rows: int | None = None,
                 graphs: bool | None = None, kernels: str | None = None,
                 gemm: str = "tiles", kernel_set: KernelSet | None = None,
                 attention_kernel: str | None = None):
        """``max_rows``: the most rows one forward sends through a layer (default: a prefill
        chunk, or every slot sending a full tree), up to which the start check runs.
        ``kernels``: "triton", the fused kernels (``fused_forward``: the default on CUDA), or
        "eager", torch's ops (the default on a CPU; Triton's interpreter runs the fused ones
        there, for tests). ``gemm``: the fused path's linear products on CUDA
        (``linear.GEMMS``: "tiles", cuBLAS in 128-row tiles; "triton", ``fused_gemm``, being
        measured by the GPU sitting). ``graphs``: run steps of up to 128 sessions x 16 tokens
        through buckets captured as CUDA graphs at start (``step_graphs``; the default with the
        fused kernels on CUDA; on a CPU the buckets run eagerly, for tests). ``kernel_set``: the
        choices made already (``kernel_set.choose_kernel_set``; else made here from ``kernels``,
        ``gemm`` and ``pack``): the runner is built from it and keeps it (``self.kernel_set``).
        ``attention_kernel``: the fused attention kernel asked for ("tiles", "rows", "split",
        "chunks" or "split-decode"; None: the first whose start probe passes)."""
        # a transformers model: its config and submodules are dynamic attributes
        cfg: Any = model.config
        # what this forward computes of the model, else why not (a draft may differ: its
        # runner is held to the model types alone)
        check_supported(model, max_len, features=exact)
        base: Any = model.model
        total = len(base.layers)
        self.n_total_layers = total
        self.n_layers = total if n_layers is None else n_layers
        if not 1 <= self.n_layers <= total:
            raise ConfigError(f"layers must be in 1..{total}, got {n_layers}")
        heads = HeadLayout.of_config(cfg)
        self.n_heads: int = heads.n_heads
        self.kv_heads: int = heads.kv_heads
        self.head_dim: int = heads.head_dim
        self.eps: float = cfg.rms_norm_eps
        self.vocab_size: int = cfg.vocab_size
        self.embed: torch.Tensor = base.embed_tokens.weight
        self.norm: torch.Tensor = base.norm.weight
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        # every choice that decides a step's bits, made first: the runner is built from it
        self.kernel_set: KernelSet = runner_kernel_set(
            kernel_set, self.device, self.dtype, heads,
            share_weights.kernel_set if share_weights is not None else None,
            kernels, gemm, pack, exact, attention_kernel, linear_shapes(model))
        ks = self.kernel_set
        self.kernels = ks.kernels
        fused = self.kernels == "triton"
        gemm = ks.products if fused else gemm
        if share_weights is not None:  # e.g. the layer-skip draft: same tensors, own KV cache
            # (the owner's products, with their plans)
            weights = RunnerWeights(share_weights.lm_head, share_weights.layers[: self.n_layers],
                                    share_weights.gemm_plans)
        else:  # the eager products' calls as the kernel set chose (the fused path's: tiles)
            calls = RowCalls(pack=pack) if fused else linear_options(ks.products)
            weights = load_weights(model, self.n_layers, calls, gemm, fused)
        self.lm_head: Linear = weights.lm_head
        self.layers: list[LayerWeights] = weights.layers
        self.gemm_plans: str = weights.gemm_plans
        if graphs is None:  # the target's steps (a drafter's or a tool's runner needs none)
            graphs = fused and self.device.type == "cuda" and exact
        if graphs and not fused:
            raise ConfigError("CUDA graphs replay the fused Triton kernels, which serve on CUDA: "
                              "use --device cuda, or leave --cuda-graphs out")
        # attention reads whole key blocks; a graph bucket's padding columns write up to
        # GRAPH_SLACK positions past a row's last, so that no step near a slot's end runs eagerly
        slack = GRAPH_SLACK if graphs else 0
        capacity = -(-(max_len + slack) // KEY_BLOCK) * KEY_BLOCK
        check_cache_fits(self.n_layers, n_slots + int(graphs), capacity, self.kv_heads,
                         self.head_dim, self.dtype, self.device)
        self.cos, self.sin = rope_tables(base.rotary_emb, capacity, self.dtype, self.device)
        self.scale = self.head_dim ** -0.5
        # On CUDA a row's sum of squares goes through a tiled product with a ones vector: torch's
        # reduction kernels choose how many lanes share a row by the number of rows (1..15 rows
        # take wider blocks than 16 and more), which changes a row's summation order
        self._row_sum: Linear | None = None
        if self.device.type == "cuda":
            ones = torch.ones(1, self.embed.shape[1], dtype=torch.float32, device=self.device)
            self._row_sum = Linear(ones, pack=False, tiled=True)
        self.col_tile, self.attention_cols = ks.col_tile, ks.attention_cols
        self.attention_products = ks.attention_dtype
        # with graphs, one more slot: the bucket rows past a step's sessions write there
        self.cache = KVCache(self.n_layers, n_slots + int(graphs), max_len, self.kv_heads,
                             self.head_dim, dtype=self.dtype, device=self.device,
                             capacity=capacity, value_ones=not fused)
        self.eager = EagerLayers(self)  # the CPU's layers (and a GPU runner's, asked so)
        self.pack_rows = True  # False: a step's rows padded to the widest (``packs_rows``)
        self.fused = None
        if fused:
            from .fused_forward import FusedLayers  # imports Triton

            self.fused = FusedLayers(self)
        # the fused attention kernel the kernel set chose (by start probe, or as asked)
        self.attention: str | None = ks.attention if fused else None
        self.max_rows = max_rows or max(PREFILL_CHUNK, n_slots * MAX_QUERY)
        # the most prompt tokens one shared prefill forward takes: on a GPU every row the start
        # check proved (one wide forward fills the device); on a CPU a chunk's, as a prompt
        # alone takes (wider forwards measured 15-20% slower a token there: bench-burst)
        self.prefill_rows = self.max_rows if self.device.type == "cuda" else \
            min(self.max_rows, PREFILL_CHUNK)
        # exact: the target (verification must be batch-invariant); a drafter's runner need
        # not be (a draft may be anything), so it is neither checked nor refused
        self.start_check_s: float | None = check_at_start(
            self, cfg, f"{self.kernels}+{gemm}+{self.attention}@{ks.code}") \
            if exact else None
        self.graphs = StepGraphs(self, n_slots, self.cache.reserve(),
                                 capture=self.device.type == "cuda") if graphs else None
        if self.graphs is not None:
            self.graphs.capture_all()

    @property
    def packs_rows(self) -> bool:
        """Whether a step's rows of unequal drafts run packed (their own tokens alone through
        the products: the eager layers, unless ``pack_rows`` was set False to compare); a
        fused (CUDA) step runs its rows padded to the widest."""
        return self.pack_rows and self.fused is None

    def run_state(self) -> dict:
        """How this runner runs its steps, for benchmark JSON: device, kernels, the kernel set
        (with its fingerprint), the linear products (and how many run Triton kernels at some row
        counts), the start check's seconds and the CUDA graphs' state (None without)."""
        from dataclasses import asdict

        return {"device": str(self.device), "kernels": self.kernels, "attention": self.attention,
                "kernel_set": self.kernel_set.as_json(),
                "gemm": self.lm_head.gemm if self.fused is not None else None,
                "gemm_plans": self.gemm_plans or None,
                "start_check_s": self.start_check_s,
                "graphs": asdict(self.graphs.state()) if self.graphs is not None else None}

    # -- forward -------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self._row_sum is None:
            mean_square = xf.pow(2).mean(-1, keepdim=True)
        else:
            mean_square = self._row_sum(xf.pow(2)) / xf.shape[-1]
        xf = xf * torch.rsqrt(mean_square + self.eps)
        return w * xf.to(x.dtype)

    @overload
    def forward(self, slots: list[int], rows: list[list[int]],
                logits: Literal["all", "last"] = "all") -> torch.Tensor: ...

    @overload
    def forward(self, slots: list[int], rows: list[list[int]], logits: Literal["none"]) -> None: ...

    @overload
    def forward(self, slots: list[int], rows: list[list[int]], logits: str
                ) -> torch.Tensor | None: ...

    @torch.inference_mode()
    def forward(self, slots: list[int], rows: list[list[int]], logits: str = "all"
                ) -> torch.Tensor | None:
        """Run rows of new tokens, each appended at its slot's current length.

        Writes the keys/values of every row's tokens into its slot but does not move the length
        pointers (the caller commits what it keeps). ``logits``: "all" returns [B, T, V] float32
        (T = longest row; positions past a row's end are padding), "last" returns [B, V] for each
        row's last token, "none" returns None.
        """
        if self.fused is not None:
            if logits == "none":
                self._hidden(slots, rows)
                return None
            scored = self._fused_chains(slots, rows)
            if logits == "all":
                return scored.logits
            [last] = longs_to_device([[len(r) - 1 for r in rows]], self.device)
            return scored.logits[torch.arange(len(rows), device=self.device), last]
        x, _ = self._hidden(slots, rows)
        if logits == "none":
            return None
        if logits == "last":
            dev = self.device
            [last] = longs_to_device([[len(r) - 1 for r in rows]], dev)
            x = x[torch.arange(len(rows), device=dev), last]  # [B, H]
        return self.lm_head(self._rms(x, self.norm)).float()

    @torch.inference_mode()
    def score(self, slots: list[int], rows: list[list[int]], tap: int | None = None) -> Scored:
        """``forward`` with every position's logits and features; with ``tap``, also the hidden
        state after ``tap_layers(tap)`` layers (the logits and features are the same bits
        either way: the tap only keeps a reference to a tensor the forward makes anyway)."""
        if self.fused is not None:
            return self._fused_chains(slots, rows, tap)
        x, kept = self._hidden(slots, rows, () if tap is None else (self.tap_layers(tap),))
        return self._scored(x, kept[0] if kept else None)

    def tap_layers(self, tap: int) -> int:
        """How many decoder layers a tap runs before it is read: ``tap`` itself, or counted
        from the end when negative as transformers' hidden_states are (-1: every layer, before
        the final norm; -8: all but the last seven). ValueError outside this runner's layers."""
        after = tap if tap >= 0 else self.n_total_layers + 1 + tap
        if not 1 <= after <= self.n_layers:
            raise ValueError(f"tap {tap} is not after one of this runner's {self.n_layers} "
                             "layers")
        return after

    def _scored(self, x: torch.Tensor, tapped: torch.Tensor | None = None,
                real: torch.Tensor | None = None) -> Scored:
        """Logits and features of the hidden states x [B, T, H]; ``real``: only the rows' own
        tokens (``eager_forward.packed_tokens``) through the LM head, zeros at padding."""
        if real is None:
            feats = self._rms(x, self.norm)
            return Scored(self.lm_head(feats).float(), feats, tapped)
        B, T, _ = x.shape
        feats = self._rms(x.reshape(B * T, -1).index_select(0, real), self.norm)  # [N, H]
        return Scored(unpacked(self.lm_head(feats).float(), real, B, T),
                      unpacked(feats, real, B, T), tapped)

    def _hidden(self, slots: list[int], rows: list[list[int]], taps: tuple[int, ...] = (),
                embeds: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The last decoder layer's output [B, T, H] for ``forward``'s rows, and the states
        after each of ``taps`` layers (``embeds``: see ``EagerLayers.run``; only for rows of one
        length)."""
        tokens, start_t, slot_t, longest = self._chain_rows(slots, rows)
        real = None
        if self.packs_rows and embeds is None:
            real = packed_tokens(np.fromiter(map(len, rows), np.int64, len(rows)),
                                 tokens.shape[1], self.device)
        return self._chains(slots, tokens, start_t, longest, slot_index=slot_t, taps=taps,
                            embeds=embeds, real=real)

    def _chain_rows(self, slots: list[int], rows: list[list[int]]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``forward``'s rows appended at their slots' lengths: tokens [B, T] (right-padded),
        the starts [B] and the slots [B] on the device, and the largest start (room
        checked)."""
        T = max(len(r) for r in rows)
        if min(len(r) for r in rows) < 1:
            raise ValueError("every row needs at least one token")
        starts = [self.cache.lengths[s] for s in slots]
        for s, st in zip(slots, starts):
            self.cache.check_room(s, st, T)
        # one pinned copy, no wait (``host_transfers``)
        tokens, start_t, slot_t = to_device(
            [pad_rows(rows, T), np.array(starts, dtype=np.int64),
             np.array(slots, dtype=np.int64)], self.device, torch.long)
        return tokens, start_t, slot_t, max(starts)

    def _chains(self, slots: list[int], tokens: torch.Tensor, start_t: torch.Tensor,
                longest: int, slot_index: torch.Tensor | None = None, taps: tuple[int, ...] = (),
                embeds: torch.Tensor | None = None, upto: int | None = None,
                real: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Rows of chains through the layers, on either kernels: tokens [B, T] at ``slots``
        from positions ``start_t`` [B] (``longest``: the largest start). Returns the residual
        stream [B, T, H] after the layers run (``upto``) and the states after each of
        ``taps`` layers, in their order: the one set-up of a chain's positions and mask.
        ``real``: the rows' own tokens, packed (the eager layers only)."""
        B, T = tokens.shape
        if self.fused is not None:
            step = self.fused.chain_step(slots, start_t, T, slot_index, longest + T)
            x, kept, _ = self.fused.hidden(tokens, step, embeds, taps=taps, upto=upto)
            return x.view(B, T, -1), [k.view(B, T, -1) for k in kept]
        return self.eager.chains(slots, tokens, start_t, longest, slot_index=slot_index,
                                 taps=taps, embeds=embeds, upto=upto, real=real)

    @torch.inference_mode()
    def forward_tree(self, slots: list[int], roots: list[int], trees: Sequence[TreeShape]
                     ) -> torch.Tensor:
        """``score_tree``'s logits [B, 1 + N_max, V] float32."""
        return self.score_tree(slots, roots, trees).logits

    @torch.inference_mode()
    def score_tree(self, slots: list[int], roots: list[int], trees: Sequence[TreeShape]
                   ) -> Scored:
        """Score token trees: one tree per slot, each hanging from its root (the slot's last
        committed token, not yet in the KV), all in one forward pass.

        Row b holds [root] + trees[b].tokens, stored at the slot's length L onwards in node
        order (node i at L + 1 + i), but positioned by depth (node i at L + depth(i)): a token
        sees the slot's prefix, the root and its own ancestors only, so each node's logits are
        those of the chain root -> ... -> node, bit for bit: the spine (nodes 0..s-1 hanging
        one from the next) is stored where decoding stores it, and a branch node reads its
        ancestors' keys in decoding order (``attention.TailKeys``). The mask is built on the
        device from the parents. Trees are trusted (the caller validated them). Writes
        keys/values without moving the length pointer; ``compact`` then keeps the accepted path
        (it moves nothing for a path along the spine). Returns the logits
        [B, 1 + N_max, V] float32 (row 0 scores the root's successor, row 1 + i node i's; rows
        past a tree's end are padding) and the features of those rows.
        """
        if not len(slots) == len(roots) == len(trees) >= 1:
            raise ValueError("forward_tree needs one root and one tree per slot")
        shape = DraftShape.of([(t.tokens, t.parents) for t in trees])
        return self.score_rows(StepRows.build(slots, [self.cache.lengths[s] for s in slots],
                                              roots, shape, self.device, tree=True))

    @torch.inference_mode()
    def score_rows(self, rows: StepRows, tap: int | None = None) -> Scored:
        """Score a step's rows (``StepRows``, built once for the forward and the
        verification): as chains when no row branches, else as trees (``score_tree``). Returns
        the logits [B, T, V] float32 and features of every row, and with ``tap`` (see
        ``score``) the hidden state there too (such a step runs eagerly: the graph buckets
        keep no tap)."""
        T = rows.width
        for s, st in zip(rows.slots, rows.starts):
            self.cache.check_room(s, st, T)
        if self.graphs is not None and tap is None:
            bucketed = self.graphs.score(rows)
            if bucketed is not None:
                return bucketed
        taps = () if tap is None else (self.tap_layers(tap),)
        start_t = rows.start_index
        if self.fused is not None:
            from .fused_kernels import FusedStep

            step = FusedStep.of_tree_rows(rows) if rows.tree else self.fused.chain_step(
                rows.slots, start_t, T, rows.slot_index, max(rows.starts) + T)
            return self.fused.scored(rows.tokens, step, taps[0] if taps else None)
        # a row's root and nodes, not its padding (the host's counts: no wait)
        real = None
        if self.packs_rows:
            assert rows.host is not None  # StepRows.build's
            real = packed_tokens(rows.host.counts + 1, T, self.device)
        if not rows.tree:
            x, kept = self._chains(rows.slots, rows.tokens, start_t, max(rows.starts),
                                   slot_index=rows.slot_index, taps=taps, real=real)
            return self._scored(x, kept[0] if kept else None, real)
        x, kept = self.eager.trees(rows, taps, real)
        return self._scored(x, kept[0] if kept else None, real)

    def compact(self, slot: int, path: list[int]) -> None:
        """Keep a verified tree's accepted path: move the keys/values of nodes ``path`` (node
        indices, root to leaf) to the positions right after the root, and set the slot's length
        to cover root + path, as if the chain root + path had been verified. Call it right
        after ``forward`` or ``forward_tree`` on this slot (the length pointer still at the
        root); a path along the chain moves nothing."""
        [error] = self.compact_many([(slot, path)])
        if error is not None:
            raise error

    def compact_many(self, paths: Sequence[tuple[int, Sequence[int]]]
                     ) -> list[Exception | None]:
        """``compact`` for a step's slots, in one indexed copy a layer
        (``KVCache.place_paths``): each entry's error, None where placed."""
        return self.cache.place_paths(paths)

    def _fused_chains(self, slots: list[int], rows: list[list[int]], tap: int | None = None
                      ) -> Scored:
        """``score`` through the fused kernels."""
        assert self.fused is not None
        tokens, start_t, slot_t, longest = self._chain_rows(slots, rows)
        T = tokens.shape[1]
        step = self.fused.chain_step(slots, start_t, T, slot_t, keys=longest + T)
        return self.fused.scored(tokens, step, None if tap is None else self.tap_layers(tap))
