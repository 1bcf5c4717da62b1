"""Verification maths, as pure functions (docs/architecture.md, "Verification maths").

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

p is always the target's *processed* distribution (temperature, top-k, top-p applied), so the
output follows exactly what target-only sampling would draw from; tokens with p = 0 never win.

The per-row functions here (``verify_greedy``, ``verify_keyed``, ``verify_loose``) state the rules
one row at a time; the verifier runs them for a whole step on the device
(``edgespec.verify.verify_step``), with the same noise integers.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..config import LooseParams, SamplingParams
from .keyed_noise import keyed_choice, seed_of
from .loose import accept_loosely, entropy
from .verify_step import top_p_drop

# -- processed distributions ---------------------------------------------------------------------
def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with top-k / top-p removed tokens at -inf: log p up to a
    constant per row. logits: [N, V] -> float32 [N, V]."""
    logits = logits.float() / max(params.temperature, 1e-5)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        top_p = torch.full(logits.shape[:-1], params.top_p, dtype=torch.float32)
        logits = logits.masked_fill(top_p_drop(logits, top_p), float("-inf"))
    return logits


# -- verification -------------------------------------------------------------------------------
def verify_greedy(target_argmax: list[int], draft: list[int]) -> tuple[int, int]:
    """target_argmax: the target's argmax at each of the T+1 positions. -> (n_accepted, token)."""
    n = 0
    while n < len(draft) and _same(draft[n], target_argmax[n]):
        n += 1
    return n, target_argmax[n]


def verify_keyed(scores: torch.Tensor, draft: list[int], seed: int, start: int
                 ) -> tuple[int, int]:
    """Sampled verification of one row. scores: [T+1, V] filtered target logits (row i scores the
    token after draft[:i]); draft token i sits at absolute position start + i. Accept while each
    draft token equals the keyed sample at its position; then emit the keyed sample at the next.
    Returns (n_accepted, token)."""
    for i in range(len(draft) + 1):
        token = keyed_choice(scores[i], seed, start + i)
        if i == len(draft) or not _same(draft[i], token):
            return i, token
    raise AssertionError("unreachable")


def _same(x, token: int) -> bool:
    """A draft entry matches only when it is an integer id equal to ``token`` (garbage never
    matches, never raises)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and int(x) == token


def verify_loose(logits: torch.Tensor, draft: list[int], params: SamplingParams, start: int,
                 loose: LooseParams) -> tuple[int, int]:
    """FLy's lossy verification of one row (``edgespec.verify.loose``). logits: [T+1, V] raw
    target logits (row i scores the token after draft[:i]); draft token i sits at absolute
    position start + i. Returns (n_accepted, token)."""
    floor = math.log(loose.min_ratio)

    def plausible(row: torch.Tensor, x: int) -> bool:  # p(x) >= min_ratio * p(top)
        return x < row.shape[-1] and bool(row[x] > float("-inf")) and \
            float(row[x] - row.max()) >= floor

    if params.greedy:
        choices = logits.argmax(-1).tolist()
        return accept_loosely(draft, choices.__getitem__, lambda i: entropy(logits[i]),
                              lambda i, x: plausible(logits[i].float(), x), loose)
    scores = filtered_logits(logits, params)
    seed, picked = seed_of(params), {}

    def choice_at(i: int) -> int:
        if i not in picked:
            picked[i] = keyed_choice(scores[i], seed, start + i)
        return picked[i]

    return accept_loosely(draft, choice_at, lambda i: entropy(scores[i]),
                          lambda i, x: plausible(scores[i], x), loose)
