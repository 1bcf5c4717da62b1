"""The training losses of the three head kinds over a batch of windows (``Batch``).

Position i of a window drafts x_{i+2}, x_{i+3}, ...: draft j (1-based) is scored against the
target's distribution after position i + j (its top-k, soft cross-entropy over the draft
vocabulary), which is the distribution verification compares against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .modules import DraftHead


@dataclass
class Batch:
    features: torch.Tensor  # [B, S, H]: f_i
    tokens: torch.Tensor  # [B, S]: x_{i+1}
    valid: torch.Tensor  # [B, S] bool: a real position
    future_features: torch.Tensor  # [B, S, H]: f_{i+1}
    future_ids: torch.Tensor  # [B, S, K, k]: the target's top-k after position i + j
    future_probs: torch.Tensor  # [B, S, K, k]
    future_tokens: torch.Tensor  # [B, S, K]: x_{i+1+j}, the target's continuation
    future_valid: torch.Tensor  # [B, S, K] bool


def soft_ce(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor,
            to_draft: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of draft logits [..., Vd(+1)] against the target's top-k (target ids
    ``ids`` and ``probs`` [..., k]) restricted to the draft vocabulary (``to_draft`` [V]: draft
    id or -1), averaged over ``mask`` [...]."""
    d = to_draft[ids]  # [..., k]
    w = probs * (d >= 0)
    w = w / w.sum(-1, keepdim=True).clamp_min(1e-6)
    logp = logits.float().log_softmax(-1).gather(-1, d.clamp_min(0))
    per = -(w * logp).sum(-1)
    m = mask & (to_draft[ids[..., 0]] >= 0)  # the target's favourite is draftable
    return (per * m).sum() / m.sum().clamp_min(1)


def _band(S: int, W: int, valid: torch.Tensor) -> torch.Tensor:
    """[B, S, S] bool: position i sees positions (i - W, i] that are valid."""
    i = torch.arange(S)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W)
    return band[None] & valid[:, None, :] | torch.eye(S, dtype=torch.bool)[None]


def windows(x: torch.Tensor, W: int) -> torch.Tensor:
    """[B, S, ...] -> [B, S, W, ...]: for each position the W positions ending at it (left
    padding with zeros)."""
    pad = torch.zeros_like(x[:, :1]).expand(-1, W - 1, *x.shape[2:])
    xp = torch.cat([pad, x], 1)
    idx = torch.arange(x.shape[1])[:, None] + torch.arange(W)[None]  # [S, W]
    return xp[:, idx]


def head_loss(head: DraftHead, b: Batch) -> torch.Tensor:
    cfg = head.cfg
    to_draft = torch.full((head.target.embed.shape[0],), -1, dtype=torch.long)
    to_draft[head.target.vocab_ids] = torch.arange(cfg.draft_vocab)
    B, S, _ = b.features.shape
    u = head.pairs(b.features, b.tokens)  # [B, S, D]
    if cfg.kind == "eagle":
        return _eagle_loss(head, b, u, to_draft)
    W = cfg.context
    ctx = windows(u, W).reshape(B * S, W, -1)
    vis = windows(b.valid, W).reshape(B * S, W)
    feats = head.run_queries(ctx, vis)  # [N, slots, H]
    logits = head.logits(feats)
    if cfg.kind == "specformer":
        return soft_ce(logits.view(B, S, cfg.depth, -1), b.future_ids, b.future_probs,
                       to_draft, b.future_valid)
    return _ctc_loss(logits, b, to_draft)


def _eagle_loss(head: DraftHead, b: Batch, u: torch.Tensor, to_draft: torch.Tensor
                ) -> torch.Tensor:
    """Two steps: from the true context (teacher forcing), then from the head's own predicted
    features in place of the true ones (what drafting feeds it after its first token)."""
    B, S, _ = u.shape
    mask = _band(S, head.cfg.context, b.valid)
    target_ok = b.future_valid[..., 0]
    total = torch.zeros(())
    x = u
    for _ in range(2):
        k, v = head.block.keys(x)
        f = head.feature(head.block(x, k, v, mask))  # [B, S, H]: f^_{i+1}
        ce = soft_ce(head.logits(f), b.future_ids[:, :, 0], b.future_probs[:, :, 0],
                     to_draft, target_ok)
        reg = (F.smooth_l1_loss(f.float(), b.future_features, reduction="none").mean(-1)
               * target_ok).sum() / target_ok.sum().clamp_min(1)
        total = total + ce + 0.5 * reg
        # position i's second input: the feature predicted at i - 1, with the true token
        shifted = torch.cat([b.features[:, :1].to(f.dtype), f[:, :-1]], 1)
        x = head.pairs(shifted, b.tokens)
    return total


def _ctc_loss(logits: torch.Tensor, b: Batch, to_draft: torch.Tensor) -> torch.Tensor:
    """CTC against the target's continuation x_{i+2}.. in draft ids, cut at its first token
    outside the draft vocabulary; positions with nothing to learn are left out."""
    N, T, _ = logits.shape
    tgt = to_draft[b.future_tokens.reshape(N, -1)]  # [N, K]
    ok = (tgt >= 0) & b.future_valid.reshape(N, -1)
    lengths = ok.long().cumprod(1).sum(1)  # up to the first gap
    keep = lengths > 0
    if not keep.any():
        return logits.sum() * 0
    logp = logits[keep].float().log_softmax(-1).transpose(0, 1)  # [T, n, Vd + 1]
    lens = lengths[keep]
    flat = torch.cat([t[:n] for t, n in zip(tgt[keep], lens.tolist())])
    return F.ctc_loss(logp, flat, torch.full((len(lens),), T, dtype=torch.long), lens,
                      blank=logits.shape[-1] - 1, zero_infinity=True)
