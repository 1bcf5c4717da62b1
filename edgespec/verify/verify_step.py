"""One verification path for every step: chains and trees, greedy and keyed sampling, exact
and the lossy loose and PAD rules, computed on the runner's device with one host
synchronisation (docs/architecture.md, "Verification maths").

Vocabulary: a verification step sees the target's distributions at T+1 positions for a draft of
T tokens, accepts a prefix of n draft tokens, and emits one token of its own: the *recovered*
token after a rejection, or the *bonus* token after a full accept.

- Greedy: accept while the draft token is the target's argmax; then emit the argmax.
- Sampling: position-keyed Gumbel-max. The randomness of absolute position ``pos`` is a function
  of ``(seed, pos)`` only: Gumbel noise ``G(seed, pos, x)`` for every token x, and the token
  sampled there is ``argmax_x(log p(x) + G(seed, pos, x))``, an exact sample from p. A draft
  token is accepted iff it equals that token; the first mismatch (or the bonus after a full
  accept) emits it. So a seeded generation produces exactly the tokens target-only sampling
  produces with that seed, whatever the drafter and however its drafts were chunked; for a
  one-hot draft the acceptance probability stays p(x). A model drafter that samples with the same
  keyed noise from its own q (``edgespec.drafters.token_choice``) agrees with the target wherever
  q and p are close.

The noise is ``edgespec.verify.keyed_noise``'s: a function of (seed, pos, x) alone.

p is always the target's *processed* distribution (penalties and logit bias, then temperature,
top-k, top-p applied: ``logit_adjust``, ``target_choice.filter_scores``), so the
output follows exactly what target-only sampling would draw from; tokens with p = 0 never win.

``VerifyBatch`` is built once per step from the drafts (host data) and moved to the device;
``verify_step(logits, batch)`` decides every row at once and returns a ``VerifyOutcome`` after a
single ``.tolist()``. A chain is the tree whose node i hangs from node i - 1. Loose rows follow
FLy's rule (``edgespec.verify.loose``, opt-in). PAD rows (opt-in) also keep a node the exact rule
rejects where a ``LenientRule`` (PAD's pivot classifier, ``edgespec.pad.verify_rule``) says so;
among siblings an exactly matching node goes first, so a PAD row never leaves the path exact
verification would take for a lenient node. tests/oracles.py states each rule one row at a
time, for the tests to hold this path to.

A node is accepted when it holds its parent's choice and its parent is accepted (the root
always is): the accepted nodes form the longest path target-only decoding would have taken, its
last node's choice is the emitted token. Every node's logits are decoding's own bit for bit
(``edgespec.runner.attention``), branch nodes included.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ..config import LooseParams, SamplingParams
from ..runner.host_transfers import to_device, to_host
from ..runner.step_rows import DraftShape, StepRows
from .keyed_noise import _signed, seed_of
from .logit_adjust import LogitAdjust, adjusted_in_place
from .loose import loose_accepts
from .target_choice import target_choices


@dataclass
class VerifyBatch:
    """A step's drafts and sampling settings, as tensors on the runner's device.

    Row b of the forward's logits [B, 1 + N, V] scores the token after the row's root (index 0)
    and after each of its draft nodes (index 1 + i)."""

    tokens: torch.Tensor  # [B, N] long: draft nodes, -1 for padding
    parents: torch.Tensor  # [B, N] long: each node's parent node, -1: the root
    depths: torch.Tensor  # [B, 1 + N] long: 0 for the root, a node's depth after it
    counts: torch.Tensor  # [B] long: nodes in the row
    # [B] long: absolute position of the root's successor (greedy exact batches, which read
    # no position, take it from the rows' KV lengths: ``of_rows``)
    starts: torch.Tensor
    seeds: torch.Tensor  # [B] long: keyed-noise seeds (int64 bit patterns; greedy rows 0)
    temperature: torch.Tensor  # [B] float32 (greedy rows 1)
    top_k: torch.Tensor  # [B] long (0: off)
    top_p: torch.Tensor  # [B] float32 (1: off)
    greedy: torch.Tensor  # [B] bool
    loose: torch.Tensor  # [B] bool: FLy's rule (chains only)
    pad: torch.Tensor  # [B] bool: PAD's rule (chains and trees)
    # what runs, known on the host without looking at a tensor
    any_sampled: bool
    max_top_k: int  # the largest top-k of a sampled row (0: none)
    any_top_p: bool
    any_loose: bool
    any_pad: bool
    max_depth: int  # the deepest node's depth (0 without nodes)
    chains: bool = False  # every row a chain (node i hangs from node i - 1), known on the host
    # [B, N] int64: ``tokens`` on the host (-1 padding), where the rows were built there: exact
    # chains are then judged on the host from the target's choices (``verify_step``)
    host_nodes: np.ndarray | None = None
    # penalties and logit bias (``logit_adjust``), added to the logits before the choices
    adjust: LogitAdjust | None = None

    @property
    def max_nodes(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def build(cls, drafts: list[tuple[list[int], list[int]]], starts: list[int],
              params: list[SamplingParams], modes: list[str],
              device: str | torch.device = "cpu") -> "VerifyBatch":
        """drafts[b] = (tokens, parents) of row b's tree (a chain: parents -1, 0, 1, ...), its
        token ids checked where the draft entered (the stores); starts[b]: the absolute
        position of the root's successor; modes[b]: "exact", "loose" or "pad"."""
        shape = DraftShape.of(drafts)
        nodes, parents, depths, counts = to_device(
            [shape.nodes, shape.parents, shape.depths, shape.counts], device, torch.long)
        return cls.of_shape(nodes, parents, depths, counts, shape.max_depth, starts, params,
                            modes, chains=not shape.is_tree, host_nodes=shape.nodes)

    @classmethod
    def of_rows(cls, rows: StepRows, starts: list[int], params: list[SamplingParams],
                modes: list[str]) -> "VerifyBatch":
        """The verification of a step's rows, on the tensors the forward read (``starts``:
        each row's root's successor's position, one past the root's KV length: greedy rows,
        which read no position, take them from the rows on the device, without a copy)."""
        return cls.of_shape(rows.nodes, rows.parents, rows.depths, rows.counts, rows.max_depth,
                            starts, params, modes, chains=not rows.tree,
                            host_nodes=rows.host.nodes if rows.host is not None else None,
                            kv_lengths=rows.start_index)

    @classmethod
    def of_shape(cls, nodes: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                 counts: torch.Tensor, max_depth: int, starts: list[int],
                 params: list[SamplingParams], modes: list[str], chains: bool = False,
                 host_nodes: np.ndarray | None = None,
                 kv_lengths: torch.Tensor | None = None) -> "VerifyBatch":
        """The drafts' tensors (on the device) with each row's sampling settings, moved there
        in two copies (integers, floats). ``chains``: every row is a chain; ``host_nodes``:
        the nodes as the host holds them; ``kv_lengths``: each row's root's KV length on the
        device, one short of its start (greedy exact rows take their starts from it, with no
        copy)."""
        n = len(params)
        greedy = [p.greedy for p in params]
        if all(greedy) and modes.count("exact") == n:  # the common case: no copy at all
            starts_t = kv_lengths + 1 if kv_lengths is not None else \
                to_device([np.array(starts, dtype=np.int64)], nodes.device, torch.long)[0]
            return cls(tokens=nodes, parents=parents, depths=depths, counts=counts,
                       starts=starts_t,
                       **_greedy_exact_rows(n, nodes.device), any_sampled=False, max_top_k=0,
                       any_top_p=False, any_loose=False, any_pad=False, max_depth=max_depth,
                       chains=chains, host_nodes=host_nodes, adjust=None)
        loose, pad = [m == "loose" for m in modes], [m == "pad" for m in modes]
        sampled = [p for g, p in zip(greedy, params) if not g]
        if sampled:
            seeds = [0 if g else _signed(seed_of(p)) for g, p in zip(greedy, params)]
            top_k = [0 if g else (p.top_k or 0) for g, p in zip(greedy, params)]
            temps = [1.0 if g else max(p.temperature, 1e-5) for g, p in zip(greedy, params)]
            top_p = [1.0 if g else p.top_p for g, p in zip(greedy, params)]
        else:  # every row greedy (loose or PAD rows among them): the settings of none
            seeds = top_k = [0] * n
            temps = top_p = [1.0] * n
        [ints] = to_device([np.array([starts, seeds, top_k, greedy, loose, pad],
                                     dtype=np.int64).reshape(6, n)], nodes.device, torch.long)
        [floats] = to_device([np.array([temps, top_p], dtype=np.float32).reshape(2, n)],
                             nodes.device, torch.float32)
        return cls(tokens=nodes, parents=parents, depths=depths, counts=counts,
                   starts=ints[0], seeds=ints[1], top_k=ints[2], greedy=ints[3].bool(),
                   loose=ints[4].bool(), pad=ints[5].bool(), temperature=floats[0], top_p=floats[1],
                   any_sampled=bool(sampled),
                   max_top_k=max([p.top_k or 0 for p in sampled], default=0),
                   any_top_p=any(p.top_p < 1.0 for p in sampled),
                   any_loose=any(loose), any_pad=any(pad), max_depth=max_depth, chains=chains,
                   host_nodes=host_nodes)


@functools.lru_cache(maxsize=64)
def _greedy_exact_rows(n: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The sampling settings of n greedy rows verified exactly, made once per batch size and
    device (read, never written: a step's tensors are built anew, these are shared)."""
    zeros = torch.zeros(n, dtype=torch.long, device=device)
    ones = torch.ones(n, dtype=torch.float32, device=device)
    no = torch.zeros(n, dtype=torch.bool, device=device)
    return dict(seeds=zeros, top_k=zeros, temperature=ones, top_p=ones,
                greedy=torch.ones(n, dtype=torch.bool, device=device), loose=no, pad=no)


@dataclass(frozen=True)
class VerifyOutcome:
    """Per row: the accepted path (node indices, root's child first), the token the target
    emits after it, and which of the path's nodes only a lossy rule kept (tuples, read-only:
    a chain's are shared between rows and steps)."""

    paths: list[tuple[int, ...]]
    tokens: list[int]
    proposals: list[list[int]] = field(default_factory=list)  # a proposer's next drafts
    # per row, one flag (0/1) per path node: 1 where the exact rule would have rejected it
    lenient: list[tuple[int, ...]] = field(default_factory=list)


# drafts the next step on the device from a step's decisions: (accepted [B, N] bool, emitted
# token [B] long) -> target token ids [B, K] long (-1: none); its output joins the step's sync
Proposer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class LenientRule(Protocol):
    """A lossy keep rule for PAD rows, run inside the step on the device: the forward's logits
    [B, 1 + N, V] (row 0 scores the root's successor, 1 + i node i's), the nodes [B, N] long
    (-1: padding) and their parents [B, N] long (-1: the root) -> keep [B, N] bool: node i may
    stand although the target's choice after its parent differs (padding's value is unused)."""

    def __call__(self, logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor
                 ) -> torch.Tensor: ...


def verify_step(logits: torch.Tensor, vb: VerifyBatch, loose: LooseParams | None = None,
                propose: Proposer | None = None, lenient: LenientRule | None = None
                ) -> VerifyOutcome:
    """Decide every row of a step. logits: [B, 1 + N', V] from ``forward`` (chains) or
    ``forward_tree``; a row uses its first 1 + count entries. ``propose``: drafts for the next
    step from the decisions, computed before the sync. ``lenient``: PAD rows' keep rule (PAD
    rows are verified exactly without one). One host sync. A row's penalties and logit bias
    (``vb.adjust``) move its logits for the verification's duration."""
    if vb.adjust is None:  # most steps: nothing moved, no context to enter (~2 us a step)
        return _verify_adjusted(logits, vb, loose, propose, lenient)
    with adjusted_in_place(logits, vb.adjust):
        return _verify_adjusted(logits, vb, loose, propose, lenient)


def _verify_adjusted(logits: torch.Tensor, vb: VerifyBatch, loose: LooseParams | None,
                     propose: Proposer | None, lenient: LenientRule | None) -> VerifyOutcome:
    N = min(vb.max_nodes, logits.shape[1] - 1)
    logits = logits[:, :1 + N]  # rows past every draft: padding
    choices, scores = target_choices(logits, vb)  # [B, 1 + N]
    if vb.chains and not vb.any_loose and not vb.any_pad:
        if propose is None and vb.host_nodes is not None:
            return _verify_exact_chains_on_host(choices, vb.host_nodes[:, :N])
        return _verify_exact_chains(choices, vb, N, propose)
    tokens, parents = vb.tokens[:, :N], vb.parents[:, :N]
    idx = torch.arange(N, device=logits.device)
    valid = idx[None] < vb.counts.clamp(max=N)[:, None]
    exact = valid & (tokens == choices.gather(1, parents + 1))  # holds its parent's choice
    match = exact
    if vb.any_loose:  # loose rows are chains
        match = match | (vb.loose[:, None] & valid &
                         loose_accepts(exact, tokens, scores, vb.counts, loose or LooseParams()))
    accepted = _accepted_in_tree(match, exact, tokens, parents, scores, logits, valid, vb,
                                 lenient)
    last = torch.where(accepted, idx + 1, 0).amax(1, keepdim=True) if N else \
        torch.zeros(len(tokens), 1, dtype=torch.long, device=logits.device)
    token = choices.gather(1, last)  # after the path's last node (row 0: the root)
    # the accepted nodes in index order (a path's nodes increase), then N for the rest
    path = torch.where(accepted, idx, N).sort(1).values
    # along each path: whether the node stands only by a lossy rule (index N: padding)
    off_exact = torch.cat([accepted & ~exact, accepted[:, :1] & False], 1).gather(1, path)
    parts = [token, accepted.sum(1, keepdim=True), path, off_exact.long()]
    if propose is not None:
        parts.append(propose(accepted, token[:, 0]))
    host = to_host(torch.cat(parts, 1)).tolist()  # the step's one sync
    return VerifyOutcome([tuple(r[2:2 + r[1]]) for r in host], [r[0] for r in host],
                         [r[2 + 2 * N:] for r in host] if propose is not None else [],
                         [tuple(r[2 + N:2 + N + r[1]]) for r in host])


def decode_choices(logits: torch.Tensor, vb: VerifyBatch) -> torch.Tensor:
    """A decode step's verdicts, queued on the device: rows of the root alone (no draft node),
    each row's token the target's choice after its root, as ``verify_step`` judges such a row
    (greedy the argmax, sampled the keyed sample at its position). logits: [B, >= 1, V];
    returns [B] long."""
    with adjusted_in_place(logits, vb.adjust):  # queued before the logits are put back
        return target_choices(logits[:, :1], vb)[0][:, 0]


def decode_outcome(tokens: Sequence[int]) -> VerifyOutcome:
    """``verify_step``'s outcome for a decode step whose choices (``decode_choices``) the host
    has read: each row emits its token and accepts no node."""
    return _chains_outcome([0] * len(tokens), list(tokens), [])


def _verify_exact_chains(choices: torch.Tensor, vb: VerifyBatch, N: int,
                         propose: Proposer | None) -> VerifyOutcome:
    """``verify_step`` for a batch of chains under the exact rule (no loose, no PAD row), in a
    few operations: node i holds the target's choice after node i - 1 (``choices[:, i]``), the
    accepted nodes are the run of such from the first, the emitted token the choice after the
    run. choices: [B, 1 + N] long."""
    idx = torch.arange(N, device=choices.device)
    valid = idx[None] < vb.counts.clamp(max=N)[:, None]
    match = valid & (vb.tokens[:, :N] == choices[:, :N])  # [B, N]
    run = match.long().cumprod(1)  # [B, N]: 1 while every node so far matched
    n = run.sum(1, keepdim=True)  # [B, 1]: accepted nodes
    parts = [choices.gather(1, n), n]
    if propose is not None:
        parts.append(propose(run.bool(), parts[0][:, 0]))
    host = to_host(torch.cat(parts, 1)).tolist()  # the step's one sync
    return _chains_outcome([r[1] for r in host], [r[0] for r in host],
                           [r[2:] for r in host] if propose is not None else [])


def _verify_exact_chains_on_host(choices: torch.Tensor, nodes: np.ndarray) -> VerifyOutcome:
    """``_verify_exact_chains`` without a proposer, judged on the host: the target's choices
    [B, 1 + N] long are the step's one sync (a few integers a row), then the same rule in
    NumPy against the nodes the host built the rows from, [B, N] int64 (-1 padding, which no
    choice equals): a handful of array operations where the device's cost a launch each (on
    the CPU, ~80 us a step for one row against ~15)."""
    chosen = to_host(choices)  # the step's one sync
    run = np.logical_and.accumulate(nodes == chosen[:, :nodes.shape[1]], axis=1)  # [B, N]
    n = run.sum(1)  # [B]: accepted nodes
    return _chains_outcome(n.tolist(), chosen[np.arange(len(n)), n].tolist(), [])


def _chains_outcome(counts: list[int], tokens: list[int], proposals: list[list[int]]
                    ) -> VerifyOutcome:
    """Exact chains' outcome from each row's accepted count and emitted token: a chain's
    path is its first nodes, none kept by a lossy rule."""
    paths, kept = _CHAIN_PATHS, _NONE_KEPT
    if max(counts, default=0) >= len(paths):  # past the tables (not a step's widths)
        return VerifyOutcome([tuple(range(c)) for c in counts], tokens, proposals,
                             [(0,) * c for c in counts])
    return VerifyOutcome([paths[c] for c in counts], tokens, proposals, [kept[c] for c in counts])


# a chain's accepted path, and its lossy-kept flags (none), by its length: shared, read-only
_CHAIN_PATHS = [tuple(range(c)) for c in range(65)]
_NONE_KEPT = [(0,) * c for c in range(65)]


def _accepted_in_tree(match: torch.Tensor, exact: torch.Tensor, tokens: torch.Tensor,
                      parents: torch.Tensor, scores: torch.Tensor, logits: torch.Tensor,
                      valid: torch.Tensor, vb: VerifyBatch, lenient: LenientRule | None
                      ) -> torch.Tensor:
    """[B, N] bool: the accepted nodes of trees, from each node's match [B, N] (PAD's lenient
    nodes added here): a node is accepted with its parent, and of siblings that match the
    first one counts."""
    idx = torch.arange(tokens.shape[1], device=tokens.device)
    siblings = parents[:, :, None] == parents[:, None, :]  # [B, N, N]: i and j share a parent
    if vb.any_pad and lenient is not None:
        kept = vb.pad[:, None] & valid & lenient(logits, tokens, parents)
        if vb.any_sampled:  # only a token the row's sampling filters (top-k, top-p) leave
            at = (parents + 1).clamp(min=0)
            rows = torch.arange(len(tokens), device=logits.device)[:, None]
            kept = kept & scores[rows, at, tokens.clamp(min=0)].isfinite()
        # a lenient node gives way to a sibling the exact rule accepts
        match = match | (kept & ~(siblings & exact[:, None, :]).any(-1))
    # of siblings holding the same token (a malformed tree), or both kept by a lossy rule, the
    # first one counts: the accepted nodes stay one path
    earlier = siblings & (idx[None, :, None] > idx[None, None, :])  # j an earlier sibling of i
    match = match & ~(earlier & match[:, None, :]).any(-1)
    accepted = match
    root = torch.ones(len(tokens), 1, dtype=torch.bool, device=logits.device)
    for _ in range(max(0, vb.max_depth - 1)):  # a node is accepted with all its ancestors
        accepted = match & torch.cat([root, accepted], 1).gather(1, parents + 1)
    return accepted
