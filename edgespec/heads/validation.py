"""Measuring a head on held-out sequences, and choosing its draft vocabulary.

``held_out_acceptance`` drafts K tokens at positions of held-out responses from their true
contexts and counts how many in a row the target's greedy choice would accept: draft j counts
when it and the ones before it equal the response's tokens there and those were the target's
favourites (so on greedy responses this is greedy verification's acceptance).
"""

from __future__ import annotations

import torch

from .dataset import Sequences
from .drafting import draft
from .modules import DraftHead


def draft_vocabulary(train: Sequences, val: Sequences, size: int
                     ) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent tokens of the training responses (their tokens and the
    target's favourites), and the share of held-out response tokens they cover."""
    counts = torch.bincount(torch.cat([train.next_tokens.long(), train.top_ids[:, 0].long()]))
    size = min(size, int((counts > 0).sum()))
    ids = counts.topk(size).indices.sort().values
    inside = torch.zeros(max(len(counts), int(val.next_tokens.max()) + 1 if len(val.next_tokens)
                             else 0), dtype=torch.bool)
    inside[ids] = True
    coverage = float(inside[val.next_tokens.long()].float().mean()) if len(val.next_tokens) \
        else 0.0
    return ids, coverage


@torch.no_grad()
def held_out_acceptance(head: DraftHead, val: Sequences, every: int = 3,
                        max_points: int = 1500) -> dict:
    """{"tokens_per_step": 1 + mean accepted, "first_draft_accuracy", "points"}."""
    W, K = head.cfg.context, head.cfg.depth
    points: list[tuple[int, int]] = []
    for s in range(val.n_sequences):
        a, b = int(val.starts[s]), int(val.starts[s + 1])
        points.extend((a, i) for i in range(a, b - 1, every))
    points = points[:max_points]
    if not points:
        return {"tokens_per_step": 1.0, "first_draft_accuracy": 0.0, "points": 0}
    accepted, first = 0, 0
    for chunk in range(0, len(points), 256):
        part = points[chunk:chunk + 256]
        idx = torch.as_tensor([[max(a, i - W + 1 + w) for w in range(W)] for a, i in part])
        vis = torch.as_tensor([[i - W + 1 + w >= a for w in range(W)] for a, i in part])
        d = draft(head, val.features[idx].float(), val.next_tokens[idx].long(), vis, K)
        for (a, i), row in zip(part, d.tolist()):
            seq_end = int(val.starts[torch.searchsorted(val.starts, i, right=True)])
            n = 0
            for j, tok in enumerate(row, 1):
                at = i + j
                if at >= seq_end or tok != int(val.next_tokens[at]) or \
                        tok != int(val.top_ids[at, 0]):
                    break
                n += 1
            accepted += n
            first += n > 0
    return {"tokens_per_step": round(1 + accepted / len(points), 3),
            "first_draft_accuracy": round(first / len(points), 3), "points": len(points)}
