"""Presence and frequency penalties and logit bias served by a live ``edgespec serve`` with a
MaG board: over the OpenAI-compatible API, read by the official ``openai`` client (chat and the
legacy completions, streamed and whole, greedy and seeded), and over gRPC by the SDK. The output
is target-only decoding's with the same settings (an engine in this process, the same model, no
drafter), token for token, while the board's drafts are verified and kept."""

from __future__ import annotations

import openai
import pytest

from edgespec.client import Client, InvalidRequest
from edgespec.config import EngineConfig, SamplingParams
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.models.loading import encode_prompt
from edgespec.runner.target_runner import TargetRunner
from http_harness import MESSAGES, N, PROMPT, TOKEN

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier

# a presence penalty below 0 favours repeating (the looping model's, MaG's drafts stay good); the
# frequency penalty and the bias move the output off the plain answer
SETTINGS = dict(presence_penalty=-1.0, frequency_penalty=0.4)


@pytest.fixture(scope="module")
def target_only(looping):
    runner = TargetRunner(looping.model, n_slots=1, max_len=512)

    def decode(ids: list[int], params: SamplingParams, n: int = N) -> list[int]:
        with SpecEngine(runner, None, EngineConfig(), stop_ids={2}) as engine:
            return engine.generate(Request(ids, n, params)).token_ids

    return decode


@pytest.fixture(scope="module")
def chat_ids(looping):
    return encode_prompt(looping.tokenizer, messages=MESSAGES)


@pytest.fixture(scope="module")
def banned(chat_ids, target_only):
    """The plain answer's second token: banned, it moves the answer."""
    return target_only(chat_ids, SamplingParams())[1]


def text_of(looping, token_id: int) -> str:
    return looping.tokenizer.decode([token_id], skip_special_tokens=False)


def test_chat_with_penalties_is_target_onlys(api, looping, chat_ids, target_only, banned):
    params = SamplingParams(**SETTINGS, logit_bias={banned: -100})
    want = target_only(chat_ids, params)
    assert want != target_only(chat_ids, SamplingParams())  # the settings moved the answer
    kw = dict(model=api.model_id, messages=MESSAGES, max_tokens=N, temperature=0,
              logit_bias={str(banned): -100}, **SETTINGS)
    r = api.chat.completions.create(logprobs=True, **kw)
    got = r.choices[0].logprobs.content
    assert r.usage.completion_tokens == len(want)
    assert r.edgespec["accepted"] > 0  # the board's drafts were verified and kept
    assert [c.token for c in got] == [text_of(looping, t) for t in want]
    streamed = list(api.chat.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == r.choices[0].message.content


def test_the_sdk_with_penalties_gets_target_onlys_tokens(server, chat_ids, target_only, banned):
    params = SamplingParams(temperature=0.9, seed=3, **SETTINGS, logit_bias={banned: -100, 4: 2})
    want = target_only(chat_ids, params)
    with Client(server["address"], token=TOKEN, timeout=120) as client:
        res = client.generate(messages=MESSAGES, max_new_tokens=N, temperature=0.9, seed=3,
                              logit_bias={banned: -100, 4: 2}, **SETTINGS)
        pieces = list(client.stream(messages=MESSAGES, max_new_tokens=N, temperature=0.9,
                                    seed=3, logit_bias={banned: -100, 4: 2}, **SETTINGS))
    assert res.token_ids == want and banned not in want
    assert [t for p in pieces for t in p.token_ids] == want


def test_completions_with_penalties_are_target_onlys(api, looping, target_only):
    ids = looping.tokenizer.encode(PROMPT, add_special_tokens=True)
    params = SamplingParams(temperature=0.7, seed=11, frequency_penalty=1.2)
    want = target_only(ids, params)
    r = api.completions.create(model=api.model_id, prompt=ids, max_tokens=N, temperature=0.7,
                               seed=11, frequency_penalty=1.2, logprobs=0)
    assert r.choices[0].logprobs.tokens == \
        [looping.tokenizer.decode([t], skip_special_tokens=False) for t in want]


def test_bad_settings_are_refused(server, api):
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=api.model_id, messages=MESSAGES, max_tokens=2,
                                    logit_bias={"100000000": 5})
    assert "logit_bias token ids must be in" in str(e.value)
    assert e.value.body["param"] == "logit_bias"  # named, as its other refusals are
    with Client(server["address"], token=TOKEN, timeout=120) as client:
        with pytest.raises(InvalidRequest, match="presence_penalty must be a number in"):
            client.generate("hi", presence_penalty=2.5)
        with pytest.raises(InvalidRequest, match="logit_bias token ids must be in"):
            client.generate("hi", logit_bias={10 ** 8: 1})


def test_the_sdk_refuses_a_verifier_that_drops_the_settings():
    """A verifier that predates the settings ignores their fields (proto3): the first response
    echoes its sampling without them, and the SDK stops rather than pass off its output."""
    from edgespec.sdk.errors import PreconditionFailed
    from edgespec.sdk.stream import Resumer
    from edgespec.v1 import edgespec_pb2 as pb

    res = Resumer.of_call(type("C", (), {"timeout": None, "max_resumes": 2}), None,
                          prompt="hi", frequency_penalty=0.5)
    with pytest.raises(PreconditionFailed, match="predates them"):
        res.seen(pb.GenerateResponse(session_id="ab" * 16, sampling=pb.SamplingParams()))
    res = Resumer.of_call(type("C", (), {"timeout": None, "max_resumes": 2}), None,
                          prompt="hi", logit_bias={5: 1})
    res.seen(pb.GenerateResponse(session_id="ab" * 16, sampling=res.req.sampling))
    plain = Resumer.of_call(type("C", (), {"timeout": None, "max_resumes": 2}), None,
                            prompt="hi")
    plain.seen(pb.GenerateResponse(session_id="ab" * 16, sampling=pb.SamplingParams()))
