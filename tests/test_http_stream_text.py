"""The HTTP API's text at an output's end (``verifier_node.http_api._Run``): an output that
ends mid-character (a length cut) flushes its last bytes as U+FFFD, and a stop string that the
flushed text completes cuts it there, as it does anywhere else. Driven on a ticket the
scheduler would have finished, with the default model's byte-level tokenizer (its files only)."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import pytest

from edgespec.engine.generation import Request, Result
from edgespec.protocol.request_stats import Stats
from verifier_node.http_api import _Run
from verifier_node.tickets import Ticket

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from edgespec.models.loading import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("default")[0])


class _Admission:
    """What ``_Run`` reads of the admission: the tokenizer, a follow, a cancel."""

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
    run = _Run(_Admission(tokenizer), ticket, SimpleNamespace(stop=stop), chat=False, model="m")

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
    run = _Run(admission, ticket, SimpleNamespace(stop=[]), chat=False, model="m")
    run.cancel_if_never_read()
    assert admission.cancelled == [ticket.session_id]
    read = _Admission(tokenizer)
    ticket.tokens, ticket.result = [5], Result([5], Stats(tokens=1), "length")
    run = _Run(read, ticket, SimpleNamespace(stop=[]), chat=False, model="m")

    async def collect() -> list[str]:
        return [piece async for piece in run._events()]

    asyncio.run(collect())
    run.cancel_if_never_read()
    assert read.cancelled == []
