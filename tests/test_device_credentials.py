"""A drafter kept to its own device by its credentials, against the real DraftCache service
(in-process gRPC on loopback, the embedded Redis): the device tokens file parsed without echoing
a secret, a device token that pushes only as its device into its sessions and registers only
its device, tokens good for the draft cache only, and mutual TLS admitting clients with a
certificate of the CA only."""

from __future__ import annotations

import logging
import queue
from concurrent import futures

import grpc

import pytest

from cache_service.credentials import DeviceCredentials
from cache_service.service import DEVICE_METADATA
from drafter_node.agent import DrafterAgent
from edgespec.config import ConfigError, SamplingParams
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire.convert import TokenAuthInterceptor, auth_metadata
from edgespec.wire.channels import bind, make_channel

# the in-process cache: its fixtures (used by name) and helpers
from cache_harness import (  # noqa: F401
    WAIT_S, Cache, SlotDrafter, Stream, cache, code_of, draft_len, eventually, redis_handle,
    start_agent, store)

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


@pytest.mark.parametrize("token, says", [(None, "--auth-token"), (SHARED, "--device-tokens")])
def test_a_drafter_refused_for_its_token_stops_saying_which_token_to_give(secured, token, says):
    """The cache's refusal is the same for every caller; the drafter adds what its user gives:
    no token (UNAUTHENTICATED), or the shared one where devices have their own
    (PERMISSION_DENIED). It stops (``run`` raises: the command exits 2) rather than retry."""
    agent = DrafterAgent(secured.address, "dev-a", SlotDrafter(), token=token)
    with pytest.raises(ConfigError, match="refused drafter 'dev-a'") as e:
        agent.run()
    assert says in str(e.value)


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


def test_a_cache_with_a_shared_token_and_no_device_tokens_says_what_boards_can_do(tmp_path,
                                                                                 caplog):
    """Boards that attach with the clients' token can call what a client can: ``serve`` says
    so once at start, and says nothing once each device has its own token."""
    from edgespec_cli.server import EdgespecServer, ServerOptions

    tokens = tmp_path / "devices.txt"
    tokens.write_text("".join(f"{d}: {t}\n" for d, t in TOKENS.items()))
    said = {}
    for case, extra in (("shared", {}), ("devices", {"device_tokens": str(tokens)})):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="edgespec.server"):
            srv = EdgespecServer(ServerOptions(listen="127.0.0.1:0", roles=("cache",),
                                               auth_token=SHARED, **extra))
        srv.start().stop(drain_timeout_s=0)
        said[case] = [r.getMessage() for r in caplog.records if "--device-tokens" in
                      r.getMessage()]
    assert len(said["shared"]) == 1 and "cancel" in said["shared"][0]
    assert said["devices"] == []


def test_a_device_token_holds_one_stream_waiting_for_its_register(secured):
    """A token's holder opening silent Attach streams (found by a hostile board's probe: four
    of them kept every other board out of a cache of four slots): each new one ends the wait
    of the one before, so a device holds at most one unregistered stream, however long the
    wait for a Register is."""
    secured.service.registering.wait_s = 10 * WAIT_S  # no deadline ends a wait in this test
    meta = auth_metadata(TOKENS["dev-a"])
    silent: list[queue.Queue] = [queue.Queue(), queue.Queue()]
    calls = []
    for q in silent:  # the second opened once the first waits
        eventually(lambda: calls == [] or "dev-a" in secured.service.registering.waiting(),
                   "the first stream waiting for its Register")
        calls.append(pb_grpc.DraftCacheStub(secured.channel).Attach(
            iter(q.get, None), metadata=meta, timeout=WAIT_S))
    with pytest.raises(grpc.RpcError) as e:
        next(calls[0])  # replaced by the second
    assert e.value.code() == grpc.StatusCode.CANCELLED
    other = Stream(secured.channel, "dev-b", token=TOKENS["dev-b"])  # another device's own
    other.next("registered")
    other.close()
    silent[1].put(pb.DrafterMessage(register=pb.Register(device_id="dev-a", draft_model="m")))
    assert next(calls[1]).WhichOneof("kind") == "registered"  # the newest registers as ever
    calls[1].cancel()
    for q in silent:
        q.put(None)
