"""Verification maths on synthetic logits: greedy cases, position-keyed sampling (reproducible
whatever the chunking) and its statistical losslessness."""

import math
import random

import pytest
import torch

from edgespec.config import ConfigError, SamplingParams
from reference import process_logits, sample_at

from edgespec.verify.keyed_noise import keyed_choice, keyed_gumbel, position_key, with_session_seed
from oracles import verify_greedy
from oracles import verify_batch


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
    out = verify_batch(logits, [[1, 2, 3], [7], []], [greedy] * 3, [5, 9, 0])
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
    for temperature in (-1, float("inf"), float("nan")):  # inf: every token as likely
        with pytest.raises(ConfigError):
            SamplingParams(temperature=temperature)
    with pytest.raises(ConfigError):
        SamplingParams(top_p=0)
    with pytest.raises(ConfigError):
        SamplingParams(top_k=-2)


class _OlderSamplingParams:
    """What an older version's ``SamplingParams`` pickled as (its ``greedy`` and
    ``adjusts_logits`` were properties, so its state held the fields alone, and the older
    still had no penalties): unpickled by this version's class."""

    def __init__(self, **state):
        self.state = state

    def __reduce__(self):
        import copyreg

        return copyreg._reconstructor, (SamplingParams, object, None), self.state


@pytest.mark.parametrize("state, greedy, adjusts", [
    ({"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None}, True, False),
    ({"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3, "presence_penalty": 0.5,
      "frequency_penalty": 0.0, "logit_bias": ()}, False, True),
    # a sender that pickled the derived attributes with the fields, and wrong ones
    ({"temperature": 0.7, "top_k": 0, "top_p": 1.0, "seed": None, "greedy": True,
      "adjusts_logits": True}, False, False),
], ids=["older", "with-penalty", "stale-attributes"])
def test_sampling_params_from_another_versions_pickle_derive_their_attributes(state, greedy,
                                                                              adjusts):
    """A replica of a Ray cluster upgraded one at a time receives another version's pickled
    ``SamplingParams``: the attributes derived from the fields (``greedy``,
    ``adjusts_logits``), read every step, are made from the fields on arrival, a field the
    sender lacked takes its default, and the value equals one made here."""
    import pickle

    got = pickle.loads(pickle.dumps(_OlderSamplingParams(**state)))
    assert isinstance(got, SamplingParams)
    assert (got.greedy, got.adjusts_logits) == (greedy, adjusts)
    fields_only = {k: v for k, v in state.items() if k not in ("greedy", "adjusts_logits")}
    assert got == SamplingParams(**fields_only) and hash(got) == hash(SamplingParams(**fields_only))
    assert pickle.loads(pickle.dumps(got)) == got  # and this version's own pickle
    # which carries the derived attributes too, for a receiver that keeps them as it reads them
    sent = got.__getstate__()
    assert (sent["greedy"], sent["adjusts_logits"]) == (greedy, adjusts)
    assert set(sent) - {"greedy", "adjusts_logits"} == {
        "temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty",
        "logit_bias"}


def test_with_session_seed_fixes_a_seed_only_for_unseeded_sampling():
    greedy, seeded = SamplingParams(), SamplingParams(temperature=1.0, seed=9)
    assert with_session_seed(greedy) is greedy and with_session_seed(seeded) is seeded
    a, b = (with_session_seed(SamplingParams(temperature=0.7, top_k=3)) for _ in range(2))
    assert isinstance(a.seed, int) and 0 <= a.seed < 2 ** 63 and a.seed != b.seed
    assert (a.temperature, a.top_k, a.top_p) == (0.7, 3, 1.0)


# -- position-keyed noise -------------------------------------------------------------------------

def test_keyed_noise_is_pinned_stable_and_a_function_of_seed_position_and_token():
    """Pinned values: drafters on other machines and versions must draw the very same noise."""
    assert position_key(0, 0) == 12035550249420947055
    assert position_key(42, 7) == 1587005860896957696
    assert position_key(-1, 2 ** 40) == 3964308327926799581
    assert keyed_gumbel(42, 7, [0, 5, 49151]).tolist() == pytest.approx(
        [-0.08966534352075368, 0.8431986577924515, -0.5929536877942376], abs=1e-12)
    full = keyed_gumbel(42, 7, 49152)
    assert torch.equal(full[[0, 5, 49151]], keyed_gumbel(42, 7, [0, 5, 49151]))
    assert not torch.equal(full, keyed_gumbel(42, 8, 49152))
    assert not torch.equal(full, keyed_gumbel(43, 7, 49152))


def test_keyed_noise_is_gumbel_and_uncorrelated_across_positions_and_seeds():
    g = keyed_gumbel(5, 100, 200_000)
    assert abs(float(g.mean()) - 0.5772157) < 0.01  # Euler-Mascheroni
    assert abs(float(g.var()) - math.pi ** 2 / 6) < 0.03
    for other in (keyed_gumbel(5, 101, 200_000), keyed_gumbel(6, 100, 200_000)):
        assert abs(float(torch.corrcoef(torch.stack([g, other]))[0, 1])) < 0.01


# -- (a) reproducible whatever the chunking -------------------------------------------------------

L, START = 40, 10


@pytest.fixture(scope="module")
def table():
    """Logits of absolute positions START .. START + L (prefix-independent, for the test)."""
    torch.manual_seed(0)
    return torch.randn(L + 1, 12) * 2


def _decode(table, params, drafter):
    """Speculative decoding of L positions: drafter(i) proposes the tokens from offset i on."""
    out: list[int] = []
    while len(out) < L:
        i = len(out)
        draft = list(drafter(i))[: L - i]
        rows = table[i: i + len(draft) + 1]
        pad = torch.randn(3, rows.shape[1])  # padding rows must be ignored
        (n, tok), = verify_batch(torch.cat([rows, pad])[None], [draft], [params], [START + i])
        out += draft[:n] + [tok]
    return out[:L]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=1234),
                                   SamplingParams(temperature=0.7, top_k=8, top_p=0.9, seed=7)])
def test_keyed_sampling_is_the_same_whatever_the_drafts(table, params):
    ref = [sample_at(table[i], params, START + i) for i in range(L)]
    assert _decode(table, params, lambda i: []) == ref  # target-only through verify_batch
    rng = random.Random(0)

    def noisy(i):  # the right tokens with some wrong ones mixed in, ragged chunks
        return [t if rng.random() < 0.7 else rng.randrange(12)
                for t in ref[i: i + rng.randint(1, 6)]]

    drafters = [lambda i, c=c: ref[i: i + c] for c in (1, 2, 3, 5, 8)]
    drafters += [noisy, lambda i: [rng.randrange(12) for _ in range(4)], lambda i: [99, -1]]
    for drafter in drafters:
        assert _decode(table, params, drafter) == ref
    assert len(set(ref)) > 3  # really sampled, not a constant
    other = [sample_at(table[i], SamplingParams(temperature=1.0, seed=1235), START + i)
             for i in range(L)]
    assert other != ref


def test_batched_rows_are_verified_independently(table):
    params = SamplingParams(temperature=1.0, seed=3)
    ref = [sample_at(table[i], params, START + i) for i in range(L)]
    drafts = [ref[0:4], [ref[5], 99], [], ref[9:11] + [ref[12]]]
    starts = [START, START + 5, START + 7, START + 9]
    logits = torch.randn(len(drafts), 5, 12)
    for b, (d, s) in enumerate(zip(drafts, starts)):
        logits[b, : len(d) + 1] = table[s - START: s - START + len(d) + 1]
    greedy = SamplingParams()
    out = verify_batch(logits, drafts, [params, params, greedy, params], starts)
    assert out[0] == (4, ref[4])
    assert out[1] == (1, ref[6])
    assert out[2] == (0, int(table[7].argmax()))
    assert out[3] == ((2, ref[11]) if ref[11] != ref[12] else (3, ref[12]))


def test_a_broken_row_costs_only_that_row(table):
    """Draft ids are checked where drafts enter (the stores: tests/test_store_contract.py); a
    row whose logits are broken (NaN) still decides, and the other rows are untouched."""
    params = SamplingParams(temperature=1.0, seed=11)
    expect = sample_at(table[0], params, START)
    wrong = (expect + 1) % 12
    logits = table[:2].expand(3, 2, 12).clone()
    logits[-1] = float("nan")
    out = verify_batch(logits, [[wrong], [expect], [1]], [params] * 3, [START] * 3)
    assert out[0] == (0, expect)
    assert out[1] == (1, sample_at(table[1], params, START + 1))
    assert 0 <= out[2][1] < 12


def test_unseeded_params_still_sample_from_the_support():
    p = SamplingParams(temperature=1.0, top_k=2)
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]])
    assert {verify_batch(logits[None], [[]], [p], [0])[0][1] for _ in range(40)} == {1, 2}


# -- (b) statistical exactness --------------------------------------------------------------------

def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


DRAWS = 4000  # seeds 0 .. DRAWS - 1: deterministic, no flakiness
TV_MAX = 0.03  # a fair sampler's TV over 6 tokens at 4000 draws is ~0.01
CASES = [SamplingParams(temperature=0.8, top_k=5), SamplingParams(temperature=1.0, top_p=0.8),
         SamplingParams(temperature=1.6), SamplingParams(temperature=0.5, top_k=4, top_p=0.9)]


def _first_token_counts(logits, params, draft, pos=17):
    """One row per seed, all in one batch: a row's verdict depends on its own logits, seed and
    position only (test_batched_rows_are_verified_independently), so this counts what DRAWS
    one-row calls would, in a fraction of the time."""
    V = logits.shape[-1]
    counts = torch.zeros(V)
    seeds = range(DRAWS)
    out = verify_batch(logits.expand(DRAWS, *logits.shape), [draft] * DRAWS,
                       [SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed)
                        for seed in seeds], [pos + seed % 5 for seed in seeds])
    for k, tok in out:
        counts[draft[0] if k else tok] += 1
    return counts


@pytest.mark.slow  # 16 statistical cases; test_bonus_token_follows... keeps one in the fast tier
@pytest.mark.parametrize("params", CASES, ids=["top_k", "top_p", "hot", "all"])
@pytest.mark.parametrize("draft", [[], [0, 1], [2, 4], [5]], ids=["none", "d0", "d2", "d5"])
def test_first_token_follows_the_processed_target(params, draft):
    torch.manual_seed(1)
    logits = torch.randn(3, 6) * 1.5
    p = process_logits(logits[:1], params)[0]
    counts = _first_token_counts(logits, params, draft)
    assert _tv(counts, p) < TV_MAX
    assert counts[p == 0].sum() == 0  # never a token the target's filters removed
    if draft and p[draft[0]] > 0:  # a one-hot draft is accepted with probability p(x)
        assert abs(float(counts[draft[0]]) / DRAWS - float(p[draft[0]])) < 0.025


def test_bonus_token_follows_target_after_full_accept():
    logits = torch.full((2, 5), float("-inf"))
    logits[0, 3] = 0.0  # the draft token is certain: always accepted
    logits[1] = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25]))
    counts = torch.zeros(5)
    out = verify_batch(logits.expand(DRAWS, *logits.shape), [[3]] * DRAWS,
                       [SamplingParams(1.0, seed=seed) for seed in range(DRAWS)], [50] * DRAWS)
    for k, tok in out:
        assert k == 1
        counts[tok] += 1
    assert _tv(counts, logits[1].exp()) < TV_MAX


def test_positions_of_one_seed_are_independent():
    """The joint of two consecutive positions is the product of their marginals."""
    torch.manual_seed(4)
    logits = torch.randn(2, 4)
    params = SamplingParams(temperature=1.0)
    p = process_logits(logits, params)
    joint = torch.zeros(4, 4)
    for seed in range(DRAWS):
        sp = SamplingParams(1.0, seed=seed)
        joint[sample_at(logits[0], sp, 30), sample_at(logits[1], sp, 31)] += 1
    assert _tv(joint.flatten(), (p[0][:, None] * p[1][None]).flatten()) < 0.04


def test_statistical_check_detects_a_biased_sampler():
    """The TV threshold above is tight enough to catch a wrong rule (accept-always)."""
    torch.manual_seed(1)
    p = process_logits(torch.randn(2, 6) * 1.5, SamplingParams(temperature=0.8))
    biased = torch.zeros(6)
    biased[2] = DRAWS  # what accept-always would emit for draft token 2
    assert _tv(biased, p[0]) > TV_MAX


def test_keyed_choice_on_a_small_support_equals_the_full_vocabulary():
    scores = torch.full((1000,), float("-inf"))
    scores[[3, 500, 999]] = torch.tensor([0.1, 0.5, -0.2])
    for pos in range(50):
        full = int(torch.argmax(scores.double() + keyed_gumbel(8, pos, 1000)))
        assert keyed_choice(scores, 8, pos) == full
