"""A board and a TLS cache that can never agree stop at the first attach with one line (the
``edgespec drafter`` command's status 2), where they retried for ever: a plaintext board at a
TLS cache (the cache closes its connections unanswered), and a TLS board whose handshake keeps
failing (a certificate the board does not trust), after the same grace the SDK gives one. A
board that trusts the certificate gets through."""

from __future__ import annotations

import shutil
import subprocess
from concurrent import futures

import grpc
import pytest

from cache_harness import SlotDrafter, what_ends_the_first_attach
from drafter_node.agent import DrafterAgent
from edgespec.config import ConfigError

pytestmark = pytest.mark.slow  # a server and handshakes


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """A gRPC server speaking TLS with a self-signed certificate for 127.0.0.1 (no service:
    what is read is the handshake), and the certificate's path."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate (apt-get install openssl)")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", d / "key.pem", "-out", d / "cert.pem"],
                   check=True, capture_output=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    creds = grpc.ssl_server_credentials([((d / "key.pem").read_bytes(),
                                          (d / "cert.pem").read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    yield f"127.0.0.1:{port}", d / "cert.pem"
    server.stop(0)


def test_a_plaintext_board_at_a_tls_cache_stops_saying_so(tls_server):
    address, _ = tls_server
    error = what_ends_the_first_attach(DrafterAgent(address, "edge-plain", SlotDrafter(),
                                                    backoff_max_s=0.2))
    assert isinstance(error, ConfigError)
    assert "closes a plaintext connection without answering: a TLS server? give the drafter " \
           "--tls" in str(error)


def test_a_tls_board_that_does_not_trust_the_certificate_stops_after_the_grace(
        tls_server, monkeypatch):
    import edgespec.wire.reachability as reachability

    import drafter_node.first_attach as first_attach

    monkeypatch.setattr(first_attach, "CONNECT_GRACE_S", 0.5)  # the SDK's 10 s, scaled down
    assert reachability.CONNECT_GRACE_S == 10.0
    address, _ = tls_server
    error = what_ends_the_first_attach(DrafterAgent(address, "edge-untrusting", SlotDrafter(),
                                                    tls=True, backoff_max_s=0.2))
    assert isinstance(error, ConfigError)
    assert "speaks TLS but the TLS handshake keeps failing" in str(error)
    assert "--tls-ca" in str(error)


def test_a_board_that_trusts_the_certificate_is_not_refused(tls_server):
    """Its handshake succeeds: no settings error ends it (the test server has no draft cache,
    so its attach fails otherwise, and it retries)."""
    from drafter_node.first_attach import settings_refusal
    from edgespec.wire.reachability import probe

    address, cert = tls_server
    found, _ = probe(address)
    assert found == "closed"  # what a plaintext probe of a TLS server sees
    assert settings_refusal(address, found, tls=True, closed_for_s=0.0, details="") is None
    channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(cert.read_bytes()))
    try:
        grpc.channel_ready_future(channel).result(timeout=30)  # the handshake the board makes
    finally:
        channel.close()
