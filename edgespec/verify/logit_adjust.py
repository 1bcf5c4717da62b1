"""Logit adjustments: OpenAI's ``presence_penalty``, ``frequency_penalty`` and ``logit_bias``,
applied to the target's logits at every position a step verifies, before temperature, top-k and
top-p (as vLLM and OpenAI order them), so greedy rows take the adjusted argmax and sampled rows
sample the adjusted distribution.

At a position whose preceding output (the session's generated tokens, committed ones included,
then the draft nodes on the path to it) holds token t ``count(t)`` times, t's logit moves by

    delta(t) = bias(t) - frequency_penalty * count(t) - presence_penalty * (count(t) > 0)

computed on the host in float32 (``deltas``), and only tokens with a nonzero delta get an entry.
The prompt's tokens are not counted (vLLM's rule for these two penalties).

Why it stays exact: a position's delta is a function of the output before it alone, so a
position verified inside a draft gets the same float32 delta as the same position decoded
alone, and the adjusted logit is one float32 add of it to a logit whose bits are decoding's own
(the runner's batch-invariant kernels). The entries of a step are unique (row, column, token)
triples, so the add is a gather, an add and a scatter with no accumulation order to differ.
Logprobs stay the model's own: the moves are added to the step's logits in place for the
verification alone and put back after it (``adjusted_in_place``), before ``token_logprobs``
reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ..config import SamplingParams
from ..runner.host_transfers import to_device


@dataclass(frozen=True)
class LogitAdjust:
    """A step's adjustments, as tensors on the runner's device: entry e moves the logit of
    token ``ids[e]`` at row ``rows[e]``, column ``cols[e]`` (0: the root's successor, 1 + i:
    node i's) by ``deltas[e]``. No (row, column, token) appears twice."""

    rows: torch.Tensor  # [E] long
    cols: torch.Tensor  # [E] long
    ids: torch.Tensor  # [E] long
    deltas: torch.Tensor  # [E] float32
    max_col: int  # the largest column of an entry, known on the host


def deltas(counts: np.ndarray, bias: np.ndarray, params: SamplingParams) -> np.ndarray:
    """delta(t) for tokens seen ``counts`` [..., U] int64 times with biases ``bias`` [U]
    float32 -> float32 [..., U]: the one formula every path uses, in float32 throughout
    (without penalties it is the bias itself, bit for bit, which ``row_entries`` then takes as
    it is)."""
    f = np.float32(params.frequency_penalty)
    p = np.float32(params.presence_penalty)
    return bias - f * counts.astype(np.float32) - p * (counts > 0).astype(np.float32)


def row_entries(output: Sequence[int], tokens: Sequence[int], parents: Sequence[int],
                params: SamplingParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row's entries (columns [E] int64, token ids [E] int64, deltas [E] float32) for a
    session whose output so far is ``output`` and whose draft is the tree (``tokens``,
    ``parents``: -1 the root; a node's parent comes before it). Column 0 scores the token
    after the output; column 1 + i the token after node i, whose path holds node i and its
    ancestors."""
    n = len(tokens)
    bias_ids = np.fromiter((t for t, _ in params.logit_bias), np.int64, len(params.logit_bias))
    bias_vals = np.fromiter((v for _, v in params.logit_bias), np.float32,
                            len(params.logit_bias))
    if not (params.presence_penalty or params.frequency_penalty):  # the bias alone: every column
        keep = bias_vals != 0
        ids, vals = bias_ids[keep], bias_vals[keep]
        cols = np.repeat(np.arange(n + 1, dtype=np.int64), len(ids))
        return cols, np.tile(ids, n + 1), np.tile(vals, n + 1)
    seen = np.asarray(output, dtype=np.int64)
    drafted = np.asarray(tokens, dtype=np.int64)
    universe, where = np.unique(np.concatenate([seen, drafted, bias_ids]), return_inverse=True)
    u = len(universe)
    base = np.bincount(where[:len(seen)], minlength=u)  # [U]: the committed output's counts
    node_at = where[len(seen):len(seen) + n]
    bias = np.zeros(u, dtype=np.float32)
    bias[where[len(seen) + n:]] = bias_vals
    counts = np.empty((n + 1, u), dtype=np.int64)  # [1 + N, U]: the path's counts at a column
    counts[0] = base
    for i in range(n):  # a node's path: its parent's, and itself
        counts[i + 1] = counts[parents[i] + 1]
        counts[i + 1, node_at[i]] += 1
    d = deltas(counts, bias, params)
    cols, at = np.nonzero(d)
    return cols.astype(np.int64), universe[at], d[cols, at]


def step_adjust(outputs: Sequence[Sequence[int]], nodes: Sequence[tuple[Sequence[int],
                                                                        Sequence[int]]],
                params: Sequence[SamplingParams], device: torch.device | str
                ) -> LogitAdjust | None:
    """The step's ``LogitAdjust`` over its rows (each row's output so far, its draft as
    (tokens, parents), its sampling settings), or None where no row adjusts (or none moves a
    logit)."""
    parts = [(b, row_entries(out, tok, par, p)) for b, (out, (tok, par), p)
             in enumerate(zip(outputs, nodes, params)) if p.adjusts_logits]
    parts = [(b, e) for b, e in parts if len(e[0])]
    if not parts:
        return None
    rows = np.concatenate([np.full(len(e[0]), b, dtype=np.int64) for b, e in parts])
    cols = np.concatenate([e[0] for _, e in parts])
    ids = np.concatenate([e[1] for _, e in parts])
    vals = np.concatenate([e[2] for _, e in parts])
    rows_t, cols_t, ids_t = to_device([rows, cols, ids], device, torch.long)
    [vals_t] = to_device([vals], device, torch.float32)
    return LogitAdjust(rows_t, cols_t, ids_t, vals_t, int(cols.max()))


@contextmanager
def adjusted_in_place(logits: torch.Tensor, adjust: LogitAdjust | None):
    """logits [B, R, V] float32 with the adjustments added for the block's duration, then put
    back bit for bit: the entries' values are read, written moved, and written back as read, so
    the step's logits stay the model's own for its logprobs, with no copy of the logits (a
    64 x 9 step over a 49,152-token vocabulary is 113 MB). Entries past the R columns read here
    are left out (a decode step reads its roots' column alone)."""
    if adjust is None:
        yield logits
        return
    if logits.dtype != torch.float32:
        raise TypeError(f"logits are adjusted in float32, got {logits.dtype}")
    rows, cols, ids, vals = adjust.rows, adjust.cols, adjust.ids, adjust.deltas
    if adjust.max_col >= logits.shape[1]:  # known on the host: no sync where none is cut
        inside = cols < logits.shape[1]
        rows, cols, ids, vals = rows[inside], cols[inside], ids[inside], vals[inside]
    with torch.inference_mode():  # the runner's logits are inference tensors
        saved = logits[rows, cols, ids]  # [E]: a copy (advanced indexing)
        logits[rows, cols, ids] = saved + vals
    try:
        yield logits
    finally:
        with torch.inference_mode():
            logits[rows, cols, ids] = saved
