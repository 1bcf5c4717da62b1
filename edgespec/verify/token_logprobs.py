"""The target's log-probabilities of the tokens a step emits (OpenAI's ``logprobs``).

A session that asks for them (``Request.logprobs``: 0 for the emitted token's own, k for the k
most likely tokens beside it) gets, for every token it emits, ``log_softmax`` of the target's
logits at the position that chose it: the model's own distribution, before temperature, top-k
and top-p (vLLM's raw logprobs). A step's row scores the token after its root at column 0 and
after draft node i at column 1 + i, so the emitted tokens' columns are 0 and then one past each
accepted node (``emitted_columns``).

The logits are decoding's own bits at every position, whatever the row's width or draft
(``edgespec.runner.attention``), and each position's ``log_softmax`` is computed from its own
row alone: so a session's logprobs are target-only decoding's, bit for bit, whatever drafted
for it (tests/test_token_logprobs.py holds that). The positions the step's sessions asked for
are gathered and computed in one call, and read back in one copy: a step with no such session
does nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..protocol.token_logprob import TokenLogprob
from ..runner.host_transfers import to_device, to_host


@dataclass(frozen=True)
class LogprobPick:
    """One row's emitted tokens whose logprobs a step reads: the row, the logits columns that
    chose them (``emitted_columns``), the tokens, and how many alternatives a token gets."""

    row: int
    columns: Sequence[int]
    tokens: Sequence[int]
    top: int


def emitted_columns(path: Sequence[int], n: int) -> list[int]:
    """The logits columns that chose a row's first ``n`` emitted tokens, given its accepted
    path (node indices, root to leaf): the root's (0), then each accepted node's (1 + i)."""
    return [0, *(1 + p for p in path[:n - 1])][:n]


def read_logprobs(logits: torch.Tensor, picks: Sequence[LogprobPick]
                  ) -> list[tuple[TokenLogprob, ...]]:
    """Each pick's tokens' ``TokenLogprob`` in order, from a step's logits [B, T, V] float32:
    one gather, one ``log_softmax`` over the gathered positions [M, V], one copy to the host.

    A position's ``top`` alternatives are its ``top`` largest logprobs, equals taken by the
    lower token id: so they depend on the position's logits alone, never on what the other
    rows asked. ``topk`` of the step's largest ask, plus one, gives them wherever no tie
    crosses a position's cut (its values, not which of equal ids it picked, tell). Where one
    does (now and then in float32; at a third to a half of the positions of a bfloat16 model
    asked for 5-20), every token at or above the cut's value is read (``_at_or_above_cut``: the
    top and its equals, a few dozen) and ordered on the host: a second copy in such a step."""
    rows = [p.row for p in picks for _ in p.columns]
    columns = [c for p in picks for c in p.columns]
    tokens = [t for p in picks for t in p.tokens]
    if not columns:
        return [() for _ in picks]
    tops = [p.top for p in picks for _ in p.columns]
    k = min(max(tops) + 1, logits.shape[-1])
    row_ids, column_ids, token_ids = to_device(
        [np.asarray(rows), np.asarray(columns), np.asarray(tokens)], logits.device, torch.long)
    lp = torch.log_softmax(logits[row_ids, column_ids].float(), -1)  # [M, V]
    parts = [lp.gather(1, token_ids[:, None]).double()]  # [M, 1]
    if max(tops):
        best = lp.topk(k, -1)  # ids below 2^53: exact as float64 beside the values
        parts += [best.values.double(), best.indices.double()]
    host = to_host(torch.cat(parts, 1)).tolist()  # [M, 1 + 2k]
    alternatives: list[list[tuple[int, float]]] = []
    crossed = []  # positions where a tie crosses the cut
    for i, (r, t) in enumerate(zip(host, tops)):
        if t and t < k and r[t] == r[t + 1]:  # values t - 1 and t (from 0) are equal
            crossed.append(i)
            alternatives.append([])
        else:
            alternatives.append(sorted(zip(map(int, r[1 + k:1 + k + t]), r[1:1 + t]),
                                       key=lambda e: (-e[1], e[0])))
    if crossed:
        for i, found in zip(crossed, _at_or_above_cut(lp, crossed, [host[i][tops[i]]
                                                                  for i in crossed])):
            alternatives[i] = sorted(found, key=lambda e: (-e[1], e[0]))[:tops[i]]
    out, i = [], 0
    for p in picks:
        entries = []
        for token in p.tokens:
            entries.append(TokenLogprob(token, host[i][0], tuple(alternatives[i])))
            i += 1
        out.append(tuple(entries))
    return out


def _at_or_above_cut(lp: torch.Tensor, rows: list[int], cuts: list[float]
                     ) -> list[list[tuple[int, float]]]:
    """For each of ``rows`` of ``lp`` [M, V], every (token id, logprob) at or above its
    ``cuts`` value (a float32's value), found on the device and copied back in one copy."""
    row_ids = to_device([np.asarray(rows)], lp.device, torch.long)[0]
    cut = to_device([np.asarray(cuts, dtype=np.float32)], lp.device, torch.float32)[0]
    picked = lp[row_ids]  # [R, V]
    where = (picked >= cut[:, None]).nonzero()  # [n, 2]: (row of rows, token id)
    values = picked[where[:, 0], where[:, 1]]
    found = to_host(torch.cat([where.double(), values.double()[:, None]], 1)).tolist()
    out: list[list[tuple[int, float]]] = [[] for _ in rows]
    for r, token, value in found:
        out[int(r)].append((int(token), value))
    return out
