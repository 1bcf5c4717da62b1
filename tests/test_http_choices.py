"""A request for several choices (``n``) of a live ``edgespec serve`` with a MaG board, read by
the official ``openai`` client: a session a choice, choice i sampled with the request's seed
plus i (so each is the single answer of that seed, target-only's draw), greedy choices alike,
streamed chunks interleaved under one id, usage counting the prompt once."""

from __future__ import annotations

from collections import defaultdict

import pytest

from http_harness import MESSAGES, N, PROMPT, http_server, openai_client, reference

from edgespec.models.loading import encode_prompt

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier


@pytest.fixture(scope="module")
def server(looping_dir, tmp_path_factory):
    with http_server(looping_dir, tmp_path_factory.mktemp("http-choices")) as s:
        yield s


@pytest.fixture(scope="module")
def api(server):
    return openai_client(server)


def test_sampled_choices_are_the_answers_of_successive_seeds(api):
    kw = dict(model=api.model_id, messages=MESSAGES, max_tokens=N, temperature=0.9)
    r = api.chat.completions.create(n=3, seed=40, logprobs=True, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [api.chat.completions.create(seed=40 + i, logprobs=True, **kw) for i in range(3)]
    for choice, single in zip(r.choices, alone):
        assert choice.message.content == single.choices[0].message.content
        assert [e.logprob for e in choice.logprobs.content] == \
            [e.logprob for e in single.choices[0].logprobs.content]
    assert len({c.message.content for c in r.choices}) > 1  # three draws, not one thrice
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert [s["session_id"] for s in r.edgespec] == \
        list(dict.fromkeys(s["session_id"] for s in r.edgespec))  # a session each
    assert all(s["lossless"] for s in r.edgespec)


def test_greedy_choices_are_all_target_onlys_answer(api, looping):
    _, text = reference(looping, looping.tokenizer.encode(PROMPT, add_special_tokens=True))
    r = api.completions.create(model=api.model_id, prompt=PROMPT, max_tokens=N, temperature=0,
                               n=2)
    assert [c.text for c in r.choices] == [text, text]
    assert [c.index for c in r.choices] == [0, 1]


def test_streamed_choices_are_the_whole_ones_interleaved_under_one_id(api, looping):
    kw = dict(model=api.model_id, messages=MESSAGES, max_tokens=N, temperature=0.9, seed=7,
              n=3)
    whole = api.chat.completions.create(**kw)
    texts, finishes, ids = defaultdict(str), defaultdict(list), set()
    usage = None
    for chunk in api.chat.completions.create(stream=True,
                                             stream_options={"include_usage": True}, **kw):
        ids.add(chunk.id)
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
        usage = chunk.usage or usage
    assert len(ids) == 1
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert [finishes[i] for i in range(3)] == [[c.finish_reason] for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens
    ids_prompt = encode_prompt(looping.tokenizer, messages=MESSAGES)
    assert usage.prompt_tokens == len(ids_prompt)
