"""A session's logprobs (``Request.logprobs``): target-only decoding's bit for bit whatever
drafts for it (chains, trees, batched beside sessions that ask for none), one per emitted token,
the model's own distribution at the position that chose it."""

import numpy as np
import pytest
import torch
from conftest import hf_greedy
from tree_oracle import OracleTreeDrafter

from edgespec.config import ConfigError, EngineConfig, SamplingParams
from edgespec.drafters import build_drafter
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.runner.target_runner import TargetRunner
from edgespec.protocol.token_logprob import MAX_TOP_LOGPROBS, TokenLogprob
from edgespec.verify.token_logprobs import LogprobPick, emitted_columns, read_logprobs

PROMPTS = [
    [1, 10, 11, 12, 13, 10, 11, 12, 13, 10],
    [1, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61],
    [1, 30, 31, 30, 31, 30],
]
FIXED = dict(max_draft=4, window=8, chunk=2, adaptive=False, draft_wait_ms=5000)
N = 32


@pytest.fixture(scope="module")
def runner(tiny):
    return TargetRunner(tiny.model, n_slots=8, max_len=256)


def run(runner, drafter, params=None, top=5, cfg=None, prompts=PROMPTS, n=N):
    with SpecEngine(runner, drafter, cfg or EngineConfig(**FIXED), stop_ids={2}) as engine:
        return engine.generate_many([Request(p, n, params or SamplingParams(), logprobs=top)
                                     for p in prompts])


@pytest.fixture(scope="module")
def target_only(runner):
    return run(runner, None)


def model_logprobs(model, prompt, output):
    """log_softmax of transformers' logits at each output token's position (float32)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return lp.gather(1, torch.tensor(output)[:, None])[:, 0].tolist(), lp


def test_emitted_columns_are_the_root_then_one_past_each_accepted_node():
    assert emitted_columns((), 1) == [0]
    assert emitted_columns((0, 1, 2), 4) == [0, 1, 2, 3]  # a chain accepted whole, and its bonus
    assert emitted_columns((0, 1, 2), 2) == [0, 1]  # cut where the output ended
    assert emitted_columns((0, 4, 5), 4) == [0, 1, 5, 6]  # a tree: a branch off node 0


def test_target_only_logprobs_are_the_models_distribution(tiny, target_only):
    """Each token's logprob is the model's log-softmax at the position that chose it (the
    emitted token, greedy, is the most likely: the first alternative), one a token."""
    for prompt, res in zip(PROMPTS, target_only):
        assert res.token_ids == hf_greedy(tiny.model, prompt, N)
        assert len(res.logprobs) == len(res.token_ids)
        ref, lp = model_logprobs(tiny.model, prompt, res.token_ids)
        for i, (e, tok) in enumerate(zip(res.logprobs, res.token_ids)):
            assert e.token == tok
            assert e.logprob == pytest.approx(ref[i], abs=1e-4)  # transformers' own kernels
            assert len(e.top) == 5 and e.top[0] == (tok, e.logprob)
            assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
            values, ids = lp[i].topk(5)
            assert [t for t, _ in e.top] == ids.tolist() or \
                values[3] == values[4]  # a tie at the edge may pick either id
            assert [v for _, v in e.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("spec", ["mag", "layers:2"])
def test_drafted_logprobs_are_target_only_bit_for_bit(tiny, runner, target_only, spec):
    drafter = build_drafter(spec, tiny, runner, n_slots=4, max_len=256)
    if hasattr(drafter, "min_confidence"):
        drafter.min_confidence = 0.0  # draft every time: exercise rejections
    got = run(runner, drafter)
    assert sum(r.stats.accepted_tokens for r in got) > 0  # drafts were verified and kept
    for res, ref in zip(got, target_only):
        assert res.token_ids == ref.token_ids
        assert res.logprobs == ref.logprobs  # floats compared exactly, alternatives too


def test_tree_drafted_logprobs_are_target_only_bit_for_bit(tiny, runner, target_only):
    refs = {tuple(p): r.token_ids for p, r in zip(PROMPTS, target_only)}
    drafter = OracleTreeDrafter(refs, runner.vocab_size, seed=3)
    got = run(runner, drafter, cfg=EngineConfig(adaptive=False, draft_wait_ms=5000,
                                                 tree_width=3))
    assert sum(r.stats.branch_tokens for r in got) > 0  # branches were taken
    for res, ref in zip(got, target_only):
        assert res.token_ids == ref.token_ids
        assert res.logprobs == ref.logprobs


def test_sampled_logprobs_are_target_only_bit_for_bit_and_unprocessed(tiny, runner):
    """A seeded sampled generation: the same tokens and logprobs drafted or not; the logprobs
    are the model's own distribution, not the temperature's."""
    params = SamplingParams(temperature=0.7, top_k=20, seed=11)
    alone = run(runner, None, params, top=0)
    drafted = run(runner, build_drafter("mag", tiny, runner), params, top=0)
    for prompt, a, d in zip(PROMPTS, alone, drafted):
        assert d.token_ids == a.token_ids and d.logprobs == a.logprobs
        assert all(e.top == () for e in a.logprobs)
        ref, _ = model_logprobs(tiny.model, prompt, a.token_ids)
        assert [e.logprob for e in a.logprobs] == pytest.approx(ref, abs=1e-4)


def test_sessions_that_ask_and_sessions_that_do_not_share_a_batch(tiny, runner, target_only):
    """Only the sessions that asked get logprobs; the others' output is unchanged; each asks
    its own number of alternatives; the logprobs end where the output does (a stop token, the
    limit)."""
    drafter = build_drafter("mag", tiny, runner)
    tops = [None, 2, 0]
    with SpecEngine(runner, drafter, EngineConfig(**FIXED), stop_ids={2}) as engine:
        got = engine.generate_many([Request(p, N, logprobs=k) for p, k in zip(PROMPTS, tops)])
        short = engine.generate(Request(PROMPTS[1], 3, logprobs=1))
    for res, ref, k in zip(got, target_only, tops):
        assert res.token_ids == ref.token_ids
        if k is None:
            assert res.logprobs is None
            continue
        assert [(e.token, e.logprob) for e in res.logprobs] == \
            [(e.token, e.logprob) for e in ref.logprobs]
        assert [e.top for e in res.logprobs] == [e.top[:k] for e in ref.logprobs]
    assert short.token_ids == target_only[1].token_ids[:3] and len(short.logprobs) == 3


def test_the_callback_gets_each_chunks_logprobs_before_its_tokens(tiny, runner):
    seen: list = []
    req = Request(PROMPTS[0], N, logprobs=0,
                  on_tokens=lambda new: seen.append(("tokens", list(new))),
                  on_logprobs=lambda lps: seen.append(("logprobs", [e.token for e in lps])))
    with SpecEngine(runner, build_drafter("mag", tiny, runner), EngineConfig(**FIXED),
                    stop_ids={2}) as engine:
        res = engine.generate(req)
    assert [kind for kind, _ in seen] == ["logprobs", "tokens"] * (len(seen) // 2)
    assert [t for kind, chunk in seen if kind == "logprobs" for t in chunk] == res.token_ids
    assert seen[0::2] == [("logprobs", chunk) for _, chunk in seen[1::2]]


@pytest.mark.parametrize("bad", [-1, MAX_TOP_LOGPROBS + 1, True, 1.0, "3"])
def test_a_logprobs_setting_out_of_range_is_refused(runner, bad):
    with SpecEngine(runner, None, EngineConfig(), stop_ids={2}) as engine:
        with pytest.raises(ConfigError, match="logprobs must be an integer"):
            engine.add(Request(PROMPTS[0], 4, logprobs=bad))


def test_read_logprobs_of_no_token_reads_nothing():
    logits = torch.zeros(2, 3, 7)
    assert read_logprobs(logits, [LogprobPick(0, [], [], 3)]) == [()]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logprobs_are_its_own_target_onlys(tiny, tiny_dir, dtype):
    from edgespec.models.loading import load_model
    from edgespec.runner.dtype_probe import exact_here

    if not exact_here(dtype):  # refused, never served inexactly (tests/test_engine.py)
        pytest.skip(f"this CPU does not serve {dtype}")
    runner = TargetRunner(load_model(str(tiny_dir), dtype=dtype).model, n_slots=4, max_len=128)
    alone = run(runner, None)
    drafted = run(runner, build_drafter("mag", tiny, runner))
    assert [r.token_ids for r in drafted] == [r.token_ids for r in alone]
    assert [r.logprobs for r in drafted] == [r.logprobs for r in alone]


def test_alternatives_are_the_largest_with_equals_by_lower_id_whatever_the_others_ask():
    """bfloat16-valued logits tie often: a position's alternatives are its own (a stable order:
    descending logprob, then ascending id), alone or beside a row that asks for more."""
    torch.manual_seed(1)
    vocab = 4096
    logits = (torch.randn(2, 6, vocab) * 4).bfloat16().float()
    crossing = 0
    for b in range(2):
        for col in range(6):
            lp = torch.log_softmax(logits[b, col], -1).numpy()
            order = np.argsort(-lp, kind="stable")
            for top in (1, 3, 7, MAX_TOP_LOGPROBS):
                want = tuple((int(i), float(lp[i])) for i in order[:top])
                crossing += lp[order[top - 1]] == lp[order[top]]
                for beside in ([], [LogprobPick(1 - b, [0, 1], [0, 1], MAX_TOP_LOGPROBS)]):
                    got = read_logprobs(logits, [LogprobPick(b, [col], [5], top), *beside])[0]
                    assert got == (TokenLogprob(5, float(lp[5]), want),), (b, col, top)
    assert crossing > 0  # ties crossed the cut: the case that needs the stable order


def test_decode_steps_run_ahead_only_without_a_session_that_asks(tiny, runner, target_only):
    """Decode steps run ahead (as on CUDA) judge a step from choices alone, with no logits read:
    while a session asks for logprobs none is launched, and it gets every token's; once it
    ends, the others' steps run ahead again."""
    with SpecEngine(runner, None, EngineConfig(decode_ahead=True), stop_ids={2}) as engine:
        got = engine.generate_many([Request(PROMPTS[0], 8, logprobs=5),
                                    Request(PROMPTS[1], N), Request(PROMPTS[2], N)])
        launched = engine.ahead.launched
    assert launched > 0  # after the session that asked ended
    assert got[0].token_ids == target_only[0].token_ids[:8]
    assert got[0].logprobs == target_only[0].logprobs[:8]
    assert [r.token_ids for r in got[1:]] == [r.token_ids for r in target_only[1:]]
