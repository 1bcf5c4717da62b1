"""One verification path for every step: chains and trees, greedy and keyed sampling, exact
and loose, computed on the runner's device with one host synchronisation.

``VerifyBatch`` is built once per step from the drafts (host data) and moved to the device;
``verify_step(logits, batch)`` decides every row at once and returns a ``VerifyOutcome`` after a
single ``.tolist()``. A chain is the tree whose node i hangs from node i - 1. The maths is that of
``edgespec.verify.sampling`` (greedy argmax; the position-keyed Gumbel-max sample, its noise
computed on the device with the same integers as the host's) and ``edgespec.verify.loose`` (FLy,
opt-in).

A node is accepted when it holds its parent's choice and its parent is accepted (the root
always is): the accepted nodes form the longest path target-only decoding would have taken, its
last node's choice is the emitted token. Every node's logits are decoding's own bit for bit
(``edgespec.runner.attention``), branch nodes included.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import LooseParams, SamplingParams
from .keyed_noise import _signed, gumbel_of_keys, position_keys, seed_of


@dataclass
class VerifyBatch:
    """A step's drafts and sampling settings, as tensors on the runner's device.

    Row b of the forward's logits [B, 1 + N, V] scores the token after the row's root (index 0)
    and after each of its draft nodes (index 1 + i)."""

    tokens: torch.Tensor  # [B, N] long: draft nodes, -1 for padding and for invalid ids
    parents: torch.Tensor  # [B, N] long: each node's parent node, -1: the root
    depths: torch.Tensor  # [B, 1 + N] long: 0 for the root, a node's depth after it
    counts: torch.Tensor  # [B] long: nodes in the row
    starts: torch.Tensor  # [B] long: absolute position of the root's successor
    seeds: torch.Tensor  # [B] long: keyed-noise seeds (int64 bit patterns; greedy rows 0)
    temperature: torch.Tensor  # [B] float32 (greedy rows 1)
    top_k: torch.Tensor  # [B] long (0: off)
    top_p: torch.Tensor  # [B] float32 (1: off)
    greedy: torch.Tensor  # [B] bool
    loose: torch.Tensor  # [B] bool: FLy's rule (chains only)
    # what runs, known on the host without looking at a tensor
    any_sampled: bool
    max_top_k: int  # the largest top-k of a sampled row (0: none)
    any_top_p: bool
    any_loose: bool
    max_depth: int  # the deepest node's depth (0 without nodes)

    @property
    def max_nodes(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def build(cls, drafts: list[tuple[list[int], list[int]]], starts: list[int],
              params: list[SamplingParams], modes: list[str], vocab: int,
              device: str | torch.device = "cpu") -> "VerifyBatch":
        """drafts[b] = (tokens, parents) of row b's tree (a chain: parents -1, 0, 1, ...);
        starts[b]: the absolute position of the root's successor; modes[b]: "exact" or
        "loose". A token outside [0, vocab) never matches."""
        B = len(drafts)
        N = max(1, max(len(t) for t, _ in drafts))
        tokens = torch.full((B, N), -1, dtype=torch.long)
        parents = torch.full((B, N), -1, dtype=torch.long)
        depths = torch.zeros(B, 1 + N, dtype=torch.long)
        counts, max_depth = [], 0
        for b, (toks, pars) in enumerate(drafts):
            n = len(toks)
            counts.append(n)
            tokens[b, :n] = torch.as_tensor([t if _is_id(t, vocab) else -1 for t in toks],
                                            dtype=torch.long)
            parents[b, :n] = torch.as_tensor(list(pars), dtype=torch.long)
            d = [0]
            for p in pars:
                d.append(d[p + 1] + 1)
            depths[b, :n + 1] = torch.as_tensor(d, dtype=torch.long)
            max_depth = max(max_depth, *d)
        greedy = [p.greedy for p in params]
        seeds = [0 if g else _signed(seed_of(p)) for g, p in zip(greedy, params)]

        def dev(x, dtype=torch.long):
            return torch.as_tensor(x, dtype=dtype).to(device)

        return cls(tokens=tokens.to(device), parents=parents.to(device),
                   depths=depths.to(device), counts=dev(counts),
                   starts=dev(starts), seeds=dev(seeds),
                   temperature=dev([1.0 if g else max(p.temperature, 1e-5)
                                    for g, p in zip(greedy, params)], torch.float32),
                   top_k=dev([0 if g else (p.top_k or 0) for g, p in zip(greedy, params)]),
                   top_p=dev([1.0 if g else p.top_p for g, p in zip(greedy, params)],
                             torch.float32),
                   greedy=dev(greedy, torch.bool), loose=dev([m == "loose" for m in modes],
                                                            torch.bool),
                   any_sampled=not all(greedy),
                   max_top_k=max([p.top_k or 0 for g, p in zip(greedy, params) if not g],
                                 default=0),
                   any_top_p=any(not g and p.top_p < 1.0 for g, p in zip(greedy, params)),
                   any_loose=any(m == "loose" for m in modes), max_depth=max_depth)


@dataclass(frozen=True)
class VerifyOutcome:
    """Per row: the accepted path (node indices, root's child first) and the token the target
    emits after it."""

    paths: list[list[int]]
    tokens: list[int]
    proposals: list[list[int]] = field(default_factory=list)  # a proposer's next drafts


# drafts the next step on the device from a step's decisions: (accepted [B, N] bool, emitted
# token [B] long) -> target token ids [B, K] long (-1: none); its output joins the step's sync
Proposer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def filter_scores(logits: torch.Tensor, vb: VerifyBatch) -> torch.Tensor:
    """Each row's processed log-probabilities up to a constant (temperature, top-k, top-p; -inf
    where removed): logits [B, R, V] -> float32 [B, R, V]; the same bits as
    ``sampling.filtered_logits`` row by row."""
    x = logits.float() / vb.temperature[:, None, None]
    V = x.shape[-1]
    if vb.max_top_k:
        k = vb.top_k.clamp(0, V)
        kmax = min(V, vb.max_top_k)  # each row's k-th largest, from one top-kmax
        kth = torch.topk(x, kmax, dim=-1).values.gather(
            -1, (k - 1).clamp(0, kmax - 1)[:, None, None].expand(-1, x.shape[1], 1))
        on = ((k > 0) & (k < V))[:, None, None]
        x = x.masked_fill(on & (x < kth), float("-inf"))
    if vb.any_top_p:
        drop = top_p_drop(x, vb.top_p[:, None]) & (vb.top_p < 1.0)[:, None, None]
        x = x.masked_fill(drop, float("-inf"))
    return x


def top_p_drop(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens top-p removes: scores [..., V] float32, top_p [...] -> bool [..., V].

    A token goes when the tokens scored strictly above it already hold top_p of the mass; tied
    scores stay or go together. The rule reads only the sorted scores' values, never the order
    the sort gave tied ids (sorts differ there by row count on CUDA, and bfloat16 logits tie
    often), and the cut is a score compared with each token's own, so a row gets the same
    decision alone or among any rows."""
    sorted_x = torch.sort(scores, dim=-1, descending=True).values
    probs = sorted_x.softmax(-1)
    before = _row_cumsum(probs) - probs  # the mass ranked ahead of each sorted position
    V = scores.shape[-1]
    pos = torch.arange(V, device=scores.device)
    new_run = torch.ones_like(sorted_x, dtype=torch.bool)
    new_run[..., 1:] = sorted_x[..., 1:] != sorted_x[..., :-1]
    run_start = torch.where(new_run, pos, 0).cummax(-1).values  # each tie run's first position
    kept = (before.gather(-1, run_start) < top_p[..., None]).sum(-1, keepdim=True)
    cut = sorted_x.gather(-1, (kept - 1).clamp_min(0))  # the lowest score kept
    return scores < cut


def _row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Running sums along the last dim, each row's bits independent of how many rows there are:
    CUDA scans a lone row with a device-wide kernel (another summation order) and many rows
    row by row, so a lone row is scanned beside a copy of itself."""
    if x.device.type == "cuda" and x.numel() == x.shape[-1]:
        return x.reshape(1, -1).expand(2, -1).cumsum(-1)[:1].reshape(x.shape)
    return x.cumsum(-1)


def target_choices(logits: torch.Tensor, vb: VerifyBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own token after the root and after every node: greedy rows the argmax,
    sampled rows the keyed Gumbel-max sample at the row's absolute position. Returns
    (choices [B, R] long, scores [B, R, V]: what the choice was taken over)."""
    if not vb.any_sampled:
        return logits.argmax(-1), logits
    scores = filter_scores(logits, vb)
    pos = vb.starts[:, None] + vb.depths[:, : logits.shape[1]]  # [B, R]
    keys = position_keys(vb.seeds[:, None], pos)[..., None]  # [B, R, 1]
    ids = torch.arange(logits.shape[-1], device=logits.device)
    sampled = (scores.double() + gumbel_of_keys(keys, ids)).argmax(-1)
    choices = torch.where(vb.greedy[:, None], logits.argmax(-1), sampled)
    scores = torch.where(vb.greedy[:, None, None], logits.float(), scores)
    return choices, scores


def row_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax over the last dim (-inf: impossible tokens; a row that is not
    a distribution, NaN, reads as 0), float64 [...]."""
    logp = torch.log_softmax(scores.double(), -1)
    p = logp.exp()
    h = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    return torch.nan_to_num(h, nan=0.0)


def _loose_accepts(match: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor,
                   counts: torch.Tensor, loose: LooseParams) -> torch.Tensor:
    """FLy's rule on chain rows (``loose_verify``): draft token i mismatching the target is
    accepted where the entropy at i is above the gate, the token is plausible (at least
    ``min_ratio`` of the top probability) and the next ``window`` draft tokens all match."""
    B, N = match.shape
    rows = scores[:, :N]  # row i scores draft token i
    ent = row_entropy(rows)  # [B, N]
    at = rows.float().gather(-1, tokens.clamp_min(0)[..., None])[..., 0]
    plausible = (tokens >= 0) & (at > float("-inf")) & \
        (at - rows.float().amax(-1) >= math.log(loose.min_ratio))
    ok = match.long()
    csum = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=ok.device), ok.cumsum(1)], 1)
    idx = torch.arange(N, device=ok.device)
    end = (idx + loose.window + 1).clamp(max=N)
    window_ok = (csum[:, end] - csum[:, idx + 1]) == loose.window
    inside = (idx[None] + loose.window) < counts[:, None]
    return (ent > loose.entropy) & plausible & window_ok & inside


def verify_step(logits: torch.Tensor, vb: VerifyBatch, loose: LooseParams | None = None,
                propose: Proposer | None = None) -> VerifyOutcome:
    """Decide every row of a step. logits: [B, 1 + N', V] from ``forward`` (chains) or
    ``forward_tree``; a row uses its first 1 + count entries. ``propose``: drafts for the next
    step from the decisions, computed before the sync. One host sync."""
    N = min(vb.max_nodes, logits.shape[1] - 1)
    logits = logits[:, :1 + N]  # rows past every draft: padding
    choices, scores = target_choices(logits, vb)  # [B, 1 + N]
    tokens, parents = vb.tokens[:, :N], vb.parents[:, :N]
    idx = torch.arange(N, device=logits.device)
    valid = idx[None] < vb.counts.clamp(max=N)[:, None]
    match = valid & (tokens == choices.gather(1, parents + 1))  # node holds its parent's choice
    if vb.any_loose:  # loose rows are chains
        match = match | (vb.loose[:, None] & valid &
                         _loose_accepts(match, tokens, scores, vb.counts, loose or LooseParams()))
    # of siblings holding the same token (a malformed tree), the first one counts, as in
    # ``tree_verify.verify_tree``: the accepted nodes stay one path
    earlier = (parents[:, :, None] == parents[:, None, :]) & \
        (idx[None, :, None] > idx[None, None, :])  # [B, N, N]: j is an earlier sibling of i
    match = match & ~(earlier & match[:, None, :]).any(-1)
    accepted = match
    root = torch.ones(len(tokens), 1, dtype=torch.bool, device=logits.device)
    for _ in range(max(0, vb.max_depth - 1)):  # a node is accepted with all its ancestors
        accepted = match & torch.cat([root, accepted], 1).gather(1, parents + 1)
    last = torch.where(accepted, idx + 1, 0).amax(1, keepdim=True) if N else \
        torch.zeros(len(tokens), 1, dtype=torch.long, device=logits.device)
    token = choices.gather(1, last)  # after the path's last node (row 0: the root)
    parts = [token, accepted.long()]
    if propose is not None:
        parts.append(propose(accepted, token[:, 0]))
    host = torch.cat(parts, 1).tolist()  # the step's one sync
    return VerifyOutcome([[i for i, a in enumerate(r[1:1 + N]) if a] for r in host],
                         [r[0] for r in host],
                         [r[1 + N:] for r in host] if propose is not None else [])


def verify_batch(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
                 starts: list[int], verify: str | list[str] = "exact",
                 loose: LooseParams | None = None) -> list[tuple[int, int]]:
    """Verify a padded batch of chains. logits: [B, T_max, V]; row b uses its first
    len(drafts[b]) + 1 positions; starts[b]: absolute position of row b's first draft token (of
    the emitted token when the draft is empty). ``verify``: "exact" (lossless), "loose" (FLy,
    lossy, with the ``loose`` knobs), or one of those per row. Returns (n_accepted, token) per
    row."""
    modes = [verify] * len(drafts) if isinstance(verify, str) else list(verify)
    drafts = [list(d)[: logits.shape[1] - 1] for d in drafts]  # never past the row
    vb = VerifyBatch.build([(d, list(range(-1, len(d) - 1))) for d in drafts], starts, params,
                           modes, logits.shape[-1], logits.device)
    out = verify_step(logits, vb, loose)
    return [(len(p), t) for p, t in zip(out.paths, out.tokens)]


def _is_id(x, vocab: int) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and 0 <= int(x) < vocab
