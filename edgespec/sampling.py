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

The noise is a counter-based hash (splitmix64), not a stateful generator: the value for token x
depends on (seed, pos, x) alone, so it is the same on every process, platform and torch version,
and can be computed for a few token ids (a drafter's top-k) or the whole vocabulary alike.

p is always the target's *processed* distribution (temperature, top-k, top-p applied), so the
output follows exactly what target-only sampling would draw from; tokens with p = 0 never win.

The per-row functions here (``verify_greedy``, ``verify_keyed``, ``verify_loose``) state the rules
one row at a time; the verifier runs them for a whole step on the device
(``edgespec.verification``), with the same noise integers (``position_keys``, ``gumbel_of_keys``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets

import numpy as np
import torch

from .attention import pointwise
from .config import LooseParams, SamplingParams
from .loose_verify import accept_loosely, entropy

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


# -- processed distributions ---------------------------------------------------------------------
def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with top-k / top-p removed tokens at -inf: log p up to a
    constant per row. logits: [N, V] -> float32 [N, V]."""
    logits = logits.float() / max(params.temperature, 1e-5)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already cover top_p
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


# -- position-keyed randomness --------------------------------------------------------------------
def _signed(c: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN_S, _MIX1_S, _MIX2_S = _signed(_GOLDEN), _signed(_MIX1), _signed(_MIX2)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors: products wrap modulo 2**64 like uint64's."""
    z = (z ^ _shr(z, 30)) * _MIX1_S
    z = (z ^ _shr(z, 27)) * _MIX2_S
    return z ^ _shr(z, 31)


def position_keys(seeds: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The keys of absolute positions ``pos`` in generations seeded with ``seeds``:
    splitmix64(splitmix64(seed) ^ pos) as int64 bit patterns, on the tensors' device (seeds and
    positions int64, broadcast)."""
    return _mix((_mix(seeds + _GOLDEN_S) ^ pos) + _GOLDEN_S)


def position_key(seed: int, pos: int) -> int:
    """The 64-bit key of absolute position ``pos`` in a generation seeded with ``seed``
    (``position_keys`` for one position, as an unsigned integer)."""
    return int(position_keys(torch.tensor(_signed(int(seed))), torch.tensor(_signed(int(pos))))
               ) & _MASK64


def gumbel_of_keys(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise G(key, x) = -log(-log(u)), u uniform in (0, 1) from the splitmix64 stream of
    ``key`` at counter x + 1: keys [..., 1] and token ids [..., V] (int64, broadcast) ->
    float64 [..., V], computed in integer tensor ops on their device."""
    z = _mix((ids + 1) * _GOLDEN_S + keys)
    u = (_shr(z, 11).double() + 0.5) * 2.0 ** -53
    return pointwise(lambda t: -torch.log(-torch.log(t)), u)


def keyed_gumbel(seed: int, pos: int, ids) -> torch.Tensor:
    """Gumbel noise G(seed, pos, x) for each token id x in ``ids`` (an int: the whole vocabulary
    ``range(ids)``), float64 on CPU. Token x's value does not depend on which other ids are asked
    for: it is the splitmix64 stream of the position key at counter x + 1."""
    if isinstance(ids, numbers.Integral):
        x = torch.arange(int(ids), dtype=torch.long)
    else:
        x = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    return gumbel_of_keys(position_keys(torch.tensor(_signed(int(seed))),
                                        torch.tensor(_signed(int(pos)))), x)


def keyed_choice(scores: torch.Tensor, seed: int, pos: int) -> int:
    """argmax_x(scores[x] + G(seed, pos, x)) over one row of log-probabilities (up to a constant;
    -inf: impossible). An exact sample from softmax(scores), a function of (seed, pos) only.
    Never raises on the content of ``scores`` (all -inf or NaN picks some token)."""
    scores = scores.reshape(-1)
    vocab = scores.shape[0]
    support = torch.nonzero(scores > float("-inf")).flatten()
    n = int(support.numel())
    if 0 < n <= vocab // 4:  # a top-k / top-p support: noise for those ids only, same values
        ids = support.cpu()
        noisy = scores[support].double() + keyed_gumbel(seed, pos, ids).to(scores.device)
        return int(ids[int(torch.argmax(noisy))])
    noisy = scores.double() + keyed_gumbel(seed, pos, vocab).to(scores.device)
    return int(torch.argmax(noisy))


def with_session_seed(params: SamplingParams) -> SamplingParams:
    """``params`` with a random 63-bit seed when it samples without one; greedy or seeded
    params unchanged. The engine calls it once per session, so every position's randomness is
    fixed for the session and every drafter of it can use the same noise."""
    if params.greedy or params.seed is not None:
        return params
    return dataclasses.replace(params, seed=secrets.randbits(63))


def _seed_of(params: SamplingParams) -> int:
    # Unseeded sampling params should have gone through with_session_seed; a fresh random seed
    # per call keeps the output exact (the noise is independent of the draft), not reproducible.
    return params.seed if params.seed is not None else secrets.randbits(63)


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
    """FLy's lossy verification of one row (``edgespec.loose_verify``). logits: [T+1, V] raw
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
    seed, picked = _seed_of(params), {}

    def choice_at(i: int) -> int:
        if i not in picked:
            picked[i] = keyed_choice(scores[i], seed, start + i)
        return picked[i]

    return accept_loosely(draft, choice_at, lambda i: entropy(scores[i]),
                          lambda i, x: plausible(scores[i], x), loose)
