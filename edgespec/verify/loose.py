"""Loose verification (FLy): a lossy, opt-in acceptance rule for speculative decoding.

Exact verification rejects a draft at its first token that differs from the target's own
choice. FLy (training-free loosely speculative decoding) observes that many such mismatches are
harmless where the target itself is unsure, and keeps the draft going when two signals agree:

- the entropy gate: the target's distribution at the mismatch has entropy above a threshold
  (nats), so the target had no strong preference there;
- the deferred window: the next ``window`` draft tokens (positions i+1..i+W) all equal the
  target's own choice at their positions. Those positions were scored by the same forward,
  conditioned on the draft (mismatching token included), so agreeing there means the target
  is content to continue the draft's text.

Then draft[i] is accepted and checking goes on at i+1; otherwise the exact rule applies (stop,
emit the target's choice). A window that runs past the end of the draft cannot be confirmed,
so the mismatch is rejected. ``window == 0`` is the entropy gate alone. Only a plausible token
is ever accepted: one the target's distribution gives at least ``min_ratio`` (0.1) of its top
token's probability, never one top-k / top-p rules out. Drafters are untrusted devices: this
bounds what a hostile one can slip into an output, but within it, at uncertain positions, a
drafter does steer the text; that is what loose verification trades for speed.

"The target's choice" is what exact verification compares with: the argmax when greedy, the
position-keyed sample when sampling (``edgespec.verify.verify_step``). The entropy is that of the
target's softmax at temperature 1 when greedy (temperature 0 has no spread to measure), of the
processed distribution (temperature, top-k, top-p) when sampling.

The output may differ from what the target alone would produce: sessions verified this way are
marked lossy in their stats, and no verifier uses this rule unless started with
``--verify loose``. ``loose_accepts`` is the rule the verification step runs for a whole step
(``edgespec.verify.verify_step``); tests/oracles.py walks it token by token.
"""

from __future__ import annotations

import math

import torch

from ..config import LooseParams


def row_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax over the last dim (-inf: impossible tokens; a row that is not
    a distribution, NaN, reads as 0), float64 [...]."""
    logp = torch.log_softmax(scores.double(), -1)
    p = logp.exp()
    h = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    return torch.nan_to_num(h, nan=0.0)


def loose_accepts(match: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor,
                   counts: torch.Tensor, loose: LooseParams) -> torch.Tensor:
    """FLy's rule on chain rows, on the device: draft token i mismatching the target is
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
