"""Drafting with a head on the verifier's device, inside the verification step: no host sync.

``draft`` turns each session's context pairs into up to K target token ids (-1 where a head has
nothing more to say); ``HeadContext`` keeps each session's last W pairs between steps and
``next_context`` extends them with a step's accepted path (``edgespec.engine.spec_engine`` wires
both into ``verification.verify_step``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .modules import DraftHead

# ctc: the blank wins a slot only when its logit beats the best token's by this much. A CTC
# head trained briefly (800 steps here) puts the blank first almost everywhere, so its plain
# best path drafts nothing (held-out first-draft accuracy 0.001 against 0.10 with the penalty)
CTC_BLANK_PENALTY = 4.0


@dataclass
class HeadContext:
    """One session's last W pairs (right-aligned; ``visible`` marks the real ones)."""

    features: torch.Tensor  # [W, H] float32
    tokens: torch.Tensor  # [W] long: the token after each feature
    visible: torch.Tensor  # [W] bool

    @classmethod
    def empty(cls, W: int, H: int, device) -> "HeadContext":
        return cls(torch.zeros(W, H, device=device), torch.zeros(W, dtype=torch.long,
                                                                 device=device),
                   torch.zeros(W, dtype=torch.bool, device=device))


@torch.no_grad()
def draft(head: DraftHead, feats: torch.Tensor, tokens: torch.Tensor, visible: torch.Tensor,
          k: int) -> torch.Tensor:
    """feats [B, W, H], tokens [B, W], visible [B, W] (each row's last pair real) -> draft
    target token ids [B, k] long, -1 past what the head drafts."""
    k = min(k, head.cfg.depth) if head.cfg.kind != "eagle" else k
    ctx = head.pairs(feats.float(), tokens)  # [B, W, D]
    ids = head.target.vocab_ids
    if head.cfg.kind == "eagle":
        return _draft_eagle(head, ctx, visible, k)
    logits = head.logits(head.run_queries(ctx, visible))  # [B, slots, Vd(+1)]
    if head.cfg.kind == "ctc":
        logits[..., -1] -= CTC_BLANK_PENALTY
    best = logits.argmax(-1)
    if head.cfg.kind == "specformer":
        return ids[best[:, :k]]
    return _collapse_ctc(best, head.cfg.draft_vocab, ids, k)


def _draft_eagle(head: DraftHead, ctx: torch.Tensor, visible: torch.Tensor, k: int
                 ) -> torch.Tensor:
    W = head.cfg.context
    keys, values = head.block.keys(ctx)
    vis = visible
    x = ctx[:, -1:]  # the query: the last pair
    out = []
    for _ in range(k):
        f = head.feature(head.block(x, keys, values, vis[:, None]))  # [B, 1, H]
        tok = head.target.vocab_ids[head.logits(f).argmax(-1)]  # [B, 1]
        out.append(tok)
        x = head.pairs(f, tok)
        k2, v2 = head.block.keys(x)
        keys, values = torch.cat([keys, k2], 1), torch.cat([values, v2], 1)
        vis = torch.cat([vis, torch.ones_like(vis[:, :1])], 1)
        vis[:, : vis.shape[1] - W] = False  # the window W, as in training
    return torch.cat(out, 1)


def _collapse_ctc(best: torch.Tensor, blank: int, ids: torch.Tensor, k: int) -> torch.Tensor:
    """CTC's best path [B, T] (draft ids, ``blank`` the blank) -> the first k tokens after
    collapsing repeats and dropping blanks, as target ids [B, k] (-1 past the end)."""
    B, T = best.shape
    prev = torch.cat([torch.full_like(best[:, :1], -1), best[:, :-1]], 1)
    keep = (best != blank) & (best != prev)
    place = torch.where(keep, keep.long().cumsum(1) - 1, T)  # [B, T]: output slot or T
    out = torch.full((B, T + 1), -1, dtype=torch.long, device=best.device)
    out.scatter_(1, place, ids[best.clamp(max=blank - 1)])
    out[:, T] = -1
    return out[:, :k] if k <= T else torch.cat([out[:, :T], out.new_full((B, k - T), -1)], 1)


def next_context(old_feats: torch.Tensor, old_tokens: torch.Tensor, old_visible: torch.Tensor,
                 features: torch.Tensor, node_tokens: torch.Tensor, depths: torch.Tensor,
                 accepted: torch.Tensor, emitted: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each session's context after a verification step, on the device.

    old_*: [B, W, H], [B, W], [B, W] before the step; features [B, 1 + N, H]: the step's
    forward rows (row 0 the root, row 1 + i draft node i); node_tokens [B, N] and depths
    [B, 1 + N] of the draft nodes; accepted [B, N] bool (one path); emitted [B] the token after
    it. The accepted path's rows (root first) become pairs (feature, the next path token, the
    emitted token for the last) appended after the old ones; the last W are kept."""
    B, W = old_tokens.shape
    N = accepted.shape[1]
    dev = features.device
    n_path = 1 + accepted.long().sum(1)  # [B]
    width = N + 2
    col = torch.where(accepted, depths[:, 1:], width - 1)  # a path node's depth, else a bin
    rows = torch.zeros(B, width, dtype=torch.long, device=dev)
    rows.scatter_(1, col, torch.arange(1, N + 1, device=dev).expand(B, -1))
    rows = rows[:, : N + 1]  # [B, 1 + N]: path row at each depth (0: the root)
    row_tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), node_tokens], 1)
    after = row_tokens.gather(1, torch.cat([rows[:, 1:], rows[:, :1]], 1))  # next path token
    after.scatter_(1, (n_path - 1)[:, None], emitted[:, None])
    feats = features.float().gather(1, rows[..., None].expand(-1, -1, features.shape[-1]))
    depth = torch.arange(N + 1, device=dev)[None]
    new_visible = depth < n_path[:, None]
    all_feats = torch.cat([old_feats, feats], 1)
    all_tokens = torch.cat([old_tokens, after], 1)
    all_visible = torch.cat([old_visible, new_visible], 1)
    pick = n_path[:, None] + torch.arange(W, device=dev)[None]  # the last W real pairs
    return (all_feats.gather(1, pick[..., None].expand(-1, -1, all_feats.shape[-1])),
            all_tokens.gather(1, pick), all_visible.gather(1, pick))
