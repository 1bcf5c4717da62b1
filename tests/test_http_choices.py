"""A request for several choices (``n``) of a live ``edgespec serve`` with a MaG board, read by
the official ``openai`` client: a session a choice, choice i sampled with the request's seed
plus i (so each is the single answer of that seed, target-only's draw), greedy choices alike,
streamed chunks interleaved under one id, usage counting the prompt once."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import defaultdict
from types import SimpleNamespace

import pytest

from http_harness import MESSAGES, N, PROMPT, TOKEN, call, http_server, openai_client, reference

from edgespec.config import SamplingParams
from edgespec.models.loading import encode_prompt
from edgespec.verify.keyed_noise import seed_after

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier


@pytest.fixture(scope="module")
def server(looping_dir, tmp_path_factory):
    # 8 sessions running and 4 waiting: a request of more choices than 12 can never be held
    with http_server(looping_dir, tmp_path_factory.mktemp("http-choices"),
                     extra=("--max-queue", 4)) as s:
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


def test_more_choices_than_the_verifier_holds_is_a_400_naming_n(server, api):
    code, reply = call("POST", server["base"] + "/v1/completions",
                       {"model": api.model_id, "prompt": PROMPT, "max_tokens": 4, "n": 13},
                       {"Authorization": f"Bearer {TOKEN}"})
    assert code == 400 and reply["error"]["param"] == "n"
    assert "(12: running and waiting)" in reply["error"]["message"]
    r = api.completions.create(model=api.model_id, prompt=PROMPT, max_tokens=4, n=12)
    assert len(r.choices) == 12  # as many as it holds: 8 run, 4 wait for a slot


class _Scheduler:
    """What admitting choices reads of the scheduler: its capacity, its room, a cancel."""

    def __init__(self, room: int):
        self.capacity, self._room, self.cancelled = 16, room, []

    def room(self) -> int:
        return self._room

    def cancel(self, session_id, orphaned=False, reason="cancelled"):
        self.cancelled.append(session_id)


def _choices(tokenizer, n: int, fail: int | None = None):
    """n finished choices over a fake admission (its scheduler records cancels); choice
    ``fail``'s chunks raise a bug's error instead."""
    from edgespec.engine.generation import Request, Result
    from edgespec.protocol.request_stats import Stats
    from verifier_node.http_choice import ChoiceRun
    from verifier_node.tickets import Ticket

    admission = SimpleNamespace(tokenizer=tokenizer, kernels="k", scheduler=_Scheduler(16),
                                follow=lambda t: contextlib.nullcontext(t))
    runs = []
    for i in range(n):
        ticket = Ticket(Request([1, 2], 3), None)
        if i != fail:  # the failing one is left running: the others' end must cancel it
            ticket.tokens, ticket.result = [40, 41], Result([40, 41], Stats(tokens=2), "length")
        run = ChoiceRun(admission, ticket, SimpleNamespace(stop=[]), chat=True, model="m",
                        index=i)
        if i == fail:
            async def broken():
                raise RuntimeError("a bug")
                yield  # an async generator that raises at its first step
            run.chunks = broken
        runs.append(run)
    return admission, runs


def test_a_choice_that_fails_by_a_bug_ends_the_stream_with_an_error_and_its_session(looping):
    """Not a stream left waiting on the failed choice: an error event, [DONE], and the session
    of the choice that failed cancelled (the others had ended)."""
    from verifier_node.http_choice import stream_choices

    admission, runs = _choices(looping.tokenizer, 3, fail=1)

    async def read() -> list[str]:
        return [c async for c in stream_choices(runs, include_usage=True)]

    events = asyncio.run(asyncio.wait_for(read(), 30))
    assert events[-1] == "data: [DONE]\n\n"
    error = json.loads(events[-2][len("data: "):])
    assert error == {"error": {"message": "generation failed: internal error",
                               "type": "server_error", "param": None, "code": None}}
    assert admission.scheduler.cancelled == [runs[1].ticket.session_id]


def test_choices_are_admitted_only_where_all_fit(looping):
    """No room for every choice: a 429 with none admitted (two requests of several choices
    would otherwise each take part of the room and both be refused)."""
    from verifier_node.http_api import _admit_choices
    from verifier_node.openai_params import ApiError

    admitted = []
    admission = SimpleNamespace(scheduler=_Scheduler(room=2),
                                admit=lambda g: admitted.append(g))
    one = SimpleNamespace(params=SimpleNamespace(seed=None))
    params = SimpleNamespace(n=3, generation=one, generations=[one], batch=[])
    with pytest.raises(ApiError) as e:
        asyncio.run(_admit_choices(admission, params, True, asyncio.Lock()))
    assert e.value.status == 429 and admitted == []
    # a batch of two prompts, one choice each: the same, before any prompt is encoded (a
    # request refused for room costs no prompt's work)
    checked = []
    admission.checked_prompt = lambda g: checked.append(g) or [1, 2]
    from verifier_node.admission import GenerationRequest

    prompt = GenerationRequest(prompt="hi")
    batch = SimpleNamespace(n=2, generation=prompt, generations=[prompt, prompt],
                            batch=[prompt])
    with pytest.raises(ApiError) as e:
        asyncio.run(_admit_choices(admission, batch, False, asyncio.Lock()))
    assert e.value.status == 429 and admitted == [] and checked == []
    from verifier_node.api_errors import error_response
    from verifier_node.http_api import OVERLOADED_RETRY_S

    assert e.value.retry_after_s == OVERLOADED_RETRY_S  # said in a Retry-After header
    sent = error_response(e.value.status, str(e.value), e.value.kind, e.value.param,
                          e.value.code, e.value.retry, retry_after_s=e.value.retry_after_s)
    assert sent.headers["retry-after"] == "1"


def test_the_choices_of_one_prompt_share_its_encoding(looping):
    """n choices of a prompt: it is encoded once (a prompt with images decoded once, where
    each choice decoded them again: n = 3 cost three times one's seconds), each choice
    admitted with it, choice i with the request's seed + i."""
    from verifier_node.admission import GenerationRequest
    from verifier_node.http_api import _admit_choices

    encodes, admitted = [], []
    admission = SimpleNamespace(scheduler=_Scheduler(room=3), admit=admitted.append,
                                prompt_ids=lambda g: encodes.append(g) or ([5, 6, 7], None))
    prompt = GenerationRequest(prompt="hi", params=SamplingParams(seed=7))
    params = SimpleNamespace(n=3, generation=prompt, generations=[prompt], batch=[])
    asyncio.run(_admit_choices(admission, params, True, asyncio.Lock()))
    assert len(encodes) == 1 and [g.encoded for g in admitted] == [([5, 6, 7], None)] * 3
    assert [g.params.seed for g in admitted] == [7, seed_after(7, 1), seed_after(7, 2)]


def test_requests_with_images_take_turns_on_the_event_loop_not_in_worker_threads():
    """A request with images to decode waits for its turn (two at once) on the event loop:
    waiting in a worker thread, image requests held the threads every other request needs
    (a text request's body parse waited 4 s behind 200 of them)."""
    import threading

    from verifier_node.admission import GenerationRequest, VISION_ENCODES
    from verifier_node.http_api import _admitted

    inside, most, release = [0], [0], threading.Event()
    lock = threading.Lock()

    def decode(g):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        release.wait(30)
        with lock:
            inside[0] -= 1
        return g.prompt

    async def run():
        images = [asyncio.create_task(_admitted(decode, GenerationRequest(
            prompt=f"p{i}", images=[b"png"]), True)) for i in range(6)]
        while inside[0] < VISION_ENCODES:
            await asyncio.sleep(0.01)
        text = await _admitted(lambda g: g.prompt, GenerationRequest(prompt="text"), True)
        held = most[0]
        release.set()
        return text, held, await asyncio.gather(*images)

    text, held, done = asyncio.run(asyncio.wait_for(run(), 60))
    assert text == "text" and held == VISION_ENCODES  # the other four waited on the loop
    assert done == [f"p{i}" for i in range(6)] and most[0] == VISION_ENCODES


def test_a_full_queue_is_a_429_that_says_when_to_retry():
    """Admission's QueueFull (every slot running, the queue full) answers 429 ``overloaded``
    with a Retry-After, as a request refused for its choices' room does."""
    from verifier_node.admission import GenerationRequest
    from verifier_node.http_api import OVERLOADED_RETRY_S, _admitted
    from verifier_node.openai_params import ApiError
    from verifier_node.tickets import QueueFull

    def full(_g):
        raise QueueFull("8 sessions are running and 64 waiting")

    with pytest.raises(ApiError) as e:
        asyncio.run(_admitted(full, GenerationRequest(prompt="hi"), True))
    assert (e.value.status, e.value.code) == (429, "overloaded")
    assert e.value.retry_after_s == OVERLOADED_RETRY_S and "64 waiting" in str(e.value)


def test_a_whole_response_is_rendered_a_choice_at_a_time_with_jsonresponses_bytes():
    """``rendered`` gives JSONResponse's bytes (a JSON encoder's call holds the interpreter's
    lock throughout: one call over a 17 MB response held /health a second)."""
    from fastapi.responses import JSONResponse

    from verifier_node.http_choice import rendered

    choice = {"index": 0, "text": 'a "choices":[] \u00e9\u4e2d\U0001f600 \\',
              "finish_reason": "length",
              "logprobs": {"tokens": ["x", "\u0000"], "token_logprobs": [-0.5, -1e-30],
                           "top_logprobs": [{"x": -0.5}, {}]}}
    body = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m\u00e9",
            "system_fingerprint": "k", "choices": [choice, {**choice, "index": 1}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
            "edgespec": [{"choices": []}, {"tokens": 2}]}
    nested_first = {"meta": {"choices": []}, **body}  # the key inside a value, before it
    for b in (body, {**body, "choices": [choice]}, {**body, "choices": []}, nested_first):
        got = rendered(b)
        assert got.body == JSONResponse(b).body
        assert got.media_type == "application/json"
        assert json.loads(got.body) == b
