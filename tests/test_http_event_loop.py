"""The HTTP server's event loop does none of a request's heavy work: a completions request with
``echo`` has its prompts' texts decoded (each distinct prompt once however many choices share
it), with ``logprobs`` each choice's echoed prompt logprobs shaped, and a whole response's JSON
rendered, in worker threads.
(On the loop, a batch of long echoed prompts held every other client and /health for as long as
its decoding took: a second at 80 choices of 1,000 tokens.) Request bodies are parsed off it
too. The composed server in process
(real gRPC and HTTP on loopback, the embedded Redis, the tiny model), read over plain HTTP."""

from __future__ import annotations

import http.client
import json
import threading

import pytest

from edgespec.config import EngineConfig
from edgespec_cli.server import EdgespecServer, ServerOptions
from verifier_node import http_api, http_choice
from verifier_node.openai_params import parse_request
from verifier_node.logprob_shapes import LogprobShapes

LOOP_THREAD = "http"  # the thread uvicorn's event loop runs in (``EdgespecServer``)
PROMPTS = ["hello there", "general kenobi"]
CHOICES = 3


def _post(port: int, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


@pytest.fixture()
def threads_seen(monkeypatch):
    """The threads that built the choices, decoded prompts and shaped echoed logprobs."""
    seen: dict[str, list] = {"choice": [], "decoded": [], "echoed": [], "rendered": [],
                             "parsed": []}
    here = threading.current_thread
    init, decoded, echoed, render = (http_choice.ChoiceRun.__init__, http_choice.decoded,
                                     LogprobShapes.echoed, http_choice.rendered)

    def choice_init(self, *a, **k):
        seen["choice"].append(here().name)
        init(self, *a, **k)

    def decode(tokenizer, ids):
        seen["decoded"].append((tuple(ids), here().name))
        return decoded(tokenizer, ids)

    def shape(self, *a):
        seen["echoed"].append(here().name)
        return echoed(self, *a)

    def rendered(body):
        seen["rendered"].append(here().name)
        return render(body)

    def parse(*a):
        seen["parsed"].append(here().name)
        return parse_request(*a)

    monkeypatch.setattr(http_api, "parse_request", parse)
    monkeypatch.setattr(http_choice.ChoiceRun, "__init__", choice_init)
    monkeypatch.setattr(http_choice, "rendered", rendered)
    monkeypatch.setattr(http_choice, "decoded", decode)
    monkeypatch.setattr(LogprobShapes, "echoed", shape)
    return seen


def test_echoed_prompts_are_decoded_once_each_and_off_the_event_loop(tiny_dir, threads_seen):
    srv = EdgespecServer(ServerOptions(
        listen="127.0.0.1:0", model=str(tiny_dir), max_drafters=1, drain_timeout_s=0,
        http_port=0, engine=EngineConfig(max_sessions=8, max_context=256))).start()
    try:
        model = srv.model_name
        body = {"model": model, "prompt": PROMPTS, "n": CHOICES, "echo": True, "max_tokens": 3,
                "temperature": 0, "logprobs": 1}
        status, raw = _post(srv.http_port, body)
        assert status == 200, raw
        whole = json.loads(raw)["choices"]
        status, raw = _post(srv.http_port, {**body, "prompt": PROMPTS[0], "stream": True})
        assert status == 200, raw
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
    finally:
        srv.stop(drain_timeout_s=0)
    assert len(whole) == len(PROMPTS) * CHOICES
    texts = {ids: name for ids, name in threads_seen["decoded"]}
    # each choice's text begins with its prompt's as decoded, the n choices of a prompt alike
    for k, prompt in enumerate(PROMPTS):
        got = [c["text"] for c in whole[k * CHOICES:(k + 1) * CHOICES]]
        assert len(set(got)) == 1 and got[0].startswith(prompt), got
        assert whole[k * CHOICES]["logprobs"]["token_logprobs"][0] is None  # the prompt's first
    streamed = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    assert streamed.startswith(PROMPTS[0]) and len(streamed) > len(PROMPTS[0])
    # the batch decoded each of its two prompts once, the streamed request its one prompt
    assert len(threads_seen["decoded"]) == len(PROMPTS) + 1 and len(texts) == len(PROMPTS)
    # the choices are built on the event loop (what the name tells apart), the rest is not
    assert set(threads_seen["choice"]) == {LOOP_THREAD}
    assert threads_seen["decoded"] and all(
        name != LOOP_THREAD for _, name in threads_seen["decoded"])
    # every echoed choice's prompt logprobs: the batch's six, the stream's three
    assert len(threads_seen["echoed"]) == len(PROMPTS) * CHOICES + CHOICES
    assert LOOP_THREAD not in threads_seen["echoed"]
    # the whole response's JSON (six choices' prompts and logprobs) rendered off the loop too
    assert len(threads_seen["rendered"]) == 1 and LOOP_THREAD not in threads_seen["rendered"]
    # and each request body parsed off it (a body of millions of values within the body limit
    # held /health and every stream for seconds)
    assert len(threads_seen["parsed"]) == 2 and LOOP_THREAD not in threads_seen["parsed"]
