"""A real DraftCache service on loopback for tests that play a hostile or broken drafter, or a
broken cache against a drafter agent (``test_hostile_drafter``, ``test_agent_faults``): the
embedded Redis's store, the service (``Cache``), a hand-driven Attach stream (``Stream``), a
drafter with few slots that fails on a poisoned prompt (``SlotDrafter``), and the waits they
share. Its fixtures are imported into the test modules that use them."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent import futures

import grpc
import pytest

from cache_service.redis_conn import RedisHandle
from cache_service.service import DEVICE_METADATA, DraftCacheService
from cache_service.store import RedisSessionStore
from drafter_node.agent import DrafterAgent
from edgespec.config import SamplingParams
from edgespec.drafters import Draft, Drafter, DraftSession
from edgespec.runner.kv_cache import CacheFullError
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire.convert import TokenAuthInterceptor, auth_metadata
from edgespec.wire.channels import bind

VOCAB = 100
SAMPLED = SamplingParams(temperature=1.0, seed=3)
WAIT_S = 30  # how long a test waits for something that must happen (never a timing assertion)


def eventually(cond, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


# -- a cache service on loopback ------------------------------------------------------------------
@pytest.fixture(scope="module")
def redis_handle():
    handle = RedisHandle()
    yield handle
    handle.close()


@pytest.fixture()
def store(redis_handle):
    redis_handle.client.flushdb()
    st = RedisSessionStore(redis_handle.client, prefix="h:", ttl_s=60)
    st.set_target({"model": "tiny", "fingerprint": "fp", "vocab_size": VOCAB, "window": 8,
                   "chunk": 4})
    yield st
    st.shutdown()


class Cache:
    """DraftCache (plus the Verifier's unimplemented base servicer, to see what the auth
    interceptor does with Verifier calls) on 127.0.0.1."""

    def __init__(self, store, token=None, credentials=None, tls=(), listen="127.0.0.1:0"):
        interceptors = [TokenAuthInterceptor(token, credentials)] if token or credentials else []
        self.server = grpc.server(futures.ThreadPoolExecutor(16), interceptors=interceptors)
        self.service = DraftCacheService(store, window=8, chunk=4, poll_ms=100,
                                         credentials=credentials)
        pb_grpc.add_DraftCacheServicer_to_server(self.service, self.server)
        pb_grpc.add_VerifierServicer_to_server(pb_grpc.VerifierServicer(), self.server)
        self.port = bind(self.server, listen, *tls)
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()
        self.channel = grpc.insecure_channel(self.address) if not tls else None

    def push(self, chunk, token=None, device=None):
        meta = auth_metadata(token) + ([(DEVICE_METADATA, device)] if device else [])
        return pb_grpc.DraftCacheStub(self.channel).PushDraft(chunk, metadata=meta, timeout=WAIT_S)

    def stop(self):
        if self.channel is not None:
            self.channel.close()
        self.service.stop()
        self.server.stop(0).wait()  # its port free once this returns (a test binds it again)


@pytest.fixture()
def cache(store):
    c = Cache(store)
    yield c
    c.stop()


class Stream:
    """A hand-driven Attach stream: register, send chunks, read what the cache sends."""

    def __init__(self, channel, device, token=None, batches=False, heartbeat_ms=0):
        """``batches``: it reads CacheBatch (each batch's messages go to ``inbox`` one by one,
        and ``batches_heard`` counts the batches); else, as an older board, it is never sent
        one (a batch read fails the test). ``heartbeat_ms``: the interval it announces (the
        cache detaches it after three of silence; 0: never), not one it keeps by itself."""
        self.batches, self.batches_heard = batches, 0
        self.out: queue.Queue = queue.Queue()
        self.out.put(pb.DrafterMessage(register=pb.Register(
            device_id=device, draft_model="test", max_sessions=4, batches=batches,
            heartbeat_ms=heartbeat_ms)))
        self.call = pb_grpc.DraftCacheStub(channel).Attach(iter(self.out.get, None),
                                                            metadata=auth_metadata(token))
        self.inbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for msg in self.call:
                if msg.WhichOneof("kind") != "batch":
                    self.inbox.put(msg)
                    continue
                assert self.batches, "a batch sent to a board that does not read them"
                self.batches_heard += 1
                for inner in msg.batch.messages:
                    assert inner.WhichOneof("kind") != "batch"
                    self.inbox.put(inner)
            self.inbox.put(None)
        except (grpc.RpcError, AssertionError) as e:  # raised by ``next``
            self.inbox.put(e)

    def next(self, kind: str) -> pb.CacheMessage:
        """The next message of ``kind`` (others are skipped); raises the stream's error."""
        deadline = time.monotonic() + WAIT_S
        while True:
            msg = self.inbox.get(timeout=max(0.01, deadline - time.monotonic()))
            if isinstance(msg, (grpc.RpcError, AssertionError)):
                raise msg
            assert msg is not None, f"the stream ended before a {kind!r} message"
            if msg.WhichOneof("kind") == kind:
                return getattr(msg, kind)

    def send(self, chunk: pb.DraftChunk) -> None:
        self.out.put(pb.DrafterMessage(chunk=chunk))

    def close(self):
        self.out.put(None)
        self.call.cancel()


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def draft_len(store, sid) -> int:
    return store.redis.strlen(store.keys.session(sid)[2]) // 4


def drafter_idle(store, sid) -> bool:
    """Whether the session's drafter last said it has nothing more (an idle chunk)."""
    return store.redis.hget(store.keys.session(sid)[0], "idle") == b"1"


# -- 4. mutual TLS --------------------------------------------------------------------------------
class SlotDrafter(Drafter):
    """A drafter with ``slots`` sessions at most (``open`` beyond them raises CacheFullError, as
    a model drafter out of KV slots does); drafts token 7 forever, and fails to draft for a
    prompt starting with ``poison``."""

    name = "slots"

    def __init__(self, slots: int = 8, poison: int = 99):
        self.slots, self.poison, self.open_now = slots, poison, 0

    def open(self, tokens, params):
        if self.open_now >= self.slots:
            raise CacheFullError(f"all {self.slots} KV slots are in use")
        self.open_now += 1
        return _SlotSession(self, tokens, params)


class _SlotSession(DraftSession):
    def __init__(self, drafter, tokens, params):
        super().__init__(tokens, params)
        self.drafter = drafter

    def propose(self, k):
        if self.tokens[0] == self.drafter.poison:
            raise RuntimeError("the draft model fell over")
        self.tokens.extend([7] * k)
        return Draft([7] * k)

    def close(self):
        self.drafter.open_now -= 1


@contextlib.contextmanager
def engine_over_cache(model, prefix: str):
    """An embedded Redis, the draft cache on loopback and a verifier engine (4 slots of 128
    tokens, boards' drafts waited for up to 5 s, none filled) over its store, stepped by the
    test: a dict of its ``address``, ``store``, ``engine``, ``runner`` and a ``channel``."""
    from edgespec.config import EngineConfig
    from edgespec.engine.spec_engine import SpecEngine
    from edgespec.runner.target_runner import TargetRunner

    handle = RedisHandle()
    store = RedisSessionStore(handle.client, prefix=prefix, ttl_s=60)
    runner = TargetRunner(model, n_slots=4, max_len=128)
    store.set_target({"model": "tiny", "fingerprint": "", "vocab_size": runner.vocab_size,
                      "window": 8, "chunk": 4})
    server = grpc.server(futures.ThreadPoolExecutor(8))
    service = DraftCacheService(store, window=8, chunk=4, poll_ms=100)
    pb_grpc.add_DraftCacheServicer_to_server(service, server)
    address = f"127.0.0.1:{bind(server, '127.0.0.1:0')}"
    server.start()
    cfg = EngineConfig(adaptive=False, draft_wait_ms=5000, fill_drafts="none")  # boards' own
    engine = SpecEngine(runner, None, cfg, stop_ids={2}, store=store)
    channel = grpc.insecure_channel(address)
    try:
        yield {"address": address, "store": store, "engine": engine, "runner": runner,
               "channel": channel}
    finally:
        channel.close()
        service.stop()
        server.stop(0)
        store.shutdown()
        handle.close()


def start_agent(agent: DrafterAgent) -> threading.Thread:
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    assert agent.connected.wait(WAIT_S)
    return t


def run_agent(agent) -> tuple[threading.Thread, list[BaseException]]:
    """``agent.run()`` on a thread of its own, started; the thread, and the list that gets
    what ended the run if it raised."""
    errors: list[BaseException] = []

    def run():
        try:
            agent.run()
        except BaseException as e:  # noqa: BLE001 (the test reads what ended the agent)
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


def what_ends_the_first_attach(agent) -> BaseException:
    """Run ``agent`` until it ends by itself (failing the test if it keeps retrying); what
    ended it."""
    t, errors = run_agent(agent)
    try:
        t.join(WAIT_S)
        assert not t.is_alive(), "the agent kept retrying an address that can never work"
    finally:
        agent.stop()
        t.join(WAIT_S)
    assert len(errors) == 1
    return errors[0]


def self_signed_certificate(folder) -> tuple:
    """A certificate for 127.0.0.1 that is its own CA, and its key, written in ``folder``
    (skips the test where openssl is missing): (cert.pem, key.pem)."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate (apt-get install openssl)")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", folder / "key.pem", "-out", folder / "cert.pem"],
                   check=True, capture_output=True)
    return folder / "cert.pem", folder / "key.pem"
