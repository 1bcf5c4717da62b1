"""How a language-model drafter picks its next token from its logits, in NumPy (no torch).

The drafters that draft from their own logits (the torch model drafter, llama.cpp's) choose each
token here: the argmax when greedy, else the session's keyed sample ``argmax_x(log q(x) +
G(seed, pos, x))`` over the drafter's processed distribution q, with the Gumbel noise the verifier
samples the target with (``edgespec.verify.keyed_noise``: splitmix64 of the position key at counter
x + 1). Using the same noise makes a drafted token the target's own sample wherever q and the
target's p agree there (per token, about 1 - TV(p, q)).

The noise integers are the verifier's bit for bit (tests/test_token_choice.py checks them against
``edgespec.verify.keyed_noise.position_keys``/``gumbel_of_keys``); its floating-point logarithms may
differ in the last bit, which can change a drafted token only where two candidates tie to 1e-16. A
draft is a proposal to keyed verification, so that never changes the output.

Kept in NumPy so that a board running the llama.cpp drafter needs no torch.
"""

from __future__ import annotations

import secrets

import numpy as np

from ..config import SamplingParams

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (products wrap modulo 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def position_key(seed: int, pos: int) -> np.uint64:
    """splitmix64(splitmix64(seed) ^ pos): the key of absolute position ``pos``."""
    with np.errstate(over="ignore"):
        s = np.array([int(seed) & (2**64 - 1)], dtype=np.uint64)
        p = np.array([int(pos) & (2**64 - 1)], dtype=np.uint64)
        return _mix((_mix(s + _GOLDEN) ^ p) + _GOLDEN)[0]


def keyed_noise(seed: int, pos: int, vocab: int) -> np.ndarray:
    """Gumbel noise G(seed, pos, x) = -log(-log(u)) for every token x < vocab: float64 [vocab]."""
    key = position_key(seed, pos)
    with np.errstate(over="ignore"):
        ids = np.arange(1, vocab + 1, dtype=np.uint64)
        z = _mix(ids * _GOLDEN + key)
    u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53
    return -np.log(-np.log(u))


def processed_scores(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """log q up to a constant: temperature-scaled logits [V] with the tokens top-k and top-p
    remove at -inf (float64 [V]), the target's rules (``target_choice.filter_scores``)."""
    scores = np.asarray(logits, dtype=np.float64).reshape(-1) / max(params.temperature, 1e-5)
    if params.top_k and params.top_k < scores.shape[0]:
        kth = np.partition(scores, -params.top_k)[-params.top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    if params.top_p < 1.0:
        ranked = -np.sort(-scores)
        probs = softmax(ranked)
        before = np.cumsum(probs) - probs  # the mass ranked ahead of each position
        # a token goes when the tokens scored strictly above it hold top_p; ties go together
        new_run = np.concatenate([[True], ranked[1:] != ranked[:-1]])
        run_start = np.maximum.accumulate(np.where(new_run, np.arange(len(ranked)), 0))
        kept = int((before[run_start] < params.top_p).sum())
        scores = np.where(scores < ranked[max(kept - 1, 0)], -np.inf, scores)
    return scores


def softmax(scores: np.ndarray) -> np.ndarray:
    """Probabilities of float scores [V] (-inf: 0); all -inf or NaN gives all zeros."""
    top = np.max(scores) if scores.size else 0.0
    if not np.isfinite(top):
        return np.zeros_like(scores, dtype=np.float64)
    e = np.exp(scores - top)
    return e / e.sum()


def choose_token(logits, params: SamplingParams, pos: int) -> tuple[int, float, np.ndarray]:
    """A drafter's token at absolute position ``pos`` from its logits [V] (any array), its
    confidence (greedy: the top probability; sampling: ``_sampled_confidence``), and the
    probabilities [V] it chose from (greedy: the softmax of the logits; sampling: the processed
    distribution)."""
    raw = np.asarray(logits, dtype=np.float64).reshape(-1)
    if params.greedy:
        probs = softmax(raw)
        return int(np.argmax(raw)), float(probs.max(initial=0.0)), probs
    scores = processed_scores(raw, params)
    probs = softmax(scores)
    # unseeded params should have gone through keyed_noise.with_session_seed; a fresh seed per
    # call still gives a valid proposal
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    noisy = scores + keyed_noise(seed, pos, scores.shape[0])
    token = int(np.argmax(np.nan_to_num(noisy, nan=-np.inf)))
    return token, _sampled_confidence(probs, token), probs


CONFIDENCE_TOP = 8  # a sampled token's confidence looks at this many of the likeliest tokens


def _sampled_confidence(probs: np.ndarray, token: int) -> float:
    """The top probability renormalised over the ``CONFIDENCE_TOP`` likeliest tokens (the
    sampled token taking the last place when it is not among them): a flat tail does not make a
    sampling drafter stop, while a close race at the top does."""
    top = np.sort(probs)[-CONFIDENCE_TOP:]
    if top.size == 0 or top[-1] <= 0:
        return 0.0
    mass = top.sum() if probs[token] >= top[0] else top[1:].sum() + probs[token]
    return float(top[-1] / mass)


def top_tokens(probs: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens under probs [V] as (id, probability), most likely first."""
    n = min(n, probs.shape[0])
    idx = np.argpartition(-probs, n - 1)[:n]
    idx = idx[np.argsort(-probs[idx], kind="stable")]
    return [(int(i), float(probs[i])) for i in idx]
