"""Drafters draft again within moments of the cache's Redis serving again.

A cache that answers but cannot serve a drafter yet (its Redis unreachable or restarted, no
target registered) refuses the Attach with UNAVAILABLE and a retry hint (trailing metadata
``retry-after-ms``); the agent comes back after the hint instead of doubling its backoff, which
is kept for a cache that does not answer at all. A Redis that restarted without persistence
forgot the drafters' registrations (no session would be assigned to them): the cache ends their
streams with the same hint, and they attach again.

No timing assertions: the backoff decision is checked as a function (``next_backoff``) on real
refusals, and the end-to-end recovery (a real redis-server killed and restarted under
``edgespec serve`` and a MaG drafter) only within a generous bound.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import tempfile
import time
from concurrent import futures

import grpc
import pytest
import redis
from conftest import hf_greedy

import edgespec
from cache_service.redis_conn import RedisHandle, embedded_redis_binary
from cache_service.service import RETRY_AFTER_MS, DraftCacheService
from cache_service.store import RedisSessionStore
from drafter_node.agent import (BACKOFF_START_S, FAST_START_S, FIRST_ATTACH_BACKOFF_MAX_S,
                                MIN_RETRY_S, next_backoff)
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire.convert import RETRY_AFTER_MD, retry_after_s
from edgespec.wire.channels import bind, free_port
from procs import start_drafter, start_serve, wait_healthy
from redis_servers import SYSTEM_REDIS

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier

TOKEN = "re4ttach"
WAIT_S = 30  # how long a test waits for something that must happen (never a timing assertion)


class _Err(grpc.RpcError):
    def __init__(self, trailing=(), code=grpc.StatusCode.UNAVAILABLE):
        self._trailing, self._code = trailing, code

    def code(self):
        return self._code

    def details(self):
        return "test"

    def trailing_metadata(self):
        return self._trailing


# -- the backoff decision -------------------------------------------------------------------------
def test_a_hinted_refusal_is_retried_after_the_hint_and_resets_the_backoff():
    hinted = _Err(((RETRY_AFTER_MD, "500"),))
    assert next_backoff(8.0, hinted, 10.0, jitter=0.5) == (0.5, BACKOFF_START_S)
    assert next_backoff(8.0, _Err(((RETRY_AFTER_MD, "60000"),)), 10.0, jitter=0.5)[0] == 10.0
    # no hint (no cache answering), or a stream that ended: the doubling backoff
    assert next_backoff(0.8, _Err(), 10.0, jitter=0.5) == (0.8, 1.6)
    assert next_backoff(8.0, _Err(), 10.0, jitter=0.5) == (8.0, 10.0)
    assert next_backoff(0.2, None, 10.0, jitter=0.5) == (0.2, 0.4)
    # a hint of 0 (a broken cache) still waits: never a loop of attaches
    assert next_backoff(8.0, _Err(((RETRY_AFTER_MD, "0"),)), 10.0, jitter=0.5) == \
        (MIN_RETRY_S, BACKOFF_START_S)
    low, _ = next_backoff(1.0, hinted, 10.0, jitter=0.0)
    high, _ = next_backoff(1.0, hinted, 10.0, jitter=1.0)
    assert low == pytest.approx(0.4) and high == pytest.approx(0.6)  # +-20%


def test_a_starting_board_retries_a_silent_cache_at_least_once_a_second():
    """Started beside a server that is loading its model (nothing answers yet), a board that
    has not attached, in its first FAST_START_S, stops doubling its backoff at
    FIRST_ATTACH_BACKOFF_MAX_S, so that it attaches within about a second of the server's ready
    (a 10 s cap left it out of the first requests). A cache that answers with a refusal (full:
    RESOURCE_EXHAUSTED), and any failure past the start, back off to the configured cap; a hint
    is honoured as before."""
    assert FIRST_ATTACH_BACKOFF_MAX_S == 1.0 and FAST_START_S == 60.0
    delay, waits = BACKOFF_START_S, []
    for _ in range(8):
        wait, delay = next_backoff(delay, _Err(), 10.0, jitter=0.5, starting=True)
        waits.append(wait)
    assert waits[:3] == pytest.approx([0.2, 0.4, 0.8]) and max(waits) == pytest.approx(1.0)
    assert next_backoff(1.0, None, 10.0, jitter=0.5, starting=True) == (1.0, 1.0)
    assert next_backoff(1.0, _Err(), 10.0, jitter=0.5) == (1.0, 2.0)  # not starting
    assert next_backoff(0.4, _Err(), 0.5, jitter=0.5, starting=True) == (0.4, 0.5)
    full = _Err(code=grpc.StatusCode.RESOURCE_EXHAUSTED)  # a cache that answers: no hurry
    assert next_backoff(1.0, full, 10.0, jitter=0.5, starting=True) == (1.0, 2.0)
    hinted = _Err(((RETRY_AFTER_MD, "3000"),))  # a live cache's hint: not cut to the cap
    assert next_backoff(1.0, hinted, 10.0, jitter=0.5, starting=True)[0] == 3.0


@pytest.mark.parametrize("starting", [True, False])
def test_the_agent_retries_fast_only_while_it_starts(monkeypatch, starting):
    """The agent's own loop, against an address nothing listens at: in its first
    FAST_START_S, never attached, its waits stop at FIRST_ATTACH_BACKOFF_MAX_S; past that
    window they double on (scaled down: the decisions, not their timing, are what is read)."""
    import threading

    import drafter_node.agent as agent_mod
    from cache_harness import SlotDrafter

    monkeypatch.setattr(agent_mod, "BACKOFF_START_S", 0.01)
    monkeypatch.setattr(agent_mod, "FIRST_ATTACH_BACKOFF_MAX_S", 0.05)
    monkeypatch.setattr(agent_mod, "FAST_START_S", 600.0 if starting else 0.0)
    waits: list[float] = []
    agent = agent_mod.DrafterAgent(f"127.0.0.1:{free_port()}", "edge-starting", SlotDrafter())
    monkeypatch.setattr(agent, "_log_retry", lambda error, wait, **_: waits.append(wait))
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while len(waits) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        agent.stop()
        t.join(WAIT_S)
    assert len(waits) >= 6 and agent.attaches == 0
    if starting:
        assert max(waits) <= 0.05 * 1.2
    else:
        assert max(waits) > 0.05 * 1.2  # 0.01 doubled five times: 0.32, jittered


@pytest.mark.parametrize("value,want", [("250", 0.25), ("0", 0.0), ("nan", None),
                                        ("-5", None), ("inf", None), ("soon", None)])
def test_retry_hints_are_read_only_when_sane(value, want):
    assert retry_after_s(_Err(((RETRY_AFTER_MD, value),))) == want
    assert retry_after_s(_Err((("other", "250"),))) is None


# -- real refusals from a cache on loopback -------------------------------------------------------
@pytest.fixture()
def cache():
    handle = RedisHandle()
    store = RedisSessionStore(handle.client, prefix="r:", ttl_s=60)
    server = grpc.server(futures.ThreadPoolExecutor(8))
    service = DraftCacheService(store, window=8, chunk=4, poll_ms=100)
    pb_grpc.add_DraftCacheServicer_to_server(service, server)
    port = bind(server, "127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield store, channel
    channel.close()
    service.stop()
    server.stop(0)
    store.shutdown()
    handle.close()


def attach(channel, device="d1"):
    """An Attach call that registers ``device`` and reads until the stream ends: (the
    messages, the error it ended with or None)."""
    out: queue.Queue = queue.Queue()
    out.put(pb.DrafterMessage(register=pb.Register(device_id=device, draft_model="test")))
    call = pb_grpc.DraftCacheStub(channel).Attach(iter(out.get, None), timeout=WAIT_S)
    got = []
    try:
        for msg in call:
            got.append(msg.WhichOneof("kind"))
            yield got, None
    except grpc.RpcError as e:
        yield got, e
    finally:
        out.put(None)
        call.cancel()


def test_a_live_cache_that_cannot_serve_yet_is_retried_after_its_hint(cache):
    store, channel = cache  # no verifier has registered a target
    _, err = next(g for g in attach(channel) if g[1] is not None)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert retry_after_s(err) == RETRY_AFTER_MS / 1000
    wait, delay = next_backoff(10.0, err, 10.0, jitter=0.5)
    assert wait == RETRY_AFTER_MS / 1000 and delay == BACKOFF_START_S
    # no cache at all: UNAVAILABLE without a hint, the doubling backoff
    with grpc.insecure_channel(f"127.0.0.1:{free_port()}") as nowhere:
        _, gone = next(g for g in attach(nowhere) if g[1] is not None)
    assert gone.code() == grpc.StatusCode.UNAVAILABLE and retry_after_s(gone) is None
    assert next_backoff(0.8, gone, 10.0, jitter=0.5) == (0.8, 1.6)


def test_a_redis_that_forgot_a_drafter_sends_it_to_attach_again(cache):
    store, channel = cache
    store.set_target({"model": "tiny", "fingerprint": "fp", "vocab_size": 100})
    stream = attach(channel)
    got, err = next(stream)
    assert got == ["registered"] and err is None
    store.redis.delete(store.keys.devices)  # what a Redis restarted without persistence forgot
    got, err = next(g for g in stream if g[1] is not None)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "registration" in err.details()
    assert retry_after_s(err) == RETRY_AFTER_MS / 1000
    again = attach(channel)  # attaching again registers it again
    assert next(again) == (["registered"], None)
    assert store.redis.hexists(store.keys.devices, "d1")
    again.close()


# -- end to end: a real redis-server killed and restarted ------------------------------------------
class RestartableRedis:
    """A redis-server without persistence (the fault soak's) on a fixed port."""

    def __init__(self):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="es-reattach-redis-")
        self.binary = SYSTEM_REDIS if os.path.exists(SYSTEM_REDIS) else embedded_redis_binary()
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        client.close()

    def kill(self) -> int:
        self.proc.send_signal(signal.SIGKILL)
        return self.proc.wait(timeout=WAIT_S)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=WAIT_S)
        shutil.rmtree(self.dir, ignore_errors=True)


def test_drafters_draft_again_after_redis_is_killed_and_restarted(looping, looping_dir,
                                                                  tmp_path):
    prompt = [1, 10, 11, 12, 13, 10, 11]
    ref = hf_greedy(looping.model, prompt, 60)
    server = RestartableRedis()
    serve = drafter = None
    try:
        # each step waits for the board's drafts (whether they are verified does not depend on
        # how a loaded machine times the board against the steps)
        serve, address = start_serve(looping_dir, tmp_path, redis_url=server.url, token=TOKEN,
                                     extra=("--no-adaptive", "--draft-wait-ms", 5000))
        drafter = start_drafter(address, "d1", tmp_path, token=TOKEN)
        drafter.wait_for("attached to")
        with edgespec.Client(address, token=TOKEN, timeout=120) as c:
            before = c.generate(prompt_ids=prompt, max_new_tokens=60)
        assert before.token_ids == ref and before.stats["accepted"] > 0
        assert server.kill() == -signal.SIGKILL
        server.start()  # empty: the target, the drafter's registration and sessions are gone
        deadline = time.monotonic() + 90  # generous: the fix brings it back in about a second
        while drafter.text().count("attached to") < 2:
            assert time.monotonic() < deadline, f"the drafter never came back:\n{drafter.text()}"
            assert drafter.popen.poll() is None, drafter.text()
            time.sleep(0.2)
        wait_healthy(address)
        with edgespec.Client(address, token=TOKEN, timeout=120) as c:
            after = c.generate(prompt_ids=prompt, max_new_tokens=60)  # not pinned: picked
        assert after.token_ids == ref
        assert after.device_id == "d1" and after.stats["accepted"] > 0  # its drafts are taken
        assert drafter.stop() == 0
        drafter = None
        assert serve.stop() == 0
        serve = None
    finally:
        for proc in (drafter, serve):
            if proc is not None:
                proc.stop()
        server.stop()
