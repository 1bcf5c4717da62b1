"""Presence and frequency penalties and logit bias (``SamplingParams``, applied by
``edgespec.verify.logit_adjust``): target-only decoding with them is transformers' forward with
the penalties applied by hand, and drafted decoding (chains, trees, keyed sampling, batched beside
sessions without them, decode steps run ahead) is that target-only decoding token for token."""

import numpy as np
import pytest
import torch
from reference import sample_at
from tree_oracle import OracleTreeDrafter

from edgespec.config import MAX_LOGIT_BIAS, ConfigError, EngineConfig, SamplingParams
from edgespec.drafters import build_drafter
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.runner.target_runner import TargetRunner
from edgespec.verify.logit_adjust import row_entries

PROMPTS = [
    [1, 10, 11, 12, 13, 10, 11, 12, 13, 10],
    [1, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61],
    [1, 30, 31, 30, 31, 30],
]
FIXED = dict(max_draft=4, window=8, chunk=2, adaptive=False, draft_wait_ms=5000)
N = 32
PENALISED = SamplingParams(presence_penalty=0.6, frequency_penalty=1.5,
                           logit_bias={3: 2.5, 7: -100})


@pytest.fixture(scope="module")
def runner(tiny):
    return TargetRunner(tiny.model, n_slots=8, max_len=256)


def run(runner, drafter, params, cfg=None, prompts=PROMPTS, n=N):
    with SpecEngine(runner, drafter, cfg or EngineConfig(**FIXED), stop_ids={2}) as engine:
        return engine.generate_many([Request(p, n, params) for p in prompts])


def hf_adjusted(model, prompt, n, params, eos=2):
    """Target-only decoding with transformers' forward, the penalties and bias applied here,
    in float64 from the counts of the output so far (an independent statement of the rule)."""
    seq, out = list(prompt), []
    bias = dict(params.logit_bias)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1].double()
            for t in set(out) | set(bias):
                c = out.count(t)
                logits[t] += bias.get(t, 0.0) - params.frequency_penalty * c - \
                    params.presence_penalty * (c > 0)
            tok = sample_at(logits.float(), params, len(seq))
            seq.append(tok)
            out.append(tok)
            if tok == eos:
                break
    return out


@pytest.fixture(scope="module")
def target_only(runner):
    return run(runner, None, PENALISED)


def test_target_only_with_penalties_is_the_models_penalised_decoding(tiny, runner, target_only):
    plain = run(runner, None, SamplingParams())
    changed = 0
    for prompt, res, p in zip(PROMPTS, target_only, plain):
        assert res.token_ids == hf_adjusted(tiny.model, prompt, N, PENALISED)
        assert 7 not in res.token_ids  # biased out
        changed += res.token_ids != p.token_ids
    assert changed  # the penalties moved the output


def test_a_large_bias_forces_its_token(runner):
    [res] = run(runner, None, SamplingParams(logit_bias={42: 100}), prompts=PROMPTS[:1], n=6)
    assert res.token_ids == [42] * 6


# penalties that discourage repeating leave MaG (which copies) little to draft; one that
# encourages it gives its drafts a chance
REPEATING = SamplingParams(presence_penalty=-2, frequency_penalty=0.5, logit_bias={3: 2.5})


@pytest.mark.parametrize("spec, params", [("mag", REPEATING), ("layers:2", PENALISED)])
def test_drafted_output_with_penalties_is_target_only(tiny, runner, spec, params):
    drafter = build_drafter(spec, tiny, runner, n_slots=4, max_len=256)
    if hasattr(drafter, "min_confidence"):
        drafter.min_confidence = 0.0  # draft every time: exercise rejections
    alone = run(runner, None, params)
    got = run(runner, drafter, params)
    assert sum(r.stats.accepted_tokens for r in got) > 0  # drafts were verified and kept
    assert sum(r.stats.draft_tokens - r.stats.accepted_tokens for r in got) > 0  # and rejected
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]


def test_tree_drafted_output_with_penalties_is_target_only(runner, target_only):
    """Branches read their own paths' counts: an oracle tree drafter holds the right
    continuation on some branch, so paths off the chain are accepted."""
    refs = {tuple(p): r.token_ids for p, r in zip(PROMPTS, target_only)}
    drafter = OracleTreeDrafter(refs, runner.vocab_size, seed=3)
    got = run(runner, drafter, PENALISED, cfg=EngineConfig(adaptive=False, draft_wait_ms=5000,
                                                            tree_width=3))
    assert sum(r.stats.branch_tokens for r in got) > 0  # branches were taken
    assert [r.token_ids for r in got] == [r.token_ids for r in target_only]


def test_sampled_output_with_penalties_is_target_only_and_the_models(tiny, runner):
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=5,
                            presence_penalty=-0.5, frequency_penalty=0.7, logit_bias={9: 3})
    alone = run(runner, None, params)
    drafted = run(runner, build_drafter("mag", tiny, runner), params)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in alone]
    for prompt, res in zip(PROMPTS, alone):
        assert res.token_ids == hf_adjusted(tiny.model, prompt, N, params)


def test_sessions_with_and_without_penalties_share_a_batch(tiny, runner, target_only):
    plain = run(runner, None, SamplingParams())
    with SpecEngine(runner, build_drafter("mag", tiny, runner), EngineConfig(**FIXED),
                    stop_ids={2}) as engine:
        got = engine.generate_many([Request(PROMPTS[0], N, PENALISED),
                                    Request(PROMPTS[1], N),
                                    Request(PROMPTS[2], N, PENALISED)])
    assert got[0].token_ids == target_only[0].token_ids
    assert got[1].token_ids == plain[1].token_ids
    assert got[2].token_ids == target_only[2].token_ids


def test_a_resumed_session_counts_its_committed_output(runner, target_only):
    """Tokens a session had committed before it was re-created (``Request.committed``) are
    output: its continuation penalises them as target-only decoding did."""
    full = target_only[0].token_ids
    with SpecEngine(runner, None, EngineConfig(**FIXED), stop_ids={2}) as engine:
        res = engine.generate(Request(PROMPTS[0], N, PENALISED, committed=full[:10]))
    assert res.token_ids == full  # the committed ones, then the continuation


def test_decode_steps_run_ahead_only_without_a_session_that_adjusts(runner, target_only):
    plain = run(runner, None, SamplingParams())
    with SpecEngine(runner, None, EngineConfig(decode_ahead=True), stop_ids={2}) as engine:
        got = engine.generate_many([Request(PROMPTS[0], 8, PENALISED),
                                    Request(PROMPTS[1], N), Request(PROMPTS[2], N)])
        launched = engine.ahead.launched
    assert launched > 0  # after the session that adjusts ended
    assert got[0].token_ids == target_only[0].token_ids[:8]
    assert [r.token_ids for r in got[1:]] == [r.token_ids for r in plain[1:]]


def brute_entries(output, tokens, parents, params):
    """Each column's deltas from its path's counts, token by token (the rule as stated)."""
    bias = dict(params.logit_bias)
    out = {}
    for col in range(len(tokens) + 1):
        path, node = [], col - 1
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        seen = list(output) + path
        for t in set(seen) | set(bias):
            c = seen.count(t)
            d = np.float32(bias.get(t, 0.0)) - np.float32(params.frequency_penalty) * \
                np.float32(c) - np.float32(params.presence_penalty) * np.float32(c > 0)
            if d != 0:
                out[(col, t)] = d
    return out


@pytest.mark.parametrize("params", [PENALISED, SamplingParams(logit_bias={5: 1, 6: 0}),
                                    SamplingParams(frequency_penalty=0.25)])
def test_row_entries_follow_each_columns_path(params):
    output = [4, 5, 4, 9]
    tokens, parents = [5, 4, 8, 5, 3], [-1, 0, 1, 0, 3]  # a chain of 3 and a branch off node 0
    cols, ids, vals = row_entries(output, tokens, parents, params)
    got = {(int(c), int(t)): v for c, t, v in zip(cols, ids, vals)}
    assert len(got) == len(cols)  # unique (column, token)
    assert got == brute_entries(output, tokens, parents, params)
    assert vals.dtype == np.float32


@pytest.mark.parametrize("kwargs, match", [
    (dict(presence_penalty=2.5), "presence_penalty must be a number in"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be a number in"),
    (dict(frequency_penalty=True), "frequency_penalty must be a number in"),
    (dict(logit_bias={3: 101}), "the bias of token 3 must be a number"),
    (dict(logit_bias={-1: 1}), "a token id must be an integer"),
    (dict(logit_bias={"3": 1}), "a token id must be an integer"),
    (dict(logit_bias=[(3, 1), (3, 2)]), "token 3 is given twice"),
    (dict(logit_bias=5), "must map token ids to biases"),
    (dict(presence_penalty=10 ** 400), "presence_penalty must be a number in"),  # past a float
    (dict(logit_bias={5: 10 ** 400}), "the bias of token 5 must be a number"),
    (dict(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS + 1)}), "at most 300 tokens"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**kwargs)


def test_a_bias_past_the_vocabulary_is_refused_by_the_engine(runner):
    with SpecEngine(runner, None, EngineConfig(), stop_ids={2}) as engine:
        with pytest.raises(ConfigError, match="logit_bias token ids must be in"):
            engine.add(Request(PROMPTS[0], 4, SamplingParams(logit_bias={runner.vocab_size: 1})))


def test_settings_are_normalised():
    p = SamplingParams(presence_penalty=1, logit_bias={7: 1, 3: -2})
    assert p.presence_penalty == 1.0 and isinstance(p.presence_penalty, float)
    assert p.logit_bias == ((3, -2.0), (7, 1.0)) and p.adjusts_logits
    assert SamplingParams(logit_bias=[[7, 1], [3, -2]]) == p.__class__(
        logit_bias=((3, -2.0), (7, 1.0)))
    assert not SamplingParams().adjusts_logits


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_with_penalties_is_its_own_target_only(tiny, tiny_dir, dtype):
    from edgespec.models.loading import load_model
    from edgespec.runner.dtype_probe import exact_here

    if not exact_here(dtype):  # refused, never served inexactly (tests/test_engine.py)
        pytest.skip(f"this CPU does not serve {dtype}")
    runner = TargetRunner(load_model(str(tiny_dir), dtype=dtype).model, n_slots=4, max_len=128)
    alone = run(runner, None, REPEATING)
    drafted = run(runner, build_drafter("mag", tiny, runner), REPEATING)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in alone]


def test_settings_travel_the_wire_and_the_cache_and_give_the_same_deltas():
    """gRPC carries the penalties and biases as float32 (the deltas are float32 too, so a
    session sent over gRPC adjusts as one made here); the cache's JSON keeps them as given, and
    a session without them is written as before (a reader without these fields reads it)."""
    import json

    from cache_service.codec import params_from_json, params_to_json
    from edgespec.wire.convert import params_from_pb, params_to_pb

    p = SamplingParams(temperature=0.5, seed=3, presence_penalty=0.3, frequency_penalty=-1.1,
                       logit_bias={5: 2.7, 9: -100})
    assert params_from_json(params_to_json(p)) == p
    sent = params_from_pb(params_to_pb(p))
    assert sent.presence_penalty == float(np.float32(0.3)) and sent.seed == 3
    assert [t for t, _ in sent.logit_bias] == [5, 9]
    args = ([4, 5, 4], [5, 8], [-1, 0])
    for here, there in zip(row_entries(*args, p), row_entries(*args, sent)):
        assert np.array_equal(here, there)
    assert params_from_pb(params_to_pb(SamplingParams())) == SamplingParams()
    assert set(json.loads(params_to_json(SamplingParams(seed=1)))) == \
        {"temperature", "top_k", "top_p", "seed"}


def test_the_logits_are_put_back_bit_for_bit_after_the_verification():
    from edgespec.verify.logit_adjust import adjusted_in_place, step_adjust

    torch.manual_seed(0)
    with torch.inference_mode():  # as the runner's logits are
        logits = torch.randn(3, 4, 50)
    before = logits.clone()
    params = [PENALISED, SamplingParams(), SamplingParams(logit_bias={1: 5})]
    adjust = step_adjust([[3, 4, 3], [1], []], [([4, 9, 4], [-1, 0, 1]), ((), ()), ((), ())],
                         params, "cpu")
    with adjusted_in_place(logits, adjust) as moved:
        assert moved[0, 0, 3] == before[0, 0, 3] + np.float32(2.5 - 1.5 * 2 - 0.6)
        assert moved[0, 3, 4] == before[0, 3, 4] - np.float32(1.5 * 3 + 0.6)  # 4, 4 on its path
        assert moved[0, 0, 7] == before[0, 0, 7] - 100 and moved[2, 0, 1] == before[2, 0, 1] + 5
        assert torch.equal(moved[1], before[1])
    assert torch.equal(logits, before)
    with adjusted_in_place(logits[:, :1], adjust) as roots:  # a decode step's column alone
        assert roots[2, 0, 1] == before[2, 0, 1] + 5
    assert torch.equal(logits, before)


def test_logprobs_beside_penalties_are_the_models_own(tiny, runner):
    """Logprobs are read from the logits as the model gave them, the moves put back first:
    the same drafted or not, and transformers' log-softmax at each token."""
    alone = run_logprobs(runner, None)
    drafted = run_logprobs(runner, build_drafter("mag", tiny, runner))
    assert [r.logprobs for r in drafted] == [r.logprobs for r in alone]
    for prompt, res in zip(PROMPTS, alone):
        with torch.no_grad():
            logits = tiny.model(torch.tensor([prompt + res.token_ids])).logits[0]
        lp = torch.log_softmax(logits[len(prompt) - 1:-1].float(), -1)
        want = lp.gather(1, torch.tensor(res.token_ids)[:, None])[:, 0].tolist()
        assert [e.logprob for e in res.logprobs] == pytest.approx(want, abs=1e-4)


def run_logprobs(runner, drafter):
    with SpecEngine(runner, drafter, EngineConfig(**FIXED), stop_ids={2}) as engine:
        return engine.generate_many([Request(p, N, REPEATING, logprobs=2) for p in PROMPTS])
