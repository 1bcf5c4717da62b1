"""A prompt's logprobs (``Request.prompt_logprobs``): each prompt token's after the first under
the target given the tokens before it, read as the prompt is prefilled (the completions'
``echo``). They are the model's distribution there, the same however the prompt was cut into
chunks, and asking for them changes nothing of the output: it is target-only decoding's."""

import pytest
import torch

from edgespec.config import ConfigError, EngineConfig, SamplingParams
from edgespec.drafters import build_drafter
from edgespec.engine.generation import Admission
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.runner.target_runner import TargetRunner

PROMPTS = [
    [1, 10, 11, 12, 13, 10, 11, 12, 13, 10],
    [1, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61] * 4,  # 52 tokens: several chunks
    [1, 30],
]
FIXED = dict(max_draft=4, window=8, chunk=2, adaptive=False, draft_wait_ms=5000)
N = 24


@pytest.fixture(scope="module")
def runner(tiny):
    return TargetRunner(tiny.model, n_slots=8, max_len=256)


def run(runner, drafter, top=3, cfg=None, params=None):
    with SpecEngine(runner, drafter, cfg or EngineConfig(**FIXED), stop_ids={2}) as engine:
        return engine.generate_many([Request(p, N, params or SamplingParams(),
                                             prompt_logprobs=top) for p in PROMPTS])


def test_prompt_logprobs_are_the_models_distribution(tiny, runner):
    for prompt, res in zip(PROMPTS, run(runner, None)):
        assert len(res.prompt_logprobs) == len(prompt) - 1
        with torch.no_grad():
            logits = tiny.model(torch.tensor([prompt])).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1)
        for i, e in enumerate(res.prompt_logprobs):
            assert e.token == prompt[i + 1]
            assert e.logprob == pytest.approx(float(lp[i, prompt[i + 1]]), abs=1e-4)
            assert len(e.top) == 3 and [v for _, v in e.top] == \
                pytest.approx(lp[i].topk(3).values.tolist(), abs=1e-4)


@pytest.mark.parametrize("spec, budget", [(None, 512), ("mag", 512), ("layers:2", 512),
                                          ("mag", 16)])
def test_asking_for_them_leaves_the_output_target_onlys(tiny, runner, spec, budget):
    """The prompt scored as it is prefilled writes the prefill's keys and values: the output is
    the one the same request gets without them, drafted or not, greedy or sampled, the
    prompts in one chunk or cut into several (``prefill_budget`` 16: both ways)."""
    cfg = EngineConfig(**FIXED, prefill_budget=budget)
    for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=7)):
        with SpecEngine(runner, None, cfg, stop_ids={2}) as engine:
            plain = engine.generate_many([Request(p, N, params) for p in PROMPTS])
        drafter = None if spec is None else build_drafter(spec, tiny, runner)
        got = run(runner, drafter, params=params, cfg=cfg)
        assert [r.token_ids for r in got] == [r.token_ids for r in plain]
        assert all(r.prompt_logprobs for r in got) and all(r.prompt_logprobs is None
                                                           for r in plain)


def test_they_do_not_depend_on_where_the_prompt_was_cut(runner):
    """The prefill's chunk (``prefill_budget``) cuts a long prompt elsewhere: the same bits."""
    whole = run(runner, None)
    cut = run(runner, None, cfg=EngineConfig(**FIXED, prefill_budget=16))
    assert [r.prompt_logprobs for r in cut] == [r.prompt_logprobs for r in whole]
    assert [r.token_ids for r in cut] == [r.token_ids for r in whole]


def test_a_resumed_sessions_are_its_prompts_alone(runner):
    full = run(runner, None)[0]
    with SpecEngine(runner, None, EngineConfig(**FIXED), stop_ids={2}) as engine:
        res = engine.generate(Request(PROMPTS[0], N, committed=full.token_ids[:5],
                                      prompt_logprobs=3))
    assert res.prompt_logprobs == full.prompt_logprobs
    assert res.token_ids == full.token_ids


def test_the_callback_gets_them_before_any_token(runner):
    seen = []
    req = Request(PROMPTS[0], 4, prompt_logprobs=0,
                  on_prompt_logprobs=lambda lps: seen.append(("prompt", len(lps))),
                  on_tokens=lambda new: seen.append(("tokens", len(new))))
    with SpecEngine(runner, None, EngineConfig(**FIXED), stop_ids={2}) as engine:
        res = engine.generate(req)
    assert seen[0] == ("prompt", len(PROMPTS[0]) - 1) and len(seen) > 1
    assert all(e.top == () for e in res.prompt_logprobs)


def test_a_callback_that_raises_fails_its_session_alone(runner):
    """Handed over when its prompt is in, at a step: the session it concerns fails there (its
    slot given back, its caller told), the one prefilled beside it runs to its end."""
    def broken(_):
        raise RuntimeError("the caller's bug")

    with SpecEngine(runner, None, EngineConfig(**FIXED), stop_ids={2}) as engine:
        free = engine.free_slots
        bad = Request(PROMPTS[0], 4, prompt_logprobs=1, on_prompt_logprobs=broken)
        good = Request(PROMPTS[2], 4, prompt_logprobs=1)
        out = engine.admit([Admission(bad), Admission(good)])
        assert not any(isinstance(o, Exception) for o in out)
        errors: list[Exception] = []
        out[0].on_error = errors.append
        while engine.active or len(engine.prefilling):
            engine.step()
        assert len(errors) == 1 and "the caller's bug" in str(errors[0])
    with SpecEngine(runner, None, EngineConfig(**FIXED), stop_ids={2}) as engine:
        with pytest.raises(RuntimeError, match="the caller's bug"):  # add: the caller's own
            engine.add(Request(PROMPTS[0], 4, prompt_logprobs=1, on_prompt_logprobs=broken))
        assert engine.free_slots == free
        assert out[0].output == [] and len(out[1].output) == 4
        assert len(out[1].prompt_logprobs) == len(PROMPTS[2]) - 1
        assert engine.free_slots == free


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_a_setting_out_of_range_is_refused(runner, bad):
    with SpecEngine(runner, None, EngineConfig(), stop_ids={2}) as engine:
        with pytest.raises(ConfigError, match="logprobs must be an integer"):
            engine.add(Request(PROMPTS[0], 4, prompt_logprobs=bad))


def _alone(runner, prompt, top=3):
    with SpecEngine(runner, None, EngineConfig(**FIXED), stop_ids={2}) as engine:
        return engine.generate(Request(prompt, N, prompt_logprobs=top))


def test_scored_prompts_admitted_together_share_a_forward(runner, monkeypatch):
    """A burst of scoring requests (an evaluation harness's) is prefilled in shared forwards
    like any other prompts, each prompt's logprobs the same bits as when it is prefilled
    alone."""
    calls: list[tuple[int, int]] = []  # (rows, rows read)
    parts = runner.prefill_parts

    def recording(slots, rows, reads=None):
        calls.append((len(slots), sum(r is not None for r in reads or [])))
        parts(slots, rows, reads=reads)

    alone = [_alone(runner, p) for p in PROMPTS]
    monkeypatch.setattr(runner, "prefill_parts", recording)
    got = run(runner, None)
    assert calls[0] == (len(PROMPTS), len(PROMPTS))  # every prompt's first part in one
    assert [r.prompt_logprobs for r in got] == [r.prompt_logprobs for r in alone]
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]


def test_running_sessions_get_tokens_while_a_scored_burst_is_prefilled(runner):
    """The scored prompts are prefilled a budget a step, beside the running session, which
    gets a token every step meanwhile."""
    cfg = EngineConfig(**{**FIXED, "chunk": 2}, prefill_budget=16)
    with SpecEngine(runner, None, cfg, stop_ids=set()) as engine:
        [running] = engine.admit([Admission(Request(PROMPTS[0], 64))])
        engine.step()
        assert running in engine.active
        burst = engine.admit([Admission(Request(PROMPTS[1], 4, prompt_logprobs=1))
                              for _ in range(3)])
        steps = 0
        while len(engine.prefilling):
            before = len(running.output)
            engine.step()
            steps += 1
            assert len(running.output) > before
        assert steps >= 3 * len(PROMPTS[1]) // 16
        while engine.active:
            engine.step()
    ref = _alone(runner, PROMPTS[1], top=1)
    assert all(b.prompt_logprobs == ref.prompt_logprobs and b.output == ref.token_ids[:4]
               for b in burst)


def test_a_shared_forward_that_raises_is_read_again_alone_the_same(runner, monkeypatch):
    """A shared prefill that fails after its rows were read is retried a part at a time: each
    part read again replaces its first reading, so every prompt's logprobs are whole, once."""
    parts = runner.prefill_parts
    failed = []

    def flaky(slots, rows, reads=None):
        parts(slots, rows, reads=reads)
        if len(slots) > 1 and not failed:
            failed.append(len(slots))
            raise RuntimeError("a device fault after the reads")

    alone = [_alone(runner, p) for p in PROMPTS]
    monkeypatch.setattr(runner, "prefill_parts", flaky)
    got = run(runner, None)
    assert failed == [len(PROMPTS)]
    assert [r.prompt_logprobs for r in got] == [r.prompt_logprobs for r in alone]
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]


def test_a_request_of_no_new_tokens_scores_its_prompt_and_ends(runner):
    """``max_new_tokens`` 0: the prompt is prefilled (in the shared prefill, beside the
    others), scored if asked, and the session ends "length" with no output and its slot back,
    never a step of its own; the others are as without it. 0 with committed tokens (a resume),
    or below 0, is refused."""
    whole = run(runner, None)
    with SpecEngine(runner, None, EngineConfig(**FIXED), stop_ids={2}) as engine:
        free = engine.free_slots
        got = engine.generate_many([Request(PROMPTS[0], 0, prompt_logprobs=3),
                                    Request(PROMPTS[1], N, prompt_logprobs=3),
                                    Request(PROMPTS[2], 0)])
        assert engine.free_slots == free
        for bad in (Request(PROMPTS[0], 0, committed=[5]), Request(PROMPTS[0], -1)):
            with pytest.raises(ConfigError, match="max_new_tokens must be >= 1"):
                engine.add(bad)
    assert [(r.token_ids, r.finish_reason) for r in (got[0], got[2])] == [([], "length")] * 2
    assert got[0].prompt_logprobs == whole[0].prompt_logprobs and got[2].prompt_logprobs is None
    assert got[1].token_ids == whole[1].token_ids
    assert got[1].prompt_logprobs == whole[1].prompt_logprobs


def test_a_prompt_alone_may_fill_the_whole_context(runner):
    """A prompt scored alone needs no room for output or drafts: it may be as long as the
    context limit (the limit every prompt has, the HTTP admission's for token ids too), where a
    request of one new token is refused; one token more is refused too."""
    longest = [1] + [10 + i % 40 for i in range(runner.max_len - 1)]  # max_len tokens
    with SpecEngine(runner, None, EngineConfig(**FIXED), stop_ids={2}) as engine:
        got = engine.generate(Request(longest, 0, prompt_logprobs=0))
        with pytest.raises(ConfigError, match="leaves no room for output"):
            engine.add(Request(longest, 1))
        with pytest.raises(ConfigError, match="exceeds the context limit"):
            engine.add(Request(longest + [5], 0, prompt_logprobs=0))
    assert got.token_ids == [] and len(got.prompt_logprobs) == len(longest) - 1
