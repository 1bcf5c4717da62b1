"""One verification step's rows, built once: what the forward and the verification read.

A step verifies B sessions; row b holds the session's last committed token (the root) and its
draft, a tree given as each node's parent (-1: the root; a chain is node i hanging from i - 1).
``DraftShape`` lays the drafts out as padded NumPy arrays with array ops (no Python loop over
tokens); ``StepRows`` adds what the forward needs (KV slots and lengths, the tree's ancestor
matrix, the branch nodes' decoding-order keys) and moves it all to the device in two copies (one
of integers, one of booleans). The forward (``TargetRunner.score_rows``) and the verification
(``edgespec.verify.verify_step.VerifyBatch.of_rows``) then read the same tensors, as vLLM's
speculative-decoding metadata is built once per step; a forward's output is a ``Scored``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np
import torch

from ..protocol.frozen_value import frozen_value
from .attention import KEY_BLOCK, TailKeys
from .host_transfers import to_device


class TreeShape(Protocol):
    """A draft tree as the runner reads it (``edgespec.verify.trees.DraftTree`` is one): node i
    holds tokens[i] and hangs from node parents[i] (-1: the root), parents[i] < i."""

    @property
    def tokens(self) -> Sequence[int]: ...

    @property
    def parents(self) -> Sequence[int]: ...

    def __len__(self) -> int: ...


def _padded(rows: list[list[int]], width: int, fill: int) -> np.ndarray:
    """[len(rows), width] int64: each row right-padded with ``fill``."""
    return np.array([r + [fill] * (width - len(r)) for r in rows], dtype=np.int64) \
        .reshape(len(rows), width)


@frozen_value
class Scored:
    """A forward's logits and the features they were read from (what a draft head takes), and,
    when ``score`` was asked for a tap, one intermediate layer's hidden state."""

    logits: torch.Tensor  # [B, T, V] float32
    features: torch.Tensor  # [B, T, H] runner dtype: the final norm's output (LM head input)
    # [B, T, H] runner dtype: the residual stream after ``tap_layers(tap)`` decoder layers
    # (transformers' hidden_states[tap]); None unless asked for
    tapped: torch.Tensor | None = None


@frozen_value
class DraftShape:
    """The drafts of a step as padded host arrays (N = max(1, the most nodes of a row)), built
    with NumPy: host work that never waits for a device."""

    nodes: np.ndarray  # [B, N] int64: draft tokens, -1 padding
    parents: np.ndarray  # [B, N] int64: each node's parent node, -1 the root and padding
    depths: np.ndarray  # [B, 1 + N] int64: 0 the root and padding, a node's depth
    counts: np.ndarray  # [B] int64: nodes in the row
    ancestors: np.ndarray | None  # [B, 1 + N, 1 + N] bool: row t sees row u (trees only)
    max_nodes: int  # the most nodes of a row (0: no row has any)
    max_depth: int
    is_tree: bool  # some node hangs off its row's chain (its spine)

    @classmethod
    def of(cls, drafts: Sequence[tuple[Sequence[int], Sequence[int]]]) -> "DraftShape":
        """drafts[b] = (tokens, parents) of row b's tree, trusted (checked where they
        entered)."""
        most = max((len(t) for t, _ in drafts), default=0)
        N = max(1, most)
        nodes = _padded([list(t) for t, _ in drafts], N, -1)
        parents = _padded([list(p) for _, p in drafts], N, -1)
        counts = np.array([len(t) for t, _ in drafts], dtype=np.int64)
        idx = np.arange(N)
        valid = idx[None] < counts[:, None]
        is_tree = bool((valid & (parents != idx - 1)).any())
        ancestors = None
        if is_tree:
            ancestors = ancestor_rows(parents, counts)  # [B, 1 + N, 1 + N]
            depth = ancestors.sum(-1)[:, 1:] - 1
        else:
            depth = np.broadcast_to(idx + 1, (len(drafts), N))
        depths = np.zeros((len(drafts), 1 + N), dtype=np.int64)
        depths[:, 1:] = np.where(valid, depth, 0)
        return cls(nodes, parents, depths, counts, ancestors, most, int(depths.max()), is_tree)

    @classmethod
    def of_chains(cls, chains: Sequence[Sequence[int]]) -> "DraftShape":
        """``of`` for drafts that are all chains (node i hangs from node i - 1), given as
        their tokens: laid out in a few array operations whatever the batch, no row's parents
        listed."""
        B = len(chains)
        if not any(chains):  # a decode step: every row its root alone
            return _roots_only(B)
        counts = np.fromiter(map(len, chains), np.int64, B)
        most = int(counts.max(initial=0))
        N = max(1, most)
        idx = np.arange(N)
        valid = idx[None] < counts[:, None]  # [B, N]: row-major, as the tokens are chained
        nodes = np.full((B, N), -1, dtype=np.int64)
        nodes[valid] = np.fromiter(itertools.chain.from_iterable(chains), np.int64,
                                   int(counts.sum()))
        parents = np.where(valid, idx - 1, -1)
        depths = np.zeros((B, 1 + N), dtype=np.int64)
        depths[:, 1:] = np.where(valid, idx + 1, 0)
        return cls(nodes, parents, depths, counts, None, most, most, False)

    @property
    def valid(self) -> np.ndarray:
        """[B, N] bool: which entries of ``nodes`` are a row's nodes, not padding."""
        return np.arange(self.nodes.shape[1])[None] < self.counts[:, None]

    def rows_outside(self, vocab_size: int) -> list[int]:
        """The rows holding a token id outside [0, vocab_size). The stores check ids where
        drafts enter; this vectorised look is the forward's own guard (on CUDA an id past the
        embedding is a device assert that ends every session of the process, not one)."""
        if not self.max_nodes:
            return []
        nodes = self.nodes
        # every node in range, told in a few whole-array operations: padding is -1, so the
        # nodes at 0 or more are every row's nodes exactly when none of them is negative
        if nodes.max(initial=-1) < vocab_size and \
                np.count_nonzero(nodes >= 0) == int(self.counts.sum()):
            return []
        bad = self.valid & ((nodes < 0) | (nodes >= vocab_size))
        return np.nonzero(bad.any(1))[0].tolist()


@functools.lru_cache(maxsize=64)
def _roots_only(B: int) -> DraftShape:
    """``DraftShape.of_chains`` of B empty drafts (a decode step), built once per batch size:
    its arrays are read-only, shared by every such step (a step's rows copy them)."""
    nodes, parents = np.full((B, 1), -1, dtype=np.int64), np.full((B, 1), -1, dtype=np.int64)
    depths, counts = np.zeros((B, 2), dtype=np.int64), np.zeros(B, dtype=np.int64)
    for a in (nodes, parents, depths, counts):
        a.flags.writeable = False
    return DraftShape(nodes, parents, depths, counts, None, 0, 0, False)


def ancestor_rows(parents: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[B, 1 + N, 1 + N] bool: row t (0: the root, 1 + i: node i) sees row u iff u is t or one
    of its ancestors, from the nodes' parents [B, N] (-1: the root) of rows holding counts [B]
    nodes. Padding rows hang from the row before them (causal, never read)."""
    B, N = parents.shape
    idx = np.arange(N)
    par = np.where(idx[None] < counts[:, None], parents + 1, idx[None])
    par = np.concatenate([np.zeros((B, 1), dtype=np.int64), par], 1)  # each row's parent row
    T = N + 1
    seen = np.broadcast_to(np.eye(T, dtype=bool), (B, T, T)).copy()
    cur = np.broadcast_to(np.arange(T), (B, T)).copy()
    batch = np.arange(B)[:, None]
    for _ in range(N):  # N steps up reach the root from any node
        cur = np.take_along_axis(par, cur, 1)
        seen[batch, np.arange(T)[None], cur] = True
    return seen


@frozen_value
class StepRows:
    """A step's rows on the runner's device: row b is [root, node 0, node 1, ...] of the
    session in KV slot ``slots[b]``, stored from the slot's length ``starts[b]`` on."""

    slots: list[int]
    starts: list[int]  # each slot's KV length: where its root is stored
    width: int  # T: 1 + the most nodes of a row
    tree: bool  # run as a tree (an attention mask from the parents), not as chains
    slot_index: torch.Tensor  # [B] long: slots
    start_index: torch.Tensor  # [B] long: starts
    tokens: torch.Tensor  # [B, T] long: the root, then the nodes; 0 padding
    nodes: torch.Tensor  # [B, N] long: DraftShape's, on the device
    parents: torch.Tensor  # [B, N] long
    depths: torch.Tensor  # [B, 1 + N] long
    counts: torch.Tensor  # [B] long
    ancestors: torch.Tensor | None  # [B, T, T] bool (trees)
    tail: TailKeys | None  # the branch nodes' decoding-order keys (trees with branches)
    max_depth: int
    # [B, T, T] long (trees): path[b, t, d] = the row of token t's ancestor at depth d (the
    # fused attention reads a node's keys in decoding order through it)
    path: torch.Tensor | None = None
    host: "StepHost | None" = None  # the same rows on the host (a graph bucket's one copy)
    # [B] long on the device: the roots, where the step was launched before they reached the
    # host (``with_device_roots``); ``tokens[:, 0]`` holds them, ``host.tokens[:, 0]`` does not
    device_roots: torch.Tensor | None = None

    @classmethod
    def build(cls, slots: list[int], starts: list[int], roots: list[int], shape: DraftShape,
              device: str | torch.device, tree: bool | None = None) -> "StepRows":
        """``tree``: force the tree forward (True) or leave it to the drafts' shape (None)."""
        B, T = len(slots), 1 + shape.max_nodes
        is_tree = shape.is_tree if tree is None else tree
        tokens = np.array(roots, dtype=np.int64).reshape(B, 1)
        if T > 1:
            tokens = np.concatenate([tokens, np.where(shape.valid, shape.nodes, 0)], 1)[:, :T]
        start_h = np.array(starts, dtype=np.int64).reshape(B)
        ancestors, tail_h = None, None
        if is_tree:
            full = shape.ancestors if shape.ancestors is not None else \
                ancestor_rows(shape.parents, shape.counts)
            ancestors = np.ascontiguousarray(full[:, :T, :T])
            tail_h = _branch_tails(shape, ancestors, start_h)
        path_h = _paths(ancestors, shape.depths[:, :T]) if ancestors is not None else None
        slot_h = np.array(slots, dtype=np.int64).reshape(B)
        ints: list[np.ndarray] = [tokens, shape.nodes, shape.parents, shape.depths,
                                  shape.counts, start_h, slot_h]
        n_ints = len(ints)
        if path_h is not None:
            ints.append(path_h)
        bools: list[np.ndarray] = [] if ancestors is None else [ancestors]
        if tail_h is not None:
            ints += [tail_h.rows, tail_h.queries, tail_h.index, tail_h.block0]
            bools.append(tail_h.visible)
        tail_at = n_ints + (path_h is not None)
        on_dev = to_device(ints, device, torch.long)  # the step's one copy of integers
        flags = to_device(bools, device, torch.bool) if bools else []
        tail = None
        if tail_h is not None:
            tail = TailKeys(on_dev[tail_at], on_dev[tail_at + 1], on_dev[tail_at + 2], flags[-1],
                            on_dev[tail_at + 3], tail_h.n_blocks)
        depth_h = shape.depths[:, :T] if is_tree else _chain_depths(B, T)
        host = StepHost(tokens, start_h, slot_h, depth_h, path_h, shape.nodes, shape.counts)
        return cls(list(slots), list(starts), T, is_tree, on_dev[6], on_dev[5], on_dev[0],
                   on_dev[1], on_dev[2], on_dev[3], on_dev[4],
                   flags[0] if ancestors is not None else None, tail, shape.max_depth,
                   on_dev[n_ints] if path_h is not None else None, host)

    def with_device_roots(self, roots: torch.Tensor) -> "StepRows":
        """These rows with their roots taken from ``roots`` [B] long, a tensor on the device
        still being computed (the previous step's choices, queued): copied into ``tokens``
        by the device's stream, which orders the copy after the choices and before the
        forward; a graph bucket copies them into its inputs after its host copy."""
        self.tokens[:, 0].copy_(roots)
        return replace(self, device_roots=roots)


@functools.lru_cache(maxsize=256)
def _chain_depths(B: int, T: int) -> np.ndarray:
    """[B, T] int64, read-only: row t of a chain at depth t, for every row (``StepHost.depth``
    of a step of chains), made once per batch shape (``np.broadcast_to`` costs ~3 us a call,
    a step's; this cache's lookup a thirtieth of that)."""
    return np.broadcast_to(np.arange(T, dtype=np.int64), (B, T))


@frozen_value
class StepHost:
    """A step's rows on the host, as the fused kernels read them (``fused_kernels``): what a
    CUDA graph bucket copies in one pinned copy (``step_graphs``)."""

    tokens: np.ndarray  # [B, T] int64
    starts: np.ndarray  # [B] int64
    slots: np.ndarray  # [B] int64
    depth: np.ndarray  # [B, T] int64: chains t, trees the node's depth (0 the root, padding)
    path: np.ndarray | None  # [B, T, T] int64 (trees), else the chain's (row d at depth d)
    nodes: np.ndarray  # [B, N] int64: the draft nodes, -1 padding
    counts: np.ndarray  # [B] int64: each row's draft nodes


def _paths(ancestors: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """[B, T, T] int64: path[b, t, d] = u, the ancestor of row t at depth d (rows of a tree:
    0 the root; a padding row hangs from the row before it, depth 0, any row < T)."""
    B, T, _ = ancestors.shape
    path = np.zeros((B, T, T), dtype=np.int64)
    b, t, u = np.nonzero(ancestors)
    # a real row has one ancestor a depth; a padding row's depth-0 "ancestors" are the rows
    # before it and itself: the largest, itself, is the one taken (in any order)
    np.maximum.at(path, (b, t, depths[b, u]), u)
    return path


@frozen_value
class HostTails:
    """``TailKeys``' arrays on the host, before the step's copy."""

    rows: np.ndarray
    queries: np.ndarray
    index: np.ndarray
    visible: np.ndarray
    block0: np.ndarray
    n_blocks: int


def _branch_tails(shape: DraftShape, ancestors: np.ndarray, starts: np.ndarray
                  ) -> HostTails | None:
    """The decoding-order key blocks of every branch node (a node past its row's spine), on
    the host: from the block holding the root on, its logical position L + d reads the row of
    its ancestor at depth d (row r of a tree is stored at L + r; row 0 is the root). None
    without branches. Host arrays, for ``StepRows`` to move."""
    parents, valid = shape.parents, shape.valid
    idx = np.arange(parents.shape[1])
    spine = ((parents == idx - 1) & valid).cumprod(1).sum(1)  # [B]
    rows, nodes = np.nonzero(valid & (idx[None] >= spine[:, None]))
    if len(rows) == 0:
        return None
    queries = 1 + nodes
    st = starts[rows]
    block0 = st // KEY_BLOCK
    pre = st - KEY_BLOCK * block0  # prefix positions inside the first block
    path = ancestors[rows, queries]  # [S, T]: the root's row, then the rows down to the node
    ends = pre + path.sum(-1)
    width = -(-int(ends.max()) // KEY_BLOCK) * KEY_BLOCK
    col = np.arange(width)[None]
    index = np.zeros((len(rows), width + 1), dtype=np.int64)  # the last column: a dummy
    index[:, :width] = np.where(col < pre[:, None], KEY_BLOCK * block0[:, None] + col, 0)
    at = np.where(path, pre[:, None] + path.cumsum(-1) - 1, width)
    S, T = path.shape
    index[np.arange(S)[:, None], at] = np.where(path, st[:, None] + np.arange(T)[None], 0)
    n_blocks = int((block0 + width // KEY_BLOCK).max())
    return HostTails(rows, queries, index[:, :width], col < ends[:, None], block0, n_blocks)


def pad_rows(rows: Sequence[Sequence[int]], T: int) -> np.ndarray:
    """Token rows right-padded with 0 to length T: [B, T] int64, on the host."""
    tokens = np.zeros((len(rows), T), dtype=np.int64)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    return tokens
