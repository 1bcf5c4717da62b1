"""The target's own choice at every position of a verification step: greedy rows its argmax,
sampled rows the keyed Gumbel-max sample of its processed distribution (temperature, top-k,
top-p: ``filter_scores``). Each is a row's alone, bit for bit, whatever rows stand beside it:
top-p reads only sorted scores' values, a lone row's running sums are scanned as many rows'
are, and the argmax is an index (NumPy's on the CPU, where it is quicker). Callers pass the
step's ``verify_step.VerifyBatch``; what is read of it is ``SamplingRows``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from .keyed_noise import gumbel_of_keys, position_keys


class SamplingRows(Protocol):
    """What the choices read of a step's rows (``VerifyBatch``'s fields of the same names)."""

    starts: torch.Tensor  # [B] long: the absolute position of the root's successor
    depths: torch.Tensor  # [B, 1 + N] long: 0 for the root, a node's depth after it
    seeds: torch.Tensor  # [B] long: keyed-noise seeds
    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] long (0: off)
    top_p: torch.Tensor  # [B] float32 (1: off)
    greedy: torch.Tensor  # [B] bool
    any_sampled: bool
    max_top_k: int
    any_top_p: bool


def filter_scores(logits: torch.Tensor, vb: SamplingRows) -> torch.Tensor:
    """Each row's processed log-probabilities up to a constant (temperature, top-k, top-p; -inf
    where removed): logits [B, R, V] -> float32 [B, R, V]; tests hold it to the one-row oracle
    (tests/oracles.py ``filtered_logits``)."""
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


NUMPY_ARGMAX_FROM = 4096  # elements: a CPU argmax this large goes to NumPy (``last_argmax``)


def last_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``: x [..., V] -> long [...], the first index of each row's largest
    value (a NaN counts as the largest). On the CPU by NumPy, whose argmax is vectorised:
    torch's took 0.65 ms for 5 positions of a 49,152-token vocabulary and 38 ms for 64 rows
    of them on one core, NumPy's 0.03 and 7 ms; the answer is the same, an index, exact
    (tests/test_verification.py holds the two to each other on ties and NaNs). Below
    ``NUMPY_ARGMAX_FROM`` elements torch's is the quicker (one row of 512: 3-5 against 4-9 us;
    ``scripts/argmax_bench.py``)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and \
            x.numel() >= NUMPY_ARGMAX_FROM:
        return torch.from_numpy(np.argmax(x.detach().numpy(), axis=-1).astype(np.int64,
                                                                             copy=False))
    return x.argmax(-1)


def target_choices(logits: torch.Tensor, vb: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own token after the root and after every node: greedy rows the argmax,
    sampled rows the keyed Gumbel-max sample at the row's absolute position. Returns
    (choices [B, R] long, scores [B, R, V]: what the choice was taken over)."""
    if not vb.any_sampled:
        return last_argmax(logits), logits
    scores = filter_scores(logits, vb)
    pos = vb.starts[:, None] + vb.depths[:, : logits.shape[1]]  # [B, R]
    keys = position_keys(vb.seeds[:, None], pos)[..., None]  # [B, R, 1]
    ids = torch.arange(logits.shape[-1], device=logits.device)
    sampled = last_argmax(scores.double() + gumbel_of_keys(keys, ids))
    choices = torch.where(vb.greedy[:, None], last_argmax(logits), sampled)
    scores = torch.where(vb.greedy[:, None, None], logits.float(), scores)
    return choices, scores
