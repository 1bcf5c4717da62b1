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
position-keyed sample when sampling (``edgespec.verify.sampling``). The entropy is that of the
target's softmax at temperature 1 when greedy (temperature 0 has no spread to measure), of the
processed distribution (temperature, top-k, top-p) when sampling.

The output may differ from what the target alone would produce: sessions verified this way are
marked lossy in their stats, and no verifier uses this rule unless started with
``--verify loose``.
"""

from __future__ import annotations

import numbers
from typing import Callable

import torch

from ..config import LooseParams
from .verify_step import row_entropy


def entropy(scores: torch.Tensor) -> float:
    """Entropy in nats of softmax(scores) over one row of logits (-inf: impossible tokens).
    A row that is not a distribution (NaN) reads as 0: never loose."""
    return float(row_entropy(scores.reshape(1, -1))[0])


def accept_loosely(draft: list, choice_at: Callable[[int], int],
                   entropy_at: Callable[[int], float], possible: Callable[[int, int], bool],
                   params: LooseParams) -> tuple[int, int]:
    """FLy's rule over one draft. ``choice_at(i)``: the target's own token at draft position i
    (i = len(draft): the bonus position); ``entropy_at(i)``: the target's entropy there;
    ``possible(i, token)``: whether the target's processed distribution allows ``token`` at i.
    The callables are asked lazily, only where the rule needs them.

    Returns (n_accepted, token): the draft's first n tokens are kept, then ``token`` (the
    target's choice at n)."""
    n = len(draft)
    i = 0
    while i < n:
        token = choice_at(i)
        if not _same(draft[i], token) and not _loose_accept(draft, i, choice_at, entropy_at,
                                                             possible, params):
            return i, token
        i += 1
    return n, choice_at(n)


def _loose_accept(draft: list, i: int, choice_at, entropy_at, possible,
                  params: LooseParams) -> bool:
    x = draft[i]
    if not _is_id(x) or i + params.window >= len(draft):
        return False  # garbage, or the window is not all in this draft: cannot confirm
    if not entropy_at(i) > params.entropy or not possible(i, int(x)):
        return False
    return all(_same(draft[j], choice_at(j)) for j in range(i + 1, i + params.window + 1))


def _is_id(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and int(x) >= 0


def _same(x, token: int) -> bool:
    return _is_id(x) and int(x) == token
