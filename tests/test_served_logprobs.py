"""Logprobs served by a live ``edgespec serve`` with a MaG board: over the OpenAI-compatible API,
read by the official ``openai`` client (chat's ``logprobs``/``top_logprobs``, the legacy
completions' ``logprobs``, streamed and whole), and over gRPC by the SDK (``logprobs=``). They
are target-only decoding's (an engine in this process, the same model, no drafter), exactly,
one a completion token, each token's bytes the text's own."""

from __future__ import annotations

from dataclasses import replace

import pytest

from edgespec.client import Client, InvalidRequest
from edgespec.config import EngineConfig, SamplingParams
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.models.loading import encode_prompt
from edgespec.runner.target_runner import TargetRunner
from edgespec.sdk.stream import Resumer
from http_harness import MESSAGES, N, PROMPT, TOKEN, call

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier


@pytest.fixture(scope="module")
def target_only(looping):
    """(token ids, logprobs with 5 alternatives) of target-only decoding in this process."""
    runner = TargetRunner(looping.model, n_slots=1, max_len=512)

    def decode(ids: list[int], params: SamplingParams = SamplingParams(), n: int = N):
        with SpecEngine(runner, None, EngineConfig(), stop_ids={2}) as engine:
            res = engine.generate(Request(ids, n, params, logprobs=5))
        return res.token_ids, res.logprobs

    return decode


def text_of(looping, token_id: int) -> str:
    return looping.tokenizer.decode([token_id], skip_special_tokens=False)


def test_chat_logprobs_are_target_onlys(api, looping, target_only):
    ids, ref = target_only(encode_prompt(looping.tokenizer, messages=MESSAGES))
    r = api.chat.completions.create(model=api.model_id, messages=MESSAGES, max_tokens=N,
                                    temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert r.choices[0].logprobs.refusal is None
    assert len(content) == r.usage.completion_tokens == len(ids)
    assert r.edgespec["accepted"] > 0  # the board's drafts were verified and kept
    for got, want in zip(content, ref):
        assert got.token == text_of(looping, want.token)
        assert got.logprob == want.logprob  # float32's value, exactly, through JSON
        assert [(t.token, t.logprob) for t in got.top_logprobs] == \
            [(text_of(looping, t), lp) for t, lp in want.top[:3]]
        assert bytes(got.bytes) == got.token.encode()
    shown = b"".join(bytes(c.bytes) for c in content)
    assert shown.decode().startswith(r.choices[0].message.content)  # then any stop token


def test_streamed_chat_logprobs_are_the_whole_answers(api):
    kw = dict(model=api.model_id, messages=MESSAGES, max_tokens=N, temperature=0,
              logprobs=True, top_logprobs=2)
    whole = api.chat.completions.create(**kw).choices[0]
    chunks = list(api.chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == \
        [e.model_dump() for e in whole.logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.message.content


def test_sampled_chat_logprobs_are_the_models_own(api, looping, target_only):
    """A seeded sampled answer: target-only's tokens and logprobs (the model's distribution,
    not the temperature's); logprobs true alone gives no alternatives."""
    params = SamplingParams(temperature=0.8, seed=5)
    ids, ref = target_only(encode_prompt(looping.tokenizer, messages=MESSAGES), params)
    r = api.chat.completions.create(model=api.model_id, messages=MESSAGES, max_tokens=N,
                                    temperature=0.8, seed=5, logprobs=True)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [text_of(looping, t) for t in ids]
    assert [c.logprob for c in content] == [e.logprob for e in ref]
    assert all(c.top_logprobs == [] for c in content)


def test_completions_logprobs_are_target_onlys(api, looping, target_only):
    ids, ref = target_only(looping.tokenizer.encode(PROMPT, add_special_tokens=True))
    r = api.completions.create(model=api.model_id, prompt=PROMPT, max_tokens=N, temperature=0,
                               logprobs=2)
    lp = r.choices[0].logprobs
    texts = [text_of(looping, t) for t in ids]
    assert lp.tokens == texts and lp.token_logprobs == [e.logprob for e in ref]
    assert lp.text_offset == [sum(map(len, texts[:i])) for i in range(len(texts))]
    for top, want in zip(lp.top_logprobs, ref):  # the two alternatives and the token itself
        assert top == {**{text_of(looping, t): v for t, v in want.top[:2]},
                       text_of(looping, want.token): want.logprob}
    streamed = list(api.completions.create(model=api.model_id, prompt=PROMPT, max_tokens=N,
                                           temperature=0, logprobs=2, stream=True))
    assert [t for c in streamed if c.choices[0].logprobs
            for t in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    assert [o for c in streamed if c.choices[0].logprobs
            for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_without_logprobs_a_choice_has_none(api):
    r = api.chat.completions.create(model=api.model_id, messages=MESSAGES, max_tokens=4)
    assert r.choices[0].logprobs is None
    r = api.completions.create(model=api.model_id, prompt=PROMPT, max_tokens=4)
    assert r.choices[0].logprobs is None


@pytest.mark.parametrize("body,param", [
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(logprobs="yes"), "logprobs"),
])
def test_a_chat_logprobs_setting_out_of_range_is_a_400_naming_it(server, api, body, param):
    code, reply = call("POST", server["base"] + "/v1/chat/completions",
                       {"model": api.model_id, "messages": MESSAGES, "max_tokens": 2, **body},
                       {"Authorization": f"Bearer {TOKEN}"})
    assert code == 400 and reply["error"]["param"] == param


def test_the_sdk_gets_target_onlys_logprobs(server, looping, target_only):
    ids, ref = target_only(encode_prompt(looping.tokenizer, messages=MESSAGES))
    with Client(server["address"], token=TOKEN, timeout=120) as client:
        res = client.generate(messages=MESSAGES, max_new_tokens=N, logprobs=3)
        pieces = list(client.stream(messages=MESSAGES, max_new_tokens=N, logprobs=3))
        plain = client.generate(messages=MESSAGES, max_new_tokens=4)
    assert res.token_ids == ids and res.stats["accepted"] > 0
    assert res.logprobs == [replace(e, top=e.top[:3]) for e in ref]
    assert [e for p in pieces if p.token_ids for e in p.logprobs] == res.logprobs
    assert all(len(p.logprobs) == len(p.token_ids) for p in pieces if p.token_ids)
    assert plain.logprobs is None


def test_the_sdk_refuses_logprobs_out_of_range_before_sending(server):
    with Client(server["address"], token=TOKEN, timeout=120) as client:
        for bad in (-1, 21, True, 2.0):
            with pytest.raises(InvalidRequest, match="logprobs must be an integer"):
                client.generate("hi", logprobs=bad)


def test_a_resumed_stream_asks_for_logprobs_again():
    """The resume request carries the call's logprobs setting (the tokens after the break get
    theirs); a call without it sends none."""
    for asked in (0, 4, None):
        res = Resumer.of_call(type("C", (), {"timeout": None, "max_resumes": 2}), None,
                              prompt="hi", logprobs=asked)
        res.session_id, res.tokens = "ab" * 16, [5, 6]
        resume = res.next_request()
        assert resume.resume_from == 2
        assert resume.HasField("logprobs") == (asked is not None)
        if asked is not None:
            assert resume.logprobs == asked


def test_the_sdk_gets_the_prompts_logprobs(server, looping):
    """``prompt_logprobs=k``: the prompt's logprobs as the engine in this process reads them
    (the same model, no drafter), exactly, on the result and on the first piece with tokens;
    the output is the one the same call gets without them; a prompt of one token has none
    before it to score (an empty list, not None)."""
    ids = encode_prompt(looping.tokenizer, messages=MESSAGES)
    runner = TargetRunner(looping.model, n_slots=1, max_len=512)
    with SpecEngine(runner, None, EngineConfig(), stop_ids={2}) as engine:
        ref = engine.generate(Request(ids, N, prompt_logprobs=2))
    assert len(ref.prompt_logprobs) == len(ids) - 1
    with Client(server["address"], token=TOKEN, timeout=120) as client:
        res = client.generate(prompt_ids=ids, max_new_tokens=N, prompt_logprobs=2)
        pieces = list(client.stream(prompt_ids=ids, max_new_tokens=N, prompt_logprobs=2))
        plain = client.generate(prompt_ids=ids, max_new_tokens=N)
        one = client.generate(prompt_ids=ids[:1], max_new_tokens=2, prompt_logprobs=0)
    assert res.prompt_logprobs == ref.prompt_logprobs
    assert res.token_ids == plain.token_ids == ref.token_ids and plain.prompt_logprobs is None
    with_tokens = [p for p in pieces if p.token_ids]
    assert with_tokens[0].prompt_logprobs == ref.prompt_logprobs
    assert all(p.prompt_logprobs is None for p in pieces if p is not with_tokens[0])
    assert one.prompt_logprobs == [] and len(one.token_ids) == 2


def test_the_sdk_scores_a_prompt_alone(server, looping):
    """``prompt_only=True``: the prompt prefilled and scored, no output (finish "length"), its
    logprobs the ones a generating call gets; streamed, the one piece (the last) carries them.
    Asked with an output limit or images, refused before sending."""
    ids = encode_prompt(looping.tokenizer, messages=MESSAGES)
    with Client(server["address"], token=TOKEN, timeout=120) as client:
        scored = client.generate(prompt_ids=ids, max_new_tokens=N, prompt_logprobs=3)
        alone = client.generate(prompt_ids=ids, prompt_only=True, prompt_logprobs=3)
        pieces = list(client.stream(prompt_ids=ids, prompt_only=True, prompt_logprobs=3))
        bare = client.generate(prompt_ids=ids, prompt_only=True)
        unpinned = client.generate(prompt_ids=ids, prompt_only=True, prompt_logprobs=3,
                                   device_id="no-such-board")  # drafts nothing: not asked
    assert alone.prompt_logprobs == scored.prompt_logprobs and len(alone.prompt_logprobs) == \
        len(ids) - 1
    assert (alone.token_ids, alone.finish_reason, alone.prompt_tokens) == ([], "length", len(ids))
    [last] = pieces
    assert last.finish_reason == "length" and last.prompt_logprobs == scored.prompt_logprobs
    assert bare.token_ids == [] and bare.prompt_logprobs is None
    assert unpinned.prompt_logprobs == scored.prompt_logprobs and unpinned.device_id == ""
    from edgespec.sdk.request import build_request

    for kw in (dict(max_new_tokens=4), dict(images=[b"x"]), dict(prompt_only=1)):
        with pytest.raises(InvalidRequest, match="prompt_only"):
            build_request("hi", **{"prompt_only": True, **kw})


def test_a_prompt_alone_with_an_output_limit_is_refused_on_the_wire():
    """The verifier reads ``prompt_only`` (a client other than the SDK may send a limit too:
    refused, not one of the two silently)."""
    from edgespec.config import ConfigError
    from edgespec.v1 import edgespec_pb2 as pb
    from verifier_node.service import generation_request

    with pytest.raises(ConfigError, match="prompt_only asks for no output"):
        generation_request(pb.GenerateRequest(prompt="hi", prompt_only=True, max_new_tokens=3))
    with pytest.raises(ConfigError, match="holds no committed_ids"):
        generation_request(pb.GenerateRequest(prompt="hi", prompt_only=True, committed_ids=[5],
                                              lost_session_id="ab" * 16))
    assert generation_request(pb.GenerateRequest(prompt="hi", prompt_only=True)).prompt_only
    assert not generation_request(pb.GenerateRequest(prompt="hi")).prompt_only


def test_the_sdk_refuses_a_verifier_that_generates_for_a_prompt_alone():
    """A verifier that predates ``prompt_only`` drops it (proto3) and generates: its first
    tokens stop the call (ending the stream cancels the session)."""
    from edgespec.sdk.errors import PreconditionFailed
    from edgespec.v1 import edgespec_pb2 as pb

    res = _resumer(prompt_only=True)
    assert res.next_request().prompt_only and res.next_request().max_new_tokens == 0
    res.seen(pb.GenerateResponse(session_id="ab" * 16, prompt_tokens=3))
    with pytest.raises(PreconditionFailed, match="predates prompt_only"):
        res.seen(pb.GenerateResponse(token_ids=[5]))


def test_the_sdk_refuses_prompt_logprobs_out_of_range_before_sending():
    from edgespec.sdk.request import build_request

    for bad in (-1, 21, True, 2.0):
        with pytest.raises(InvalidRequest, match="prompt_logprobs must be an integer"):
            build_request("hi", prompt_logprobs=bad)


def _resumer(**kw) -> Resumer:
    return Resumer.of_call(type("C", (), {"timeout": None, "max_resumes": 2}), None,
                           prompt="hi", **kw)


def _piece(start: int, tokens: list[int]):
    from edgespec.v1 import edgespec_pb2 as pb

    r = pb.GenerateResponse()
    r.prompt_logprobs.start = start
    r.prompt_logprobs.SetInParent()
    for t in tokens:
        r.prompt_logprobs.entries.add(token_id=t, logprob=-float(t))
    return r


def test_a_resumed_stream_asks_for_the_prompts_logprobs_until_it_has_them():
    """A resume (and a re-creation) asks again while the pieces are not whole, and not once
    they are; a broken stream's pieces are sent again whole and read afresh; a call without
    them never asks."""
    from edgespec.v1 import edgespec_pb2 as pb

    res = _resumer(prompt_logprobs=3)
    res.seen(pb.GenerateResponse(session_id="ab" * 16, prompt_tokens=4))
    res.seen(_piece(0, [7, 8]))  # 2 of the 3: the stream breaks here
    assert res.prompt_logprobs is None
    assert res.next_request().prompt_logprobs == 3 and res.recreate_request().prompt_logprobs == 3
    res.seen(pb.GenerateResponse(session_id="ab" * 16, prompt_tokens=4, resumed=True))
    res.seen(_piece(0, [7, 8]))
    res.seen(_piece(5, [1]))  # not the next piece: ignored
    res.seen(_piece(2, [9]))
    assert [(e.token, e.logprob) for e in res.prompt_logprobs] == [(7, -7.0), (8, -8.0),
                                                                    (9, -9.0)]
    assert not res.next_request().HasField("prompt_logprobs")
    assert not res.recreate_request().HasField("prompt_logprobs")
    res.seen(pb.GenerateResponse(session_id="ab" * 16, prompt_tokens=4, resumed=True))
    res.seen(_piece(0, [1, 2, 3]))  # a later stream's again: the first ones are kept
    assert [e.token for e in res.prompt_logprobs] == [7, 8, 9]
    one = _resumer(prompt_logprobs=0)  # a prompt of one token: one empty piece
    one.seen(pb.GenerateResponse(session_id="ab" * 16, prompt_tokens=1))
    one.seen(_piece(0, []))
    one.seen(pb.GenerateResponse(token_ids=[5]))
    assert one.prompt_logprobs == []
    plain = _resumer()
    plain.seen(pb.GenerateResponse(session_id="ab" * 16, token_ids=[5]))
    assert not plain.next_request().HasField("prompt_logprobs")


def test_a_long_prompts_logprobs_travel_in_pieces():
    """A prompt's logprobs are sent in pieces of at most PROMPT_LOGPROBS_PER_REPLY entries
    (20 alternatives each: a long prompt's would not fit one gRPC message), which the SDK puts
    back together whole and in order."""
    from edgespec.protocol.token_logprob import TokenLogprob
    from edgespec.v1 import edgespec_pb2 as pb
    from verifier_node.service import PROMPT_LOGPROBS_PER_REPLY, prompt_logprobs_replies
    from verifier_node.tickets import Ticket

    n = 2 * PROMPT_LOGPROBS_PER_REPLY + 5
    ticket = Ticket(Request([1] * (n + 1), 4, prompt_logprobs=20), None)
    assert prompt_logprobs_replies("s", ticket) == []  # not set yet
    entries = [TokenLogprob(i, -0.5, tuple((j, -1.0 - j) for j in range(20))) for i in range(n)]
    ticket.set_prompt_logprobs(entries)
    replies = prompt_logprobs_replies("s", ticket)
    assert [r.prompt_logprobs.start for r in replies] == [0, PROMPT_LOGPROBS_PER_REPLY,
                                                          2 * PROMPT_LOGPROBS_PER_REPLY]
    assert all(r.ByteSize() < 1 << 20 and not r.token_ids for r in replies)
    res = _resumer(prompt_logprobs=20)
    res.seen(pb.GenerateResponse(session_id="ab" * 16, prompt_tokens=n + 1))
    for r in replies:
        res.seen(r)
    res.seen(pb.GenerateResponse(token_ids=[5]))
    assert res.prompt_logprobs == entries
    one = Ticket(Request([1], 4, prompt_logprobs=0), None)
    one.set_prompt_logprobs([])
    [empty] = prompt_logprobs_replies("s", one)
    assert empty.HasField("prompt_logprobs") and not empty.prompt_logprobs.entries


def test_the_sdk_refuses_a_verifier_that_does_not_score_prompts():
    """A verifier that predates them drops the field (proto3): a new session's first tokens
    come without them, and the SDK stops there, however many times the call was sent before
    any answer. A resumed stream's verifier may not have them (the session ended before it):
    no refusal then."""
    from edgespec.sdk.errors import PreconditionFailed
    from edgespec.v1 import edgespec_pb2 as pb

    res = _resumer(prompt_logprobs=1)
    res.resumes = 1  # a first try that failed before any answer: sent again as it was
    res.seen(pb.GenerateResponse(session_id="ab" * 16, prompt_tokens=3))
    with pytest.raises(PreconditionFailed, match="predates prompt_logprobs"):
        res.seen(pb.GenerateResponse(token_ids=[5]))
    resumed = _resumer(prompt_logprobs=1)
    resumed.seen(pb.GenerateResponse(session_id="ab" * 16, prompt_tokens=3, resumed=True))
    resumed.seen(pb.GenerateResponse(token_ids=[5]))
    assert resumed.prompt_logprobs is None
