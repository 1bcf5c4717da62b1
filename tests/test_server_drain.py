"""Stopping the composed server in process (real gRPC on loopback, embedded Redis): a drain
refuses new sessions and says so, health says the server drains, a drain can be ended and its
log says how it ended, a request the drain cuts short is told to send it again; and before the
model is loaded, an HTTP request is told when to come back."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from edgespec.config import EngineConfig
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec_cli.server import EdgespecServer, ServerOptions

# the in-process server: its fixture (used by name) and helpers
from server_harness import NOT_SERVING, SERVING, _wait_status, server  # noqa: F401

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier


def test_a_draining_verifier_refuses_new_sessions_as_unavailable(server):
    server.scheduler.drain(0)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.VerifierStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt_ids=[1, 5, 6]), timeout=60))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_an_sdk_call_during_a_drain_fails_at_once_with_the_draining_message(server):
    """The SDK does not retry a new session against a draining verifier until its deadline (it
    would be refused until the verifier stops): it raises Unavailable with the server's words."""
    import edgespec

    _wait_status(server.port, SERVING)
    server.scheduler.drain(0)
    with edgespec.Client(f"127.0.0.1:{server.port}", timeout=300) as client:
        with pytest.raises(edgespec.Unavailable, match="the verifier is draining"):
            client.generate("hello", max_new_tokens=4)


def _hold_steps_once_a_session_has_tokens(srv, monkeypatch) -> threading.Event:
    """Once a session has tokens, the server's steps wait until the returned event is set: the
    session is still running when asked, however the threads are scheduled (the tiny model may
    end "hello" within a few steps)."""
    engine = srv.scheduler.engine
    runner, release = engine.target, threading.Event()
    score_rows = runner.score_rows

    def held(*a, **k):
        if any(act.output for act in engine.active):
            release.wait(120)
        return score_rows(*a, **k)

    monkeypatch.setattr(runner, "score_rows", held)
    return release


def _held_session(tiny_dir, monkeypatch, drain_timeout_s: float, max_new_tokens: int):
    """A started server whose steps hold once a session has tokens (the drain waits for it),
    a client, its stream's first read and the server's stop as threads not yet started."""
    import edgespec

    srv = EdgespecServer(ServerOptions(
        listen="127.0.0.1:0", model=str(tiny_dir), max_drafters=1,
        drain_timeout_s=drain_timeout_s,
        engine=EngineConfig(max_sessions=2, max_context=256))).start()
    release = _hold_steps_once_a_session_has_tokens(srv, monkeypatch)
    client = edgespec.Client(f"127.0.0.1:{srv.port}", timeout=300, max_resumes=0)
    stream = client.stream("hello", max_new_tokens=max_new_tokens, raw=True)
    first = threading.Thread(target=lambda: next(iter(stream)), daemon=True)
    stopping = threading.Thread(target=srv.stop, daemon=True)
    return srv, release, client, first, stopping


def test_health_says_the_server_is_draining_while_it_drains(tiny_dir, monkeypatch):
    """From SIGTERM (``stop``) until the server stops, health is NOT_SERVING and says why: a
    status read meanwhile (``edgespec status``) names the drain, not "no reason given"."""
    from edgespec_cli.server import STOPPING

    srv, release, client, first, stopping = _held_session(tiny_dir, monkeypatch, 120, 8)
    try:
        first.start()
        first.join(120)
        assert not first.is_alive()  # the first tokens came: the session runs
        stopping.start()
        _wait_status(srv.port, NOT_SERVING)
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            status = pb_grpc.VerifierStub(ch).Status(pb.StatusRequest(), timeout=30)
        assert status.unhealthy_reason == STOPPING and STOPPING.startswith("draining")
    finally:
        release.set()
        if stopping.ident is None:  # failed before the drain began
            srv.stop(drain_timeout_s=0)
        stopping.join(120)
        client.close()
    assert not stopping.is_alive()


def test_an_http_request_a_drain_cuts_short_is_told_to_send_it_again(tiny_dir, monkeypatch):
    """A request still running when the drain ends: a 503 saying the verifier is shutting down
    and to send the request again (an HTTP client has no session to resume, as the SDK has).
    The engine's steps stop once the session has tokens, until the stop has begun, so the
    session is surely cut short."""
    import http.client
    import json

    srv = EdgespecServer(ServerOptions(
        listen="127.0.0.1:0", model=str(tiny_dir), max_drafters=1, drain_timeout_s=0,
        http_port=0, engine=EngineConfig(max_sessions=2, max_context=256))).start()
    engine, scheduler = srv.scheduler.engine, srv.scheduler
    step = engine.step

    def held():
        if any(act.output for act in engine.active):
            scheduler._stopping.wait(120)  # no step more: the stop finds the session running
            return None
        return step()

    monkeypatch.setattr(engine, "step", held)
    got: dict = {}

    def ask() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=120)
        conn.request("GET", "/v1/models")
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": model, "prompt": "hello", "max_tokens": 200, "temperature": 0}),
            {"Content-Type": "application/json"})
        reply = conn.getresponse()
        got["status"], got["body"] = reply.status, json.loads(reply.read())

    asking = threading.Thread(target=ask, daemon=True)
    try:
        asking.start()
        deadline = time.monotonic() + 120
        while not any(act.output for act in engine.active):
            assert time.monotonic() < deadline and asking.is_alive(), got
            time.sleep(0.01)
    finally:
        srv.stop(drain_timeout_s=0)
    asking.join(60)
    assert got.get("status") == 503, got
    message = got["body"]["error"]["message"]
    assert "shutting down" in message and "send the request again" in message
    assert "resume" not in message


def test_a_drain_can_be_ended_while_sessions_run(server, monkeypatch):
    """What a third Ctrl-C does: the drain stops waiting for the sessions still running."""
    import threading

    import edgespec

    _wait_status(server.port, SERVING)
    release = _hold_steps_once_a_session_has_tokens(server, monkeypatch)
    client = edgespec.Client(f"127.0.0.1:{server.port}", timeout=300, max_resumes=0)
    stream = client.stream("hello", max_new_tokens=200, raw=True)
    started = threading.Thread(target=lambda: next(iter(stream)), daemon=True)
    try:
        started.start()
        started.join(120)
        assert not started.is_alive()  # the first tokens came
        assert server.scheduler.sessions_left() == 1
        abort = threading.Event()
        abort.set()
        assert server.scheduler.drain(300, abort) is False  # returns at once, a session left
        assert server.scheduler.sessions_left() == 1
    finally:
        release.set()
    client.close()



def test_a_drain_ended_by_a_third_signal_says_so_and_not_that_it_timed_out(tiny_dir,
                                                                           monkeypatch, caplog):
    """The log of a drain a third Ctrl-C ends names the signal and the time it really took,
    where it said "timed out after 30s" a moment after the first signal."""
    import logging

    srv, release, client, first, stopping = _held_session(tiny_dir, monkeypatch, 300, 200)
    caplog.set_level(logging.WARNING, logger="edgespec")
    try:
        first.start()
        first.join(120)
        assert not first.is_alive()  # the first tokens came: the session runs, held
        srv._abort_drain.set()  # what the third signal sets (``wait``'s handler)
        stopping.start()
        deadline = time.monotonic() + 120
        while not any("drain ended" in r.getMessage() for r in caplog.records) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        release.set()
        if stopping.ident is None:
            srv.stop(drain_timeout_s=0)
        stopping.join(120)
        client.close()
    assert not stopping.is_alive()
    said = [r.getMessage() for r in caplog.records if "drain ended" in r.getMessage()]
    assert len(said) == 1 and "a third signal ended it" in said[0], said
    assert "timed out" not in said[0]


def test_an_http_request_while_the_model_loads_is_told_when_to_come_back(tiny_dir):
    """Between the HTTP port's opening and the model's load (``__init__`` until ``start``):
    503 "loading" with ``Retry-After``, which the official client reads (it waits that long
    before its retry); /health says 503 too. Once started, the same call is answered."""
    import urllib.error
    import urllib.request

    import openai

    from verifier_node.http_api import LOADING_RETRY_S

    srv = EdgespecServer(ServerOptions(
        listen="127.0.0.1:0", http_port=0, model=str(tiny_dir), max_drafters=1,
        engine=EngineConfig(max_sessions=2, max_context=256)))
    started = False
    try:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="unused",
                            max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as refused:
            api.models.list()
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"] == str(int(LOADING_RETRY_S))
        assert "still loading" in refused.value.message
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"http://127.0.0.1:{srv.http_port}/health", timeout=60)
        assert health.value.code == 503
        srv.start()
        started = True
        assert [m.id for m in api.models.list().data]  # the model, once loaded
    finally:
        if started:
            srv.stop(drain_timeout_s=0)
        else:  # never started: its ports and store closed all the same
            srv.start().stop(drain_timeout_s=0)
