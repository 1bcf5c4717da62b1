"""The HTTP API's text at an output's end (``verifier_node.http_choice.ChoiceRun``): an output
that ends mid-character (a length cut) flushes its last bytes as U+FFFD, and a stop string that the
flushed text completes cuts it there, as it does anywhere else. Driven on a ticket the
scheduler would have finished, with the default model's byte-level tokenizer (its files only)."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import pytest

from edgespec.engine.generation import Request, Result
from edgespec.protocol.request_stats import Stats
from edgespec.protocol.token_logprob import TokenLogprob
from verifier_node.http_choice import ChoiceRun, stream_choices
from verifier_node.logprob_shapes import LogprobShapes
from verifier_node.tickets import Ticket

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from edgespec.models.loading import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("default")[0])


class _Admission:
    """What ``ChoiceRun`` reads of the admission: the tokenizer, a follow, a cancel."""

    def __init__(self, tokenizer):
        self.tokenizer, self.kernels = tokenizer, "test"
        self.cancelled: list[str] = []
        self.scheduler = SimpleNamespace(
            cancel=lambda sid, reason=None, orphaned=False: self.cancelled.append(sid))

    @contextlib.contextmanager
    def follow(self, ticket):
        yield ticket


def _text(tokenizer, output: list[int], stop: list[str]) -> tuple[str, str | None]:
    ticket = Ticket(Request([1, 2, 3], len(output)), None)
    ticket.tokens = list(output)
    ticket.result = Result(list(output), Stats(tokens=len(output)), "length")
    run = ChoiceRun(_Admission(tokenizer), ticket, SimpleNamespace(stop=stop, echo=False),
                    chat=False, model="m")

    async def collect() -> list[str]:
        return [piece async for piece in run._events()]

    return "".join(asyncio.run(collect())), run.finish_reason


def test_a_stop_string_the_flushed_last_bytes_complete_cuts_the_text(tokenizer):
    lead = tokenizer.convert_tokens_to_ids("Ã")  # the byte 0xC3: a 2-byte character's half
    assert tokenizer.decode([lead]) == "\ufffd"
    output = tokenizer.encode("Hi there", add_special_tokens=False) + [lead]
    assert _text(tokenizer, output, []) == ("Hi there\ufffd", "length")
    # the stop is in the flushed text only: it was sent, with finish_reason "length"
    assert _text(tokenizer, output, ["\ufffd"]) == ("Hi there", "stop")
    assert _text(tokenizer, output, ["e\ufffd"]) == ("Hi ther", "stop")
    assert _text(tokenizer, output, ["there"]) == ("Hi ", "stop")  # before the end, as before


def test_a_stream_never_read_is_cancelled_after_its_response(tokenizer):
    """A client gone before the streamed response's first read never followed its ticket (no
    reader's leaving cancels it): the response's background cancels it as an orphan; one that
    was read is left to its readers."""
    ticket = Ticket(Request([1, 2, 3], 4), None)
    admission = _Admission(tokenizer)
    run = ChoiceRun(admission, ticket, SimpleNamespace(stop=[], echo=False), chat=False, model="m")
    run.cancel_if_never_read()
    assert admission.cancelled == [ticket.session_id]
    read = _Admission(tokenizer)
    ticket.tokens, ticket.result = [5], Result([5], Stats(tokens=1), "length")
    run = ChoiceRun(read, ticket, SimpleNamespace(stop=[], echo=False), chat=False, model="m")

    async def collect() -> list[str]:
        return [piece async for piece in run._events()]

    asyncio.run(collect())
    run.cancel_if_never_read()
    assert read.cancelled == []


def _logprob_run(tokenizer, text: str, stop: list[str], chat: bool
                 ) -> tuple[ChoiceRun, list[int]]:
    """A run over a finished ticket whose output is ``text``, each token given a made-up
    logprob (-its position), as the scheduler publishes them."""
    output = tokenizer.encode(text, add_special_tokens=False)
    ticket = Ticket(Request([1, 2, 3], len(output), logprobs=0), None)
    ticket.add_logprobs([TokenLogprob(t, -float(i)) for i, t in enumerate(output)])
    ticket.tokens = list(output)
    ticket.result = Result(list(output), Stats(tokens=len(output)), "length")
    run = ChoiceRun(_Admission(tokenizer), ticket,
               SimpleNamespace(stop=stop, include_usage=False, echo=False), chat=chat, model="m",
               shapes=LogprobShapes(tokenizer))
    return run, output


def test_completions_text_offsets_count_a_split_character_once(tokenizer):
    """A character split across tokens: the offsets are where each token's text begins in the
    completion as decoded, not sums of the tokens' own texts (each part shown as U+FFFD)."""
    text = " I \U0001F600 you"
    run, output = _logprob_run(tokenizer, text, [], chat=False)

    async def collect() -> str:
        return "".join([piece async for piece in run._events()])

    assert asyncio.run(collect()) == text
    shaped = run.logprobs.upto(run.completion_tokens)
    offsets = shaped["text_offset"]
    assert len(offsets) == len(output) and offsets == sorted(offsets)
    assert offsets[0] == 0 and offsets[-1] == text.index(" you")
    assert shaped["token_logprobs"] == [-float(i) for i in range(len(output))]


def test_streamed_logprobs_go_with_the_chunk_their_text_begins_in(tokenizer):
    """With a stop string the text is held back: a chunk carries the logprobs of the tokens
    whose text begins in what has been sent by then; the last chunk the rest (the tokens that
    completed the stop string and past it)."""
    import json

    text = "one, two, three, four, five, six"
    run, output = _logprob_run(tokenizer, text, [", four"], chat=True)

    async def collect() -> list[dict]:
        return [json.loads(c[len("data: "):]) async for c in stream_choices([run], False)
                if c.startswith("data: {")]

    chunks = asyncio.run(collect())
    pieces = [tokenizer.decode([t]) for t in output]
    starts = [len("".join(pieces[:i])) for i in range(len(pieces))]  # ASCII: exact
    sent, given = "", 0
    for chunk in chunks[:-1]:
        sent += chunk["choices"][0]["delta"].get("content", "")
        content = chunk["choices"][0]["logprobs"]["content"]
        assert [c["logprob"] for c in content] == [-float(i) for i in
                                                   range(given, given + len(content))]
        given += len(content)
        assert given == sum(s < len(sent) for s in starts), (sent, given)
    assert sent == "one, two, three"
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "stop"
    assert given + len(last["logprobs"]["content"]) == run.completion_tokens
    assert run.completion_tokens == len(tokenizer.encode("one, two, three, four",
                                                          add_special_tokens=False))


def test_a_stream_searches_for_its_stops_only_where_one_may_begin(tokenizer, monkeypatch):
    """Each token's search for the stop strings starts where a stop could begin in the text
    that came with it (a search of the whole text at every token cost a 32,768-token output
    seconds on the event loop), and still cuts the text where the first stop begins, across
    tokens."""
    from verifier_node import http_choice

    searched = []
    find = http_choice._find_stop

    def recorded(text, stops, since=0):
        searched.append((len(text), since))
        return find(text, stops, since)

    monkeypatch.setattr(http_choice, "_find_stop", recorded)
    whole = "one two three " * 200 + "three STOP here"
    output = tokenizer.encode(whole, add_special_tokens=False)
    stops = ["@@", "three STOP"]
    assert _text(tokenizer, output, stops) == (whole[:whole.find("three STOP")], "stop")
    hold = len("three STOP") - 1
    assert len(searched) > 500 and searched[0][1] == 0
    for (before, _), (_, since) in zip(searched, searched[1:]):
        assert since == max(0, before - hold)
