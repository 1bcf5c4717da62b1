"""A drafter's token choice in NumPy (``edgespec.drafters.token_choice``) against the verifier's
torch maths (tests/oracles.py, held to ``edgespec.verify.verify_step``): the same noise integers,
the same processed distribution, and so the target's own token wherever the drafter's
distribution is the target's."""

import numpy as np
import pytest
import torch

from edgespec.config import SamplingParams
from edgespec.drafters.token_choice import (choose_token, keyed_noise, position_key,
                                            processed_scores, softmax, top_tokens)
from reference import process_logits, sample_at

from edgespec.verify.keyed_noise import keyed_gumbel
from edgespec.verify.keyed_noise import position_key as torch_position_key
from oracles import filtered_logits


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**62 + 7, 2**63 - 1])
def test_position_keys_are_the_verifiers(seed):
    for pos in (0, 1, 17, 4095, 10**9):
        assert int(position_key(seed, pos)) == torch_position_key(seed, pos)


def test_noise_is_the_verifiers_to_the_last_bits():
    for seed, pos in ((3, 0), (99, 41), (2**61, 7)):
        ours, theirs = keyed_noise(seed, pos, 5000), keyed_gumbel(seed, pos, 5000).numpy()
        np.testing.assert_allclose(ours, theirs, rtol=1e-13, atol=0)
        assert int(np.argmax(ours)) == int(np.argmax(theirs))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.0, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.8),
                                    SamplingParams(temperature=0.9, top_k=20, top_p=0.9)])
def test_processed_distribution_is_the_targets(params):
    logits = torch.randn(200, generator=torch.Generator().manual_seed(4)) * 3
    ours = softmax(processed_scores(logits.numpy(), params))
    theirs = process_logits(logits[None], params)[0].double().numpy()
    assert ((ours > 0) == (theirs > 0)).all()  # the same support
    np.testing.assert_allclose(ours, theirs, atol=1e-6)
    kept = np.isfinite(processed_scores(logits.numpy(), params))
    assert (kept == torch.isfinite(filtered_logits(logits[None], params)[0]).numpy()).all()


def test_a_drafter_with_the_targets_distribution_draws_the_targets_token():
    gen = torch.Generator().manual_seed(2)
    agree = 0
    for seed in range(200):
        logits = torch.randn(300, generator=gen) * 2
        params = SamplingParams(0.9, top_p=0.95, seed=seed)
        token, conf, probs = choose_token(logits.numpy(), params, seed + 3)
        assert token == sample_at(logits, params, seed + 3)
        assert probs[token] > 0 and probs.max() <= conf <= 1
        close = logits + torch.randn(300, generator=gen) * 0.05
        agree += choose_token(close.numpy(), params, seed + 3)[0] == token
    assert agree >= 150  # nearby distributions mostly draw the same token


def test_greedy_is_the_argmax_and_broken_logits_never_raise():
    logits = np.array([0.1, 3.0, -1.0, 2.9], dtype=np.float32)
    token, conf, probs = choose_token(logits, SamplingParams(), 0)
    assert token == 1 and conf == pytest.approx(float(probs[1])) and probs.sum() == pytest.approx(1)
    for bad in (np.full(6, np.nan), np.full(6, -np.inf)):
        for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=1)):
            token, conf, _ = choose_token(bad, params, 0)
            assert 0 <= token < 6 and conf == 0.0


def test_top_tokens_most_likely_first():
    assert top_tokens(np.array([0.1, 0.5, 0.05, 0.35]), 3) == [(1, 0.5), (3, 0.35), (0, 0.1)]
