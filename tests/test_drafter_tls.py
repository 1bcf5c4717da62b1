"""A board and a TLS cache: a plaintext board at a cache that completes a TLS handshake stops at
its first attach with one line (the ``edgespec drafter`` command's status 2), where it retried
for ever. Nothing less sure stops a board: something that closes plaintext connections without
being TLS (a forwarder whose backend is down), a TLS board whose handshake fails (it retries,
saying what to check), and a trusting board that a TLS cache refuses UNAVAILABLE (draining, no
verifier yet) all retry."""

from __future__ import annotations

import logging
import socket
import threading
from concurrent import futures

import grpc
import pytest

from cache_harness import (WAIT_S, SlotDrafter, run_agent, self_signed_certificate,
                           what_ends_the_first_attach)
from drafter_node.agent import DrafterAgent
from edgespec.config import ConfigError
from edgespec.wire.reachability import probe, speaks_tls

pytestmark = pytest.mark.slow  # servers and handshakes


def _abort_attach(requests, context):
    context.abort(grpc.StatusCode.UNAVAILABLE, "no verifier has registered a target yet")


@pytest.fixture(scope="module")
def tls_cache(tmp_path_factory):
    """A gRPC server speaking TLS with a self-signed certificate for 127.0.0.1, whose draft
    cache refuses every Attach UNAVAILABLE as a cache with no target yet does; its address and
    the certificate's path."""
    cert, key = self_signed_certificate(tmp_path_factory.mktemp("tls"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "edgespec.v1.DraftCache",
        {"Attach": grpc.stream_stream_rpc_method_handler(_abort_attach)})])
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    yield f"127.0.0.1:{port}", cert
    server.stop(0)


@pytest.fixture()
def closes_unanswered():
    """A TCP server that accepts each connection and closes it at once, as a forwarder whose
    backend is not up does: not TLS."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve():
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    done.set()
    listener.close()


def _retries(agent: DrafterAgent, n: int) -> list[str]:
    """Run ``agent`` until it has retried ``n`` times (failing the test if it stops first);
    what it logged for each retry."""
    seen: list[str] = []
    log_retry = agent._log_retry

    def counted(error, wait, **kw):
        log_retry(error, wait, **kw)
        seen.append("" if error is None else str(error.details()))

    agent._log_retry = counted  # type: ignore[method-assign]
    t, errors = run_agent(agent)
    try:
        for _ in range(WAIT_S * 20):
            if len(seen) >= n or not t.is_alive():
                break
            t.join(0.05)
    finally:
        agent.stop()
        t.join(WAIT_S)
    assert not errors, f"the agent stopped: {errors}"
    assert len(seen) >= n
    return seen


def test_a_plaintext_board_at_a_tls_cache_stops_saying_so(tls_cache):
    address, _ = tls_cache
    assert probe(address)[0] == "closed" and speaks_tls(address)
    error = what_ends_the_first_attach(DrafterAgent(address, "edge-plain", SlotDrafter(),
                                                    backoff_max_s=0.2))
    assert isinstance(error, ConfigError)
    assert "speaks TLS, this drafter plaintext: give the drafter --tls" in str(error)


def test_something_that_closes_connections_without_tls_is_waited_for(closes_unanswered):
    assert probe(closes_unanswered)[0] == "closed" and not speaks_tls(closes_unanswered)
    _retries(DrafterAgent(closes_unanswered, "edge-forwarded", SlotDrafter(),
                          backoff_max_s=0.2), 4)


def test_a_tls_board_whose_handshake_fails_retries_saying_what_to_check(tls_cache, caplog):
    caplog.set_level(logging.WARNING, logger="edgespec.drafter")
    address, _ = tls_cache  # its certificate is not among the system's roots
    seen = _retries(DrafterAgent(address, "edge-untrusting", SlotDrafter(), tls=True,
                                 backoff_max_s=0.2), 4)
    assert all("handshake failed" in s.lower() for s in seen), seen
    warning = next(r.getMessage() for r in caplog.records if r.name == "edgespec.drafter")
    assert "is the cache's certificate signed by the CA given (--tls-ca" in warning


def test_a_trusting_board_refused_unavailable_by_a_tls_cache_retries(tls_cache):
    """Its handshake succeeds and the cache refuses it for now (no verifier yet): an outage,
    however long it lasts."""
    address, cert = tls_cache
    seen = _retries(DrafterAgent(address, "edge-trusting", SlotDrafter(), tls_ca=str(cert),
                                 backoff_max_s=0.2), 4)
    assert all("no verifier has registered a target yet" in s for s in seen), seen
