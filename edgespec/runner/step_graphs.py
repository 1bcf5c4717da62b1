"""Steps replayed as CUDA graphs, every bucket captured at start (SGLang's
``cuda_graph_runner``: a fixed list of sizes, largest first, one memory pool, static buffers).

On a GPU a step's kernels cost more to launch than to run. A CUDA graph replays a whole
forward with one launch, over the shapes and buffers it was captured with. So a step of up to
128 sessions x 16 tokens (chains and token trees alike: the fused attention reads each query's
length and tree path from the device, ``fused_kernels``) is padded up to a bucket (sessions x
tokens a row) and replayed. Session buckets: 1, 2, 4, then every multiple of 8 up to the
runner's slots (at most ``MAX_GRAPH_SESSIONS``), so a step pads at most 7 rows past 8 sessions
(power-of-two buckets padded 33 sessions to 64); the runner's KV slots keep ``TOKEN_BUCKETS[-1]``
positions past their last (``GRAPH_SLACK``) so that a session near its slot's end is graphed
too:

- every bucket reads one flat input buffer (tokens, slots, starts, depths, tree paths) filled by
  one pinned, non-blocking host-to-device copy a step; the rows past the step's sessions write
  their keys and values into the runner's scratch slot, the columns past a row's tokens into
  positions its length pointer does not cover;
- every bucket writes its logits [B T, V] float32 and features into one pair of output
  buffers, sized for the largest bucket and shared (a step's outputs are views, valid until
  the next step: the verification reads them within the step);
- a capture that fails is logged and kept in ``state()`` (status, /metrics, bench JSON show it),
  and the runner serves on with the same kernels run eagerly.

A bucketed row has the bits of the eager fused forward: the kernels are batch-invariant, and
padding rows and columns touch nothing a real row reads; tests hold the two bit for bit. On a
CPU (``capture=False``, tests under Triton's interpreter) the buckets run eagerly.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .host_transfers import aligned_length
from .step_rows import Scored, StepHost, StepRows

if TYPE_CHECKING:
    from .fused_kernels import FusedStep

log = logging.getLogger("edgespec.runner.step_graphs")

MAX_GRAPH_SESSIONS = 128  # a step of more sessions runs eagerly
SESSION_BUCKETS = (1, 2, 4) + tuple(range(8, MAX_GRAPH_SESSIONS + 1, 8))
# tokens a row: the last token and a draft (4 and 8 drafted tokens are common: 5 and 9)
TOKEN_BUCKETS = (1, 2, 4, 5, 8, 9, 12, 16)
GRAPH_SLACK = TOKEN_BUCKETS[-1]  # KV positions past a slot's last that padding columns write


def _aligned(Bb: int, Tb: int) -> tuple[int, ...]:
    """The flat input buffer's segments (int64) for bucket (Bb, Tb), each a whole number of
    16 bytes, so every view starts aligned (Triton compiles one variant per alignment)."""
    return tuple(aligned_length(n) for n in (Bb * Tb, Bb, Bb, Bb * Tb, Bb * Tb * Tb))


def session_buckets(n_slots: int) -> tuple[int, ...]:
    """The session buckets of a runner of ``n_slots`` slots: up to the first that holds them
    all (at most ``MAX_GRAPH_SESSIONS``)."""
    top = bucket_of(min(n_slots, MAX_GRAPH_SESSIONS), SESSION_BUCKETS)
    assert top is not None
    return tuple(b for b in SESSION_BUCKETS if b <= top)


def bucket_of(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= n (None: n is past the largest)."""
    i = bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


@dataclass
class GraphState:
    """What ``status``, /metrics and the benchmarks report of a runner's graphs."""

    buckets: int  # shapes in the list
    captured: int  # shapes captured (0 on a CPU: they run eagerly)
    capture_s: float  # seconds the captures took at start
    failed: str | None  # why capturing stopped, if it did (then every step runs eagerly)
    replays: int  # steps run through a bucket
    memory_mb: float  # the graphs' pool and shared buffers, at start


class StepGraphs:
    """A runner's bucketed steps: ``score(rows)`` runs a step through its bucket's graph, or
    returns None when no bucket holds it (the caller runs it eagerly)."""

    def __init__(self, runner: Any, n_slots: int, scratch_slot: int, capture: bool):
        """``runner``: the ``TargetRunner`` whose steps these are (not imported here: it imports
        this module)."""
        self.runner = runner
        self.scratch = scratch_slot
        self.capture = capture
        self.sessions = session_buckets(n_slots)
        self.tokens = TOKEN_BUCKETS
        Bm, Tm = self.sessions[-1], self.tokens[-1]
        dev = runner.device
        # what the graphs hold: the shared buffers below and the pool (``state().memory_mb``)
        self._reserved0 = torch.cuda.memory_reserved(dev) if capture else 0
        self.inputs = torch.zeros(sum(_aligned(Bm, Tm)), dtype=torch.long, device=dev)
        self.logits = torch.empty(Bm * Tm, runner.vocab_size, dtype=torch.float32, device=dev)
        self.features = torch.empty(Bm * Tm, runner.embed.shape[1], dtype=runner.dtype,
                                    device=dev)
        self.graphs: dict[tuple[int, int], Any] = {}
        self.pool: Any = None
        self.failed: str | None = None
        self.capture_s = 0.0
        self.replays = 0
        self.memory_mb = 0.0

    def shapes(self) -> list[tuple[int, int]]:
        """Every bucket, largest first (the order they are captured in)."""
        return sorted(((b, t) for b in self.sessions for t in self.tokens),
                      key=lambda s: (-s[0] * s[1], -s[1]))

    def shape_for(self, rows: StepRows) -> tuple[int, int] | None:
        """The bucket (sessions, tokens) a step pads up to, or None."""
        Bb = bucket_of(len(rows.slots), self.sessions)
        Tb = bucket_of(rows.width, self.tokens)
        if Bb is None or Tb is None or rows.host is None:
            return None
        if max(rows.starts) + Tb > self.runner.cache.capacity:  # padding would write past
            return None
        return Bb, Tb

    def state(self) -> GraphState:
        return GraphState(len(self.sessions) * len(self.tokens), len(self.graphs),
                          round(self.capture_s, 2), self.failed, self.replays,
                          round(self.memory_mb, 1))

    # -- start ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket (CUDA), largest first into one pool; a failure is logged and
        kept, and the runner serves eagerly. Each bucket runs once eagerly first: a kernel
        launched with new arguments may be compiled and loaded then (Triton specializes an
        integer argument of 1, a bucket of one session's), which must not happen inside a
        capture."""
        if not self.capture:
            return
        t0 = time.perf_counter()
        shapes = self.shapes()
        shape = shapes[0]  # the warm-up's, should it fail
        try:
            stream = torch.cuda.Stream()
            for shape in shapes:
                self._fill(*shape, None)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # lazy initialisations outside any capture
                    self._run(*shape)
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize(self.runner.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    self._run(*shape)
                self.pool = graph.pool() if self.pool is None else self.pool
                self.graphs[shape] = graph
        except Exception as exc:  # costs the graphs' speed, never a step
            self.failed = f"bucket {shape}: {type(exc).__name__}: {exc}"
            log.exception("capturing CUDA graphs failed at bucket %s: serving with the same "
                          "kernels run eagerly", shape)
            self.graphs.clear()
        torch.cuda.synchronize(self.runner.device)
        self.capture_s = time.perf_counter() - t0
        self.memory_mb = (torch.cuda.memory_reserved(self.runner.device) - self._reserved0) \
            / 2 ** 20
        log.info("CUDA graphs: %d of %d buckets captured in %.1f s (%.0f MB)%s",
                 len(self.graphs), len(shapes), self.capture_s, self.memory_mb,
                 f"; failed: {self.failed}" if self.failed else "")

    # -- a step --------------------------------------------------------------------------------
    def score(self, rows: StepRows) -> Scored | None:
        """The step's logits [B, T, V] and features [B, T, H], through its bucket."""
        shape = None if self.failed else self.shape_for(rows)
        if shape is None or (self.capture and shape not in self.graphs):
            return None
        assert rows.host is not None
        Bb, Tb = shape
        self._fill(Bb, Tb, rows.host)
        if rows.device_roots is not None:  # roots still on the device (a step run ahead)
            self.inputs[:Bb * Tb].view(Bb, Tb)[:len(rows.slots), 0].copy_(rows.device_roots)
        if self.capture:
            self.graphs[shape].replay()
        else:
            self._run(Bb, Tb)
        self.replays += 1
        B, T = len(rows.slots), rows.width
        return Scored(self.logits[:Bb * Tb].view(Bb, Tb, -1)[:B, :T],
                      self.features[:Bb * Tb].view(Bb, Tb, -1)[:B, :T])

    def _views(self, Bb: int, Tb: int) -> tuple[torch.Tensor, "FusedStep"]:
        """The bucket's inputs as views of the flat buffer: tokens [Bb, Tb] and its step."""
        from .fused_kernels import FusedStep  # imports Triton
        sizes = (Bb * Tb, Bb, Bb, Bb * Tb, Bb * Tb * Tb)
        parts = torch.split(self.inputs[:sum(_aligned(Bb, Tb))], list(_aligned(Bb, Tb)))
        p = [part[:n] for part, n in zip(parts, sizes)]
        return p[0].view(Bb, Tb), FusedStep(p[1], p[2], p[3].view(Bb, Tb), p[4].view(Bb, Tb, Tb))

    def _host_inputs(self, Bb: int, Tb: int, host: StepHost | None) -> np.ndarray:
        """The flat inputs of bucket (Bb, Tb) holding ``host``'s rows (None: none)."""
        cols = np.arange(Tb, dtype=np.int64)
        tokens = np.zeros((Bb, Tb), dtype=np.int64)
        slots = np.full(Bb, self.scratch, dtype=np.int64)
        starts = np.zeros(Bb, dtype=np.int64)
        depth = np.broadcast_to(cols, (Bb, Tb)).copy()
        path = np.broadcast_to(cols, (Bb, Tb, Tb)).copy()
        if host is not None:
            B, T = host.tokens.shape
            tokens[:B, :T] = host.tokens
            slots[:B], starts[:B] = host.slots, host.starts
            depth[:B, :T] = host.depth
            if host.path is not None:
                path[:B, :T, :T] = host.path
        parts = [tokens.ravel(), slots, starts, depth.ravel(), path.ravel()]
        return np.concatenate([np.pad(a, (0, n - a.size)) for a, n in
                               zip(parts, _aligned(Bb, Tb))])

    def _fill(self, Bb: int, Tb: int, host: StepHost | None) -> None:
        flat = torch.from_numpy(self._host_inputs(Bb, Tb, host))
        if self.inputs.device.type == "cuda":
            flat = flat.pin_memory()
        self.inputs[:flat.numel()].copy_(flat, non_blocking=True)

    def _run(self, Bb: int, Tb: int) -> None:
        """The captured region: the fused forward over the bucket's views, its outputs into
        the shared buffers."""
        fused = self.runner.fused
        assert fused is not None
        tokens, step = self._views(Bb, Tb)
        _, _, feats = fused.hidden(tokens, step)
        assert feats is not None
        R = Bb * Tb
        self.logits[:R].copy_(self.runner.lm_head.tiles(feats, R)[:R])
        self.features[:R].copy_(feats[:R])
