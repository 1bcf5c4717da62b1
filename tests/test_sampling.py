"""Verification maths on synthetic logits: greedy cases and statistical losslessness."""

import pytest
import torch

from edgespec.config import ConfigError, SamplingParams
from edgespec.sampling import (SparseQ, make_generator, process_logits, sample_sparse,
                               verify_batch, verify_greedy, verify_sampling)


def test_greedy_full_accept_gives_bonus_token():
    assert verify_greedy([5, 6, 7, 9], [5, 6, 7]) == (3, 9)


def test_greedy_first_token_rejected_gives_correction():
    assert verify_greedy([4, 6, 7], [5, 6]) == (0, 4)


def test_greedy_middle_rejection_stops_there():
    assert verify_greedy([5, 1, 7, 8], [5, 6, 7]) == (1, 1)


def test_greedy_empty_draft_is_plain_decoding():
    assert verify_greedy([3], []) == (0, 3)


def test_verify_batch_ragged_rows_use_only_their_own_positions():
    V = 10
    logits = torch.full((3, 4, V), -5.0)
    # row 0: draft [1, 2, 3] fully accepted, bonus 4
    for t, tok in enumerate([1, 2, 3, 4]):
        logits[0, t, tok] = 5
    # row 1: draft [7], rejected: target says 8; its padding positions say 9 (must be ignored)
    logits[1, 0, 8] = 5
    logits[1, 1:, 9] = 5
    # row 2: empty draft
    logits[2, 0, 6] = 5
    logits[2, 1:, 0] = 5
    greedy = SamplingParams()
    out = verify_batch(logits, [[1, 2, 3], [7], []], [None] * 3, [greedy] * 3, [None] * 3)
    assert out == [(3, 4), (0, 8), (0, 6)]


def test_process_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]))
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]))
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.9))
    assert torch.allclose(p[0, :3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)
    cold = process_logits(logits, SamplingParams(temperature=0.1))
    assert cold[0, 0] > 0.99


def test_sampling_params_are_validated():
    with pytest.raises(ConfigError):
        SamplingParams(temperature=-1)
    with pytest.raises(ConfigError):
        SamplingParams(top_p=0)
    with pytest.raises(ConfigError):
        SamplingParams(top_k=-2)


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def _first_token_counts(p, draft, q, n, seed=0):
    g = make_generator(seed)
    counts = torch.zeros(p.shape[-1])
    for _ in range(n):
        k, tok = verify_sampling(p, draft, q, g)
        first = draft[0] if k > 0 else tok
        counts[first] += 1
    return counts


DRAWS = 6000


@pytest.mark.parametrize("draft_token", [0, 2, 5])
def test_deterministic_draft_first_token_follows_target(draft_token):
    torch.manual_seed(1)
    p = process_logits(torch.randn(3, 6) * 1.5, SamplingParams(temperature=0.8, top_k=5))
    counts = _first_token_counts(p, [draft_token, 1], None, DRAWS)
    assert _tv(counts, p[0]) < 0.03
    assert counts[p[0] == 0].sum() == 0  # never a token the target's filters removed


def test_model_draft_with_sparse_q_first_token_follows_target():
    torch.manual_seed(2)
    V = 6
    p = process_logits(torch.randn(2, V) * 1.5, SamplingParams(temperature=1.0, top_p=0.95))
    q_logits = torch.randn(V) * 2
    g = make_generator(7)
    counts = torch.zeros(V)
    vg = make_generator(8)
    for _ in range(DRAWS):
        x, q = sample_sparse(q_logits, SamplingParams(temperature=1.0), 3, g)
        assert len(q.ids) == 3 and abs(sum(q.probs) - 1) < 1e-5
        k, tok = verify_sampling(p, [x], [q], vg)
        counts[x if k else tok] += 1
    assert _tv(counts, p[0]) < 0.03


def test_bonus_token_follows_target_after_full_accept():
    V = 5
    p = torch.zeros(2, V)
    p[0, 3] = 1.0  # the draft token is certain: always accepted
    p[1] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    g = make_generator(3)
    counts = torch.zeros(V)
    for _ in range(DRAWS):
        k, tok = verify_sampling(p, [3], None, g)
        assert k == 1
        counts[tok] += 1
    assert _tv(counts, p[1]) < 0.03


def test_statistical_check_detects_a_biased_sampler():
    """The TV threshold above is tight enough to catch a wrong rule (accept-always)."""
    torch.manual_seed(1)
    p = process_logits(torch.randn(2, 6) * 1.5, SamplingParams(temperature=0.8))
    biased = torch.zeros(6)
    biased[2] = DRAWS  # what accept-always would emit for draft token 2
    assert _tv(biased, p[0]) > 0.03
    q = SparseQ([2], [1.0])
    assert torch.equal(q.dense(6), torch.tensor([0, 0, 1.0, 0, 0, 0]))
