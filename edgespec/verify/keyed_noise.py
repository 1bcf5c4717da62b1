"""Position-keyed randomness: the Gumbel noise G(seed, pos, x) that sampled verification and
sampling drafters use (``edgespec.verify.verify_step``: the token at absolute position ``pos`` is
``argmax_x(log p(x) + G(seed, pos, x))``).

The noise is a counter-based hash (splitmix64), not a stateful generator: the value for token x
depends on (seed, pos, x) alone, so it is the same on every process, platform and torch version,
and can be computed for a few token ids (a drafter's top-k) or the whole vocabulary alike. It is
computed in int64 tensor ops on the device (``position_keys``, ``gumbel_of_keys``); the
NumPy drafters' twin is ``edgespec.drafters.token_choice``.
"""

from __future__ import annotations

import dataclasses
import numbers
import secrets

import numpy as np
import torch

from ..runner.attention import pointwise
from ..config import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


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


def seed_after(seed: int, i: int) -> int:
    """The seed ``i`` places after ``seed`` (several draws from one seed: an HTTP request's
    ``n`` choices), wrapped into the signed 64 bits a seed is."""
    return _signed(seed + i)


def seed_of(params: SamplingParams) -> int:
    """The seed a position's noise is keyed by."""
    # Unseeded sampling params should have gone through with_session_seed; a fresh random seed
    # per call keeps the output exact (the noise is independent of the draft), not reproducible.
    return params.seed if params.seed is not None else secrets.randbits(63)
