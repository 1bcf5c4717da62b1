"""Chain steps over bucketed shapes, captured as CUDA graphs on a GPU (SGLang's
``cuda_graph_runner``, vLLM's uniform decode of 1 + k tokens).

On a GPU one verification forward launches about 1,800 kernels: the launches, not the maths,
set a step's time. A CUDA graph replays them all with one launch, but only over the shapes and
buffers it was captured with. So a step of chains (a decode step is a chain of none) is padded
up to a bucket (sessions x tokens a row x key positions read) and run over that bucket's
static buffers:

- the step's tokens, KV write positions and slots are copied into the bucket's buffers (device
  to device: ``StepRows`` already brought them over in one copy); rows past the step's sessions
  write their keys and values into the runner's scratch slot, columns past a row's tokens
  into positions its length pointer does not cover (as any padding of the eager forward);
- the captured region reads only those buffers: the causal mask is made inside it from the
  write positions, the slots are read by gather (the eager forward's contiguous-slot shortcut is
  a host decision); nothing in it copies from the host or waits for the device;
- the outputs [B, T] of the bucket are sliced back to the step's rows and tokens: views of the
  bucket's static outputs, valid until the next step (the verification reads them within the
  step; a head's context gathers what it keeps into its own memory).

Every row's bits are those of the eager forward: the runner's kernels are batch-invariant in the
row count (``edgespec.runner.dtype_probe``), and fully masked key blocks and padding columns
change no other query's sums (``edgespec.runner.attention``); tests hold a bucketed step to the
eager one bit for bit. A graph is captured the first time its bucket is used. Without CUDA
(``capture=False``, and on a CPU) the same padded buffers run eagerly: the path the graphs
take, exercised where no GPU is, slower than the unpadded forward (padding costs work here).
Token trees run eagerly (their branch masks vary in shape).
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch

from .attention import KEY_BLOCK
from .kv_cache import KVCache
from .step_rows import Scored, StepRows

# a bucket's forward over its buffers: (tokens [B, T], KV write positions [B, T], slots [B],
# key positions read) -> every row's logits and features (the runner's ``_bucket_forward``)
BucketForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], Scored]

log = logging.getLogger("edgespec.runner.step_graphs")

SESSION_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
TOKEN_BUCKETS = (1, 2, 4, 6, 8, 12, 16)  # tokens a row: the last token and up to 15 drafted
KEY_BUCKETS = tuple(KEY_BLOCK * 2 ** i for i in range(12))  # key positions read: 64 .. 131072


def bucket_of(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= n (None: n is past the largest)."""
    i = bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


@dataclass
class _Bucket:
    """One captured shape: its static inputs and, once run, its outputs."""

    tokens: torch.Tensor  # [B, T] long
    store: torch.Tensor  # [B, T] long: KV write positions (rotary positions too: chains)
    slots: torch.Tensor  # [B] long
    n_pos: int
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    logits: torch.Tensor | None = None  # [B, T, V] float32: the last run's
    features: torch.Tensor | None = None  # [B, T, H]


class StepGraphs:
    """The runner's bucketed chain steps: ``score(rows)`` runs a step of chains through its
    bucket (captured on CUDA when ``capture``), or returns None when no bucket holds it (the
    caller runs it eagerly)."""

    def __init__(self, forward: BucketForward, cache: KVCache, scratch_slot: int,
                 capture: bool):
        self.forward, self.cache = forward, cache
        self.scratch = scratch_slot
        self.capture = capture  # CUDA only
        self.buckets: dict[tuple[int, int, int], _Bucket] = {}
        self.pool: Any = None  # the captured graphs share one memory pool
        self.replays = 0  # steps run through a bucket (captured or not)
        self.disabled = False  # a capture failed: every step runs unpadded and eager

    def shape_for(self, rows: StepRows) -> tuple[int, int, int] | None:
        """The bucket (sessions, tokens, key positions) a step of chains pads up to."""
        B, T = len(rows.slots), rows.width
        Bb, Tb = bucket_of(B, SESSION_BUCKETS), bucket_of(T, TOKEN_BUCKETS)
        if rows.tree or Bb is None or Tb is None:
            return None
        cap = self.cache.capacity
        if max(rows.starts) + Tb > cap:  # padding columns would write past a slot's end
            return None
        Kb = bucket_of(max(rows.starts) + Tb, KEY_BUCKETS)
        if Kb is None or Kb > cap:
            Kb = cap
        return Bb, Tb, Kb

    def score(self, rows: StepRows) -> Scored | None:
        """The step's logits [B, T, V] and features [B, T, H], through its bucket."""
        shape = None if self.disabled else self.shape_for(rows)
        if shape is None:
            return None
        b = self.buckets.get(shape) or self._new_bucket(*shape)
        self._fill(b, rows)
        if self.capture and b.graph is None:
            try:
                self._capture(b)
            except Exception:  # a capture that fails costs the graphs' speed, never a step
                log.exception("capturing the step of bucket %s failed: the runner goes back "
                              "to its unpadded eager forward", shape)
                self.disabled = True
                return None
        if b.graph is not None:
            b.graph.replay()
        else:
            b.logits, b.features = self._run(b)
        self.replays += 1
        B, T = len(rows.slots), rows.width
        assert b.logits is not None and b.features is not None
        return Scored(b.logits[:B, :T], b.features[:B, :T])

    def _new_bucket(self, B: int, T: int, n_pos: int) -> _Bucket:
        dev = self.cache.k[0].device
        b = _Bucket(torch.zeros(B, T, dtype=torch.long, device=dev),
                    torch.arange(T, device=dev).repeat(B, 1),
                    torch.full((B,), self.scratch, dtype=torch.long, device=dev), n_pos)
        self.buckets[(B, T, n_pos)] = b
        return b

    def _fill(self, b: _Bucket, rows: StepRows) -> None:
        """The step's rows into the bucket's buffers (device to device); rows past the step
        write into the scratch slot from position 0."""
        B, T = len(rows.slots), rows.width
        Tb = b.tokens.shape[1]
        cols = torch.arange(Tb, device=b.store.device)
        b.tokens.zero_()
        b.tokens[:B, :T] = rows.tokens
        b.store[:B] = rows.start_index[:, None] + cols[None]
        b.store[B:] = cols[None]
        b.slots.fill_(self.scratch)
        b.slots[:B] = rows.slot_index

    def _run(self, b: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured region: the forward over the bucket's buffers alone."""
        scored = self.forward(b.tokens, b.store, b.slots, b.n_pos)
        return scored.logits, scored.features

    def _capture(self, b: _Bucket) -> None:
        """Capture the bucket's forward as a CUDA graph (after a warm-up on a side stream, as
        CUDA graphs require); its outputs are the graph's static outputs."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._run(b)  # warm-up: lazy initialisations happen outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a drafter or learner thread using the GPU meanwhile does not break it
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            b.logits, b.features = self._run(b)
        self.pool = graph.pool() if self.pool is None else self.pool
        b.graph = graph
