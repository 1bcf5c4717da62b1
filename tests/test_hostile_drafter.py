"""A hostile or broken drafter against the real DraftCache service (in-process gRPC on loopback,
the embedded Redis): malformed ids are INVALID_ARGUMENT, per-device tokens keep a drafter
to its own device and sessions, mutual TLS, bounded drafter-side state in Redis and in the
service, the inbox event names, and an agent that outlives a drafter failing on a session."""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

from cache_service.credentials import DeviceCredentials
from cache_service.redis_conn import RedisHandle
from cache_service.service import DEVICE_METADATA, DraftCacheService
from cache_service.store import RedisSessionStore
from drafter_node.agent import DrafterAgent
from edgespec.config import ConfigError, SamplingParams
from edgespec.drafters import Draft, Drafter, DraftSession
from edgespec.protocol.ids import check_device_id, check_session_id
from edgespec.runner.kv_cache import CacheFullError
from edgespec.protocol.contract import Branch, DraftWant, Verdict
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire.convert import TokenAuthInterceptor, auth_metadata, bind, free_port, make_channel

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
        self.server.stop(0)


@pytest.fixture()
def cache(store):
    c = Cache(store)
    yield c
    c.stop()


class Stream:
    """A hand-driven Attach stream: register, send chunks, read what the cache sends."""

    def __init__(self, channel, device, token=None):
        self.out: queue.Queue = queue.Queue()
        self.out.put(pb.DrafterMessage(register=pb.Register(device_id=device, draft_model="test",
                                                            max_sessions=4)))
        self.call = pb_grpc.DraftCacheStub(channel).Attach(iter(self.out.get, None),
                                                            metadata=auth_metadata(token))
        self.inbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for msg in self.call:
                self.inbox.put(msg)
            self.inbox.put(None)
        except grpc.RpcError as e:
            self.inbox.put(e)

    def next(self, kind: str) -> pb.CacheMessage:
        """The next message of ``kind`` (others are skipped); raises the stream's error."""
        deadline = time.monotonic() + WAIT_S
        while True:
            msg = self.inbox.get(timeout=max(0.01, deadline - time.monotonic()))
            if isinstance(msg, grpc.RpcError):
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


# -- 1. an old drafter's q' (a removed field) is skipped, not refused -----------------------------
def test_a_chunk_with_the_removed_q_field_is_stored_without_it(cache, store):
    store.create("s1", [1, 2, 3], SAMPLED, "dev1")
    chunk = pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5])
    old_q = bytes([0x0A, 0x01, 0x05, 0x12, 0x04]) + b"\x00\x00\x80\x3f"  # SparseQ{[5], [1.0]}
    old = pb.DraftChunk.FromString(chunk.SerializeToString() + bytes([(5 << 3) | 2, len(old_q)])
                                   + old_q)
    assert cache.push(old, device="dev1").kept == 1
    assert draft_len(store, "s1") == 1
    assert store.redis.keys("*:q") == []


# -- 2. ids are checked before they reach a Redis key ---------------------------------------------
def test_id_formats():
    for good in ("board-1", "a", "jetson.orin_2", "A" * 64):
        assert check_device_id(good) == good
    for bad in ("", "-x", ".x", "dev:1", "dev 1", "dev/1", "x" * 65, "dev\n", None, 7):
        with pytest.raises(ConfigError):
            check_device_id(bad)
    for good in ("0123456789abcdef", "f" * 32, "s1", "a_b-C"):
        assert check_session_id(good) == good
    for bad in ("", "abc:tok", "a.b", "x" * 65, "a b", b"abc"):
        with pytest.raises(ConfigError):
            check_session_id(bad)
    with pytest.raises(ConfigError) as e:
        check_session_id("q" * 65536)
    assert len(str(e.value)) < 200 and "q" * 41 not in str(e.value)


def test_malformed_ids_are_invalid_argument(cache, store):
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    chunk = pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5])
    # another key type of the same session (WRONGTYPE inside Redis before ids were checked)
    bad_sid = pb.DraftChunk(session_id="s1:tok", epoch=0, start=3, tokens=[5])
    assert code_of(lambda: cache.push(bad_sid, device="dev1")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: cache.push(chunk, device="dev1:inbox")) == \
        grpc.StatusCode.INVALID_ARGUMENT
    huge = pb.DraftChunk(session_id="a" * 65536, epoch=0, start=3, tokens=[5])
    with pytest.raises(grpc.RpcError) as e:
        cache.push(huge, device="dev1")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(e.value.details()) < 200
    for device in ("dev:1", "x" * 100):
        s = Stream(cache.channel, device)
        with pytest.raises(grpc.RpcError) as e:
            s.next("registered")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        s.close()
    assert cache.push(chunk, device="dev1").kept == 1


def test_a_malformed_chunk_on_the_stream_is_refused_and_the_stream_goes_on(cache, store):
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    s = Stream(cache.channel, "dev1")
    s.next("registered")
    s.send(pb.DraftChunk(session_id="s1:tok", epoch=0, start=3, tokens=[5]))
    ack = s.next("ack")
    assert ack.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    s.send(pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5, 6]))
    ack = s.next("ack")
    assert ack.code == grpc.StatusCode.OK.value[0] and ack.kept == 2
    s.close()


@pytest.mark.parametrize("tokens,parents,version,needle", [
    ([5, 6, 7], [-1, 0, 1], 2, "tree_version 2"),  # a layout this cache does not know
    ([5, 6], [-1, 0], 0, "no tree_parents"),  # a chain chunk with parents
    ([5, 6, 7], [-1, 0], 1, "one parent per token"),
    ([5, 6, 7], [-1, 0, 5], 1, "tree_parents[2]"),  # a parent after the node
    ([5, 6, 7, 8, 9], [-1, 0, 1, -1, 2], 1, "tree_parents[4]"),  # from the chain's last node
    ([5, 6, 7, 8, 9], [-1, 0, -1, 0, 2], 1, "tree_parents[4]"),  # continues another branch
    ([5, 6, 1 << 20], [-1, 0, -1], 1, "token ids"),  # a branch token outside the vocabulary
    ([5] + [7] * 70, [-1] + [-1] * 70, 1, "at most"),  # too many branch nodes
])
def test_a_malformed_tree_chunk_is_refused_and_stores_nothing(cache, store, tokens, parents,
                                                              version, needle):
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    tree = pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=tokens,
                         tree_parents=parents, tree_version=version)
    with pytest.raises(grpc.RpcError) as e:
        cache.push(tree, device="dev1")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()
    assert draft_len(store, "s1") == 0 and store.redis.llen(store.keys.session("s1")[3]) == 0
    chain = pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5, 6], tree_version=0)
    assert cache.push(chain, device="dev1").kept == 2


@pytest.mark.parametrize("start", [-1, 1 << 31, 1 << 40])
@pytest.mark.parametrize("version", [0, 1])
def test_a_chunk_whose_start_is_no_position_is_refused(cache, store, start, version):
    """A start outside 0..2^31 (a tree's branch positions are stored as 32-bit numbers) is the
    chunk's INVALID_ARGUMENT, not an error of the cache; the stream's next chunk is stored."""
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    s = Stream(cache.channel, "dev1")
    s.next("registered")
    s.send(pb.DraftChunk(session_id="s1", epoch=0, start=start, tokens=[5, 6, 7],
                         tree_parents=[-1, 0, -1] if version else [], tree_version=version))
    ack = s.next("ack")
    assert ack.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "start" in ack.message
    s.send(pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5, 6]))
    ack = s.next("ack")
    assert ack.code == grpc.StatusCode.OK.value[0] and ack.kept == 2
    s.close()


def test_a_tree_chunk_stores_its_chain_and_branches(cache, store):
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    # chain 5 6 7; a branch 8 9 instead of 6; a branch 4 instead of 5
    tree = pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5, 6, 7, 8, 9, 4],
                         tree_parents=[-1, 0, 1, 0, 3, -1], tree_version=1)
    assert cache.push(tree, device="dev1").kept == 3  # the chain's tokens
    assert draft_len(store, "s1") == 3
    (taken,) = store.take_when_ready([DraftWant("s1", 3, 8)], 0)
    assert taken.tokens == [5, 6, 7]
    assert taken.branches == [Branch(1, (8, 9)), Branch(0, (4,))]


# -- 4. per-device credentials --------------------------------------------------------------------
TOKENS = {"dev-a": "token-a-0123456789", "dev-b": "token-b-0123456789"}
SHARED = "shared-0123456789"


def test_device_tokens_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# fleet\n\ndev-a: token-a-0123456789\n  dev-b :token-b:x#y   # lab\n")
    creds = DeviceCredentials.load(str(path))
    assert len(creds) == 2 and creds.devices == {"dev-a", "dev-b"}
    assert creds.device_for("token-a-0123456789") == "dev-a"
    assert creds.device_for("token-b:x#y") == "dev-b"
    assert creds.device_for("token-a") is None and creds.device_for(None) is None
    bad = {"no colon": "dev-a token\n", "bad id": "dev:a: t\n", "no token": "dev-a:\n",
           "listed twice": "dev-a: t1\ndev-a: t2\n", "shared": "dev-a: same\ndev-b: same\n",
           "space in token": "dev-a: secret-1 secret-2\n", "empty": "# nothing\n"}
    for what, text in bad.items():
        with pytest.raises(ConfigError) as e:
            DeviceCredentials.parse(text)
        assert "secret" not in str(e.value) and "same" not in str(e.value), what
    with pytest.raises(ConfigError):
        DeviceCredentials.load(str(tmp_path / "missing"))
    with pytest.raises(ConfigError):  # the shared token cannot also be a device's
        TokenAuthInterceptor("token-a-0123456789", creds)


@pytest.fixture()
def secured(store):
    c = Cache(store, token=SHARED, credentials=DeviceCredentials(TOKENS))
    store.create("sa", [1, 2, 3], SamplingParams(), "dev-a")
    store.create("sb", [1, 2, 3], SamplingParams(), "dev-b")
    yield c
    c.stop()


def test_a_device_token_pushes_only_as_its_device_into_its_sessions(secured, store):
    tok_a = TOKENS["dev-a"]
    into_b = pb.DraftChunk(session_id="sb", epoch=0, start=3, tokens=[5])
    into_a = pb.DraftChunk(session_id="sa", epoch=0, start=3, tokens=[5])
    denied = grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: secured.push(into_b, tok_a, device="dev-b")) == denied  # as another
    assert code_of(lambda: secured.push(into_b, tok_a)) == denied  # into another's session
    assert code_of(lambda: secured.push(into_a, tok_a, device="dev-b")) == denied
    assert code_of(lambda: secured.push(into_a, SHARED, device="dev-a")) == denied  # no device
    assert code_of(lambda: secured.push(into_a, "wrong", device="dev-a")) == \
        grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: secured.push(into_a, None, device="dev-a")) == \
        grpc.StatusCode.UNAUTHENTICATED
    assert draft_len(store, "sa") == draft_len(store, "sb") == 0
    assert secured.push(into_a, tok_a).kept == 1  # its own session, device from the token
    assert secured.push(into_b, TOKENS["dev-b"], device="dev-b").kept == 1


def test_a_device_token_registers_only_its_device(secured):
    s = Stream(secured.channel, "dev-b", token=TOKENS["dev-a"])
    with pytest.raises(grpc.RpcError) as e:
        s.next("registered")
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    s.close()
    s = Stream(secured.channel, "dev-a", token=TOKENS["dev-a"])
    s.next("registered")
    assert s.next("assignment").session_id == "sa"
    s.send(pb.DraftChunk(session_id="sb", epoch=0, start=3, tokens=[5]))
    assert s.next("ack").code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    s.send(pb.DraftChunk(session_id="sa", epoch=0, start=3, tokens=[5]))
    assert s.next("ack").code == grpc.StatusCode.OK.value[0]
    s.close()


def test_device_tokens_are_good_for_the_draft_cache_only(secured):
    stub = pb_grpc.VerifierStub(secured.channel)
    req = pb.CancelRequest(session_id="x")
    assert code_of(lambda: stub.Cancel(req, metadata=auth_metadata(TOKENS["dev-a"]),
                                       timeout=WAIT_S)) == grpc.StatusCode.PERMISSION_DENIED
    # the shared token passes the interceptor (the test server's Verifier is unimplemented)
    assert code_of(lambda: stub.Cancel(req, metadata=auth_metadata(SHARED),
                                       timeout=WAIT_S)) == grpc.StatusCode.UNIMPLEMENTED
    assert code_of(lambda: stub.Cancel(req, timeout=WAIT_S)) == grpc.StatusCode.UNAUTHENTICATED


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


def start_agent(agent: DrafterAgent) -> threading.Thread:
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    assert agent.connected.wait(WAIT_S)
    return t


def test_mutual_tls_admits_clients_with_a_certificate_of_the_ca_only(store, pki):
    d = pki
    c = Cache(store, tls=(str(d / "server.pem"), str(d / "server.key"), str(d / "ca.pem")))
    try:
        agent = DrafterAgent(c.address, "edge-tls", SlotDrafter(), tls_ca=str(d / "ca.pem"),
                             tls_cert=str(d / "client.pem"), tls_key=str(d / "client.key"))
        t = start_agent(agent)  # the handshake with the CA's client certificate works
        agent.stop()
        t.join(WAIT_S)
        chunk = pb.DraftChunk(session_id="nope", tokens=[1])
        for cert in (None, "rogue"):
            kw = {} if cert is None else {"client_cert": str(d / f"{cert}.pem"),
                                          "client_key": str(d / f"{cert}.key")}
            channel = make_channel(c.address, tls_ca=str(d / "ca.pem"), **kw)
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.DraftCacheStub(channel).PushDraft(
                    chunk, metadata=[(DEVICE_METADATA, "edge-tls")], timeout=WAIT_S)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # no handshake, no call
            channel.close()
    finally:
        c.stop()
    with pytest.raises(ConfigError):
        bind(grpc.server(futures.ThreadPoolExecutor(1)), "127.0.0.1:0",
             client_ca=str(d / "ca.pem"))
    with pytest.raises(ConfigError):
        make_channel("127.0.0.1:1", client_cert=str(d / "client.pem"))
    for cert, key in (("server.pem", "client.key"), ("server.key", "server.key")):
        with pytest.raises(ConfigError, match="not a PEM certificate and its private key"):
            bind(grpc.server(futures.ThreadPoolExecutor(1)), "127.0.0.1:0", str(d / cert),
                 str(d / key))


# -- 3. the agent refuses what its drafter cannot do, and lives on --------------------------------
def test_agent_refuses_a_session_its_drafter_cannot_open_and_keeps_serving(cache, store):
    drafter = SlotDrafter(slots=1)
    agent = DrafterAgent(cache.address, "edge-1", drafter, window=4, chunk=2, max_sessions=1)
    t = start_agent(agent)
    try:
        idle = lambda sid: store.redis.hget(store.keys.session(sid)[0], "idle") == b"1"  # noqa: E731
        store.create("s1", [1, 2, 3], SamplingParams(), "edge-1")
        eventually(lambda: draft_len(store, "s1") > 0, "drafts for s1")
        store.create("s2", [1, 2, 3], SamplingParams(), "edge-1")  # pinned beyond capacity
        eventually(lambda: idle("s2"), "an idle chunk for the refused s2")
        assert t.is_alive() and agent.refused == 1
        # the verifier decodes s2 alone: its fix resets the idle flag, the agent sets it again
        store.commit_many([Verdict(session_id="s2", epoch=0, start=3, n_accepted=0, token=9)])
        eventually(lambda: idle("s2")
                   and store.redis.hget(store.keys.session("s2")[0], "epoch") == b"1",
                   "an idle chunk for s2 after its fix")
        store.close("s1")
        eventually(lambda: drafter.open_now == 0, "s1's slot freed")
        store.create("s3", [1, 2, 3], SamplingParams(), "edge-1")
        eventually(lambda: draft_len(store, "s3") > 0, "drafts for s3 after the refusal")
        store.close("s3")
        eventually(lambda: drafter.open_now == 0, "s3's slot freed")
        store.create("s4", [99, 2, 3], SamplingParams(), "edge-1")  # propose raises
        eventually(lambda: idle("s4"), "an idle chunk for s4 whose drafting failed")
        assert t.is_alive() and agent.refused == 2 and drafter.open_now == 0
        store.create("s5", [1, 2, 3], SamplingParams(), "edge-1")
        eventually(lambda: draft_len(store, "s5") > 0, "drafts for s5")
    finally:
        agent.stop()
        t.join(WAIT_S)


def test_agent_refuses_a_session_whose_ids_are_outside_the_vocabulary(cache, store):
    """Token ids from the cache outside the target's vocabulary (a broken or hostile cache; the
    verifier never sends them) reach no drafter's model: the session they come in, an
    assignment or a fix, is refused (an idle chunk), and the agent drafts for the others."""
    drafter = SlotDrafter()
    agent = DrafterAgent(cache.address, "edge-1", drafter, window=4, chunk=2)
    t = start_agent(agent)
    try:
        idle = lambda sid: store.redis.hget(store.keys.session(sid)[0], "idle") == b"1"  # noqa: E731
        store.create("s1", [1, 2, VOCAB + 50], SamplingParams(), "edge-1")
        eventually(lambda: idle("s1"), "an idle chunk for s1, assigned ids outside the vocabulary")
        store.create("s2", [1, 2, 3], SamplingParams(), "edge-1")
        eventually(lambda: draft_len(store, "s2") > 0, "drafts for s2")
        store.commit_many([Verdict(session_id="s2", epoch=0, start=3, n_accepted=0,
                                   token=VOCAB + 7)])  # a fix with an id outside it
        eventually(lambda: idle("s2")
                   and store.redis.hget(store.keys.session("s2")[0], "epoch") == b"1",
                   "an idle chunk for s2 after its fix, under the fix's epoch")
        store.create("s3", [1, 2, 3], SamplingParams(), "edge-1")
        eventually(lambda: draft_len(store, "s3") > 0, "drafts for s3")
        assert t.is_alive() and agent.refused == 2
    finally:
        agent.stop()
        t.join(WAIT_S)


class OutOfOrderCache(pb_grpc.DraftCacheServicer):
    """A cache that, on a drafter's first attach, sends an assignment before ``registered``;
    on the next ones behaves, and collects the chunks it gets."""

    def __init__(self):
        self.attaches, self.chunks = 0, queue.Queue()

    def Attach(self, request_iterator, context):
        self.attaches += 1
        assignment = pb.CacheMessage(assignment=pb.Assignment(session_id="s1", tokens=[1, 2, 3]))
        if self.attaches == 1:
            yield assignment
            return
        threading.Thread(target=self._collect, args=(request_iterator,), daemon=True).start()
        yield pb.CacheMessage(registered=pb.Registered(target_model="tiny", window=4, chunk=2,
                                                        vocab_size=VOCAB))
        yield assignment
        while context.is_active():
            time.sleep(0.05)

    def _collect(self, request_iterator):
        try:
            for message in request_iterator:
                if message.HasField("chunk"):
                    self.chunks.put(message.chunk)
        except grpc.RpcError:
            pass  # the link ended (the agent stopped): the stream's reader ends with it


def test_a_cache_that_assigns_before_registering_costs_the_link_not_the_agent():
    """Before ``registered`` the agent knows neither the window nor the vocabulary: a session
    assigned then ends the link (the drafting thread never plans with them unknown), and the
    agent attaches again and drafts."""
    servicer = OutOfOrderCache()
    server = grpc.server(futures.ThreadPoolExecutor(8))
    pb_grpc.add_DraftCacheServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1:0")
    server.start()
    agent = DrafterAgent(f"127.0.0.1:{port}", "edge-1", SlotDrafter())
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        chunk = servicer.chunks.get(timeout=WAIT_S)
        assert chunk.session_id == "s1" and list(chunk.tokens) and set(chunk.tokens) == {7}
        assert servicer.attaches == 2 and t.is_alive()
    finally:
        agent.stop()
        t.join(WAIT_S)
        server.stop(0)


# -- 5. bounded drafter-side state ----------------------------------------------------------------
def test_pick_counts_only_live_sessions_and_drops_the_rest(store):
    store.devices.register("d1", {"max_sessions": 1})
    store.create("gone", [1], SamplingParams(), "d1")
    # a crashed verifier never closed it; its keys expired
    store.redis.delete(*store.keys.session("gone"))
    store.create("done", [1], SamplingParams(), "d1")
    store.redis.hset(store.keys.session("done")[0], "done", 1)
    assert store.devices.pick() == "d1"
    store.devices.release("d1")
    assert store.redis.smembers(store.keys.sessions("d1")) == set()
    store.create("live", [1], SamplingParams(), "d1")
    assert store.devices.pick() is None  # full: one live session, limit 1
    assert store.devices.sessions_of("d1") == ["live"]
    store.devices.mark_alive("d1")
    assert 0 < store.redis.ttl(store.keys.sessions("d1")) <= store.ttl_s


def test_registrations_beyond_the_cap_forget_the_longest_detached_first(store, monkeypatch):
    """Drafters attaching under ever new ids cannot grow the registrations every admission
    reads: past ``MAX_REGISTRATIONS`` the detached drafters unseen longest are forgotten (with
    their session sets and inboxes); attached ones never are."""
    from cache_service import devices

    monkeypatch.setattr(devices, "MAX_REGISTRATIONS", 3)
    regs = lambda: {d.decode() for d in store.redis.hkeys(store.keys.devices)}  # noqa: E731
    for dev in ("a", "b", "c"):
        store.devices.register(dev, {"max_sessions": 4})
    store.create("s-b", [1], SamplingParams(), "b")
    for dev in ("b", "c"):
        store.devices.mark_gone(dev)
    now = time.time()  # a: attached, seen longest ago; none unseen for max_idle_s
    store.redis.zadd(store.keys.seen, {"a": now - 30, "b": now - 20, "c": now - 10})
    store.devices.register("d", {"max_sessions": 4})
    assert regs() == {"a", "c", "d"}
    assert not store.redis.exists(store.keys.sessions("b"), store.keys.inbox("b"))
    store.devices.register("e", {"max_sessions": 4})
    assert regs() == {"a", "d", "e"}
    store.devices.register("f", {"max_sessions": 4})  # all four attached: none forgotten
    assert regs() == {"a", "d", "e", "f"}


def test_a_drafter_that_never_reads_its_stream_is_detached(cache, store, monkeypatch, caplog):
    """A drafter that sends chunks and reads none of the acknowledgements fills its bounded
    outbox (``drafter_outbox``), the cache stops reading its chunks, and once the outbox has
    been full for ``STUCK_S`` the stream is cancelled; another drafter is served throughout."""
    from cache_service import drafter_outbox

    monkeypatch.setattr(drafter_outbox, "MAX_PENDING", 4)
    monkeypatch.setattr(drafter_outbox, "STUCK_S", 0.5)
    store.create("s1", [1, 2, 3], SamplingParams(), "dev2")
    out: queue.Queue = queue.Queue()
    out.put(pb.DrafterMessage(register=pb.Register(device_id="dev1", draft_model="test")))
    sid = "x" * 64  # unknown: each chunk's refusal quotes it, so acks fill gRPC's window soon
    for _ in range(20_000):
        out.put(pb.DrafterMessage(chunk=pb.DraftChunk(session_id=sid, epoch=0, start=3,
                                                      tokens=[5])))
    channel = grpc.insecure_channel(cache.address, options=[("grpc.http2.bdp_probe", 0)])
    call = pb_grpc.DraftCacheStub(channel).Attach(iter(out.get, None))  # never read until below
    with caplog.at_level(logging.WARNING, logger="edgespec.cache"):
        eventually(lambda: "read nothing of its stream" in caplog.text, "the drafter detached")
    other = Stream(cache.channel, "dev2")
    other.next("registered")
    other.send(pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5, 6]))
    assert other.next("ack").kept == 2
    other.close()
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED
    out.put(None)
    channel.close()


def test_registrations_not_seen_for_long_are_forgotten(store):
    for dev in ("old", "fresh", "alive-old"):
        store.devices.register(dev, {"max_sessions": 4})
    store.create("s-old", [1], SamplingParams(), "old")
    store.devices.mark_gone("old")
    store.redis.zadd(store.keys.seen, {"old": 0, "alive-old": 0})  # last seen in 1970
    assert store.devices.pick() in ("fresh", "alive-old")
    regs = {d.decode() for d in store.redis.hkeys(store.keys.devices)}
    assert regs == {"fresh", "alive-old"}  # an alive device stays, whatever its mark says
    assert not store.redis.exists(store.keys.sessions("old"), store.keys.inbox("old"))


def test_a_device_generation_is_dropped_when_its_stream_ends(cache, store):
    s = Stream(cache.channel, "dev1")
    s.next("registered")
    assert "dev1" in cache.service._generation and store.devices.is_alive("dev1")
    s.close()
    # the service forgets the generation, then marks the device gone: both, soon
    eventually(lambda: "dev1" not in cache.service._generation
               and not store.devices.is_alive("dev1"), "the generation dropped, the device gone")


# -- 6. inbox event names -------------------------------------------------------------------------
def test_inbox_events_assign_commit_close_reach_the_drafter(cache, store):
    s = Stream(cache.channel, "dev1")
    s.next("registered")
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    a = s.next("assignment")
    assert (a.session_id, list(a.tokens), a.epoch) == ("s1", [1, 2, 3], 0)
    inbox = store.keys.inbox("dev1")
    store.redis.xadd(inbox, {"t": "commit", "sid": "s1", "epoch": 1, "end": 4, "fix": 1, "tok": 9})
    c = s.next("commit")
    assert (c.session_id, c.epoch, c.committed_end, c.is_fix, c.fix_position, c.fix_token) == \
        ("s1", 1, 4, True, 3, 9)
    store.redis.xadd(inbox, {"t": "close", "sid": "s1"})
    assert s.next("closed").session_id == "s1"
    s.close()


# -- link logs ------------------------------------------------------------------------------------
def agent_messages(caplog, level=None) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "edgespec.drafter" and (level is None or r.levelno == level)]


def test_an_agent_that_never_connected_says_it_cannot_reach_the_cache_once(caplog):
    caplog.set_level(logging.DEBUG, logger="edgespec.drafter")
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    agent = DrafterAgent(address, "edge-nowhere", SlotDrafter(), backoff_max_s=0.2)
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        eventually(lambda: len(agent_messages(caplog, logging.DEBUG)) >= 2, "retries")
    finally:
        agent.stop()
        t.join(WAIT_S)
    warnings = agent_messages(caplog, logging.WARNING)
    assert len(warnings) == 1 and f"cannot reach the cache at {address} yet" in warnings[0]
    assert not any("lost" in m for m in agent_messages(caplog))


def test_an_agent_says_lost_only_for_a_link_it_had(store, caplog):
    caplog.set_level(logging.DEBUG, logger="edgespec.drafter")
    c = Cache(store)
    agent = DrafterAgent(c.address, "edge-lost", SlotDrafter(), backoff_max_s=0.2)
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        assert agent.connected.wait(WAIT_S)
        c.stop()  # the cache goes away: the link existed, and cannot be made again
        eventually(lambda: len(agent_messages(caplog, logging.DEBUG)) >= 2, "retries")
    finally:
        agent.stop()
        c.stop()
        t.join(WAIT_S)
    warnings = agent_messages(caplog, logging.WARNING)
    assert len(warnings) == 2, warnings
    assert f"link to {c.address} lost" in warnings[0]
    assert f"cannot reach the cache at {c.address} since the link was lost" in warnings[1]


def test_an_agent_logs_every_lost_link_across_restarts(store, caplog):
    """Two restarts of the cache on one address: each lost link is logged, and each re-attach
    (the "already said" state of an outage ends with the link it was about)."""
    caplog.set_level(logging.DEBUG, logger="edgespec.drafter")
    address = f"127.0.0.1:{free_port()}"
    c = Cache(store, listen=address)
    agent = DrafterAgent(address, "edge-restarts", SlotDrafter(), backoff_max_s=0.2)
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        for restart in (1, 2):
            eventually(lambda: agent.attaches == restart, f"attach {restart}")
            c.stop()
            eventually(lambda: sum("lost" in m for m in agent_messages(caplog, logging.WARNING))
                       == restart, f"lost link {restart} logged")
            c = Cache(store, listen=address)
        eventually(lambda: agent.attaches == 3, "attach 3")
    finally:
        agent.stop()
        c.stop()
        t.join(WAIT_S)
    infos = [m for m in agent_messages(caplog, logging.INFO) if m.startswith("attached to")]
    assert len(infos) == 3
    lost = [m for m in agent_messages(caplog, logging.WARNING) if "lost" in m]
    assert len(lost) == 2 and all(f"link to {address} lost" in m for m in lost)


def test_two_drafters_with_one_device_id_end_with_one_attached_and_one_stopped(cache, store,
                                                                             caplog):
    """Two boards given one --device-id knocked each other off for good, each re-attach
    replacing the other with nothing said: the cache warns of an attach while the id's stream
    is open and ends the older stream ABORTED, saying so; a drafter told so attaches again once
    (a stale attempt of its own could have looked newer) and stops the second time (a
    ConfigError). Whichever stops, one stops, and the other keeps the id, attached."""
    caplog.set_level(logging.INFO)
    errors: dict[int, BaseException] = {}

    def run(i, agent):
        try:
            agent.run()
        except BaseException as e:  # noqa: BLE001 (the test reads what ended the agent)
            errors[i] = e

    agents = [DrafterAgent(cache.address, "twin", SlotDrafter(), backoff_max_s=0.2)
              for _ in range(2)]
    threads = [threading.Thread(target=run, args=(i, a), daemon=True)
               for i, a in enumerate(agents)]
    threads[0].start()
    assert agents[0].connected.wait(WAIT_S)
    threads[1].start()
    try:
        eventually(lambda: errors, "one of the two drafters stopped")
        [(stopped, error)] = errors.items()
        assert isinstance(error, ConfigError) and "ended this drafter's link twice" in str(error)
        assert "replaced by a newer attach" in str(error) and "--device-id" in str(error)
        threads[stopped].join(WAIT_S)
        kept = agents[1 - stopped]
        assert not threads[stopped].is_alive() and threads[1 - stopped].is_alive()
        eventually(lambda: kept.connected.is_set() and store.devices.is_alive("twin"),
                   "the other drafter attached")
        warned = [r.getMessage() for r in caplog.records
                  if r.name.startswith("edgespec.cache") and "attached again" in r.getMessage()]
        assert warned and "two boards share the id" in warned[0]
    finally:
        for agent, thread in zip(agents, threads):
            agent.stop()
            thread.join(WAIT_S)
    assert len(errors) == 1  # the other ended by stop(), not refused


def test_an_attach_whose_client_left_while_it_waited_takes_no_device_over(cache, store):
    """An attach that waited (on Redis, say) while its client went away, a proxy's reset
    attempt, must not take the id from the live stream that replaced it: it ends at once,
    and the live stream keeps its generation and is not ended."""
    live = Stream(cache.channel, "dev1")
    live.next("registered")
    gen = cache.service._generation["dev1"]
    gone = SimpleNamespace(is_active=lambda: False, peer=lambda: "ipv4:10.0.0.9:1",
                           abort=None, add_callback=None)  # used past the check: would raise
    register = pb.DrafterMessage(register=pb.Register(device_id="dev1", draft_model="test",
                                                      max_sessions=4))
    assert list(cache.service.Attach(iter([register]), gone)) == []
    assert cache.service._generation["dev1"] == gen
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    assert live.next("assignment").session_id == "s1"  # the live stream goes on
    live.close()


def test_an_agent_pointed_at_an_http_port_stops_saying_so():
    """A board given the server's HTTP port retried for ever, logging gRPC's "Trying to
    connect an http1.x server": a ConfigError naming the likely mix-up, at its first attach."""
    import http.server

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                            http.server.BaseHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{httpd.server_address[1]}"
    agent = DrafterAgent(address, "edge-http", SlotDrafter(), backoff_max_s=0.2)
    errors: list[BaseException] = []

    def run():
        try:
            agent.run()
        except BaseException as e:  # noqa: BLE001 (the test reads what ended the agent)
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        t.join(WAIT_S)
        assert not t.is_alive(), "the agent kept retrying an HTTP/1 port"
        assert len(errors) == 1 and isinstance(errors[0], ConfigError)
        assert "answers, but not as a gRPC server: the server's --http-port" in str(errors[0])
    finally:
        agent.stop()
        t.join(WAIT_S)
        httpd.shutdown()
        httpd.server_close()


def test_an_unreachable_cache_is_said_again_while_it_lasts(caplog, monkeypatch):
    import drafter_node.agent as agent_mod

    monkeypatch.setattr(agent_mod, "STILL_UNREACHABLE_LOG_S", 0.3)
    caplog.set_level(logging.DEBUG, logger="edgespec.drafter")
    address = f"127.0.0.1:{free_port()}"
    agent = DrafterAgent(address, "edge-still", SlotDrafter(), backoff_max_s=0.2)
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        eventually(lambda: sum("still cannot reach" in m for m in
                               agent_messages(caplog, logging.WARNING)) >= 2, "reminders")
    finally:
        agent.stop()
        t.join(WAIT_S)
    warnings = agent_messages(caplog, logging.WARNING)
    assert f"cannot reach the cache at {address} yet" in warnings[0]
    assert all(f"still cannot reach the cache at {address} after" in m for m in warnings[1:])


@pytest.mark.parametrize("address,why", [("127.0.0.1", "the port included"),
                                         ("http://127.0.0.1:5", "without a scheme"),
                                         ("grpc://h:1", "without a scheme")])
def test_an_agent_refuses_an_address_gRPC_would_misread(address, why):
    with pytest.raises(ConfigError, match=why):
        DrafterAgent(address, "edge-bad", SlotDrafter())
    DrafterAgent("dns:///localhost:5", "edge-ok", SlotDrafter())  # these forms stay accepted
    DrafterAgent("[::1]:5", "edge-ok", SlotDrafter())


def test_a_chunk_pushed_while_the_caches_redis_is_down_is_unavailable_with_a_hint():
    """The cache is up but its Redis is not: PushDraft says UNAVAILABLE with the retry hint (as
    Attach does), not UNKNOWN with a traceback in the cache's log."""
    from edgespec.wire.convert import RETRY_AFTER_MD

    handle = RedisHandle()
    st = RedisSessionStore(handle.client, prefix="h:", ttl_s=60)
    st.set_target({"model": "tiny", "fingerprint": "fp", "vocab_size": VOCAB, "window": 8,
                   "chunk": 4})
    st.create("s1", [1, 2, 3], SamplingParams(), "dev")
    c = Cache(st)
    try:
        handle.proc.kill()  # and never restarted: nobody runs the handle's monitor here
        handle.proc.wait()
        with pytest.raises(grpc.RpcError) as e:
            c.push(pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[4]), device="dev")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "Redis" in e.value.details()
        assert dict(e.value.trailing_metadata()).get(RETRY_AFTER_MD)
    finally:
        c.stop()
        st.shutdown()
        handle.close()
