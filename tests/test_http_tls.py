"""A server with ``--tls-client-ca`` (mutual TLS): a client must present a certificate the CA
signed on the OpenAI-compatible port too, not on gRPC's alone; one that does is served, and
``edgespec status`` reads it with its own certificate (``--tls-cert``, ``--tls-key``)."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request

import pytest

from edgespec.config import EngineConfig
from edgespec_cli.server import EdgespecServer, ServerOptions

pytestmark = pytest.mark.slow  # a server: not the fast tier


def _models(base: str, context: ssl.SSLContext) -> int:
    with urllib.request.urlopen(base + "/v1/models", context=context, timeout=60) as r:
        return r.status


def test_mutual_tls_holds_on_the_http_api_too_and_status_reads_it(tiny_dir, pki, capsys):
    from edgespec_cli.main import main

    d = pki
    srv = EdgespecServer(ServerOptions(
        listen="127.0.0.1:0", model=str(tiny_dir), tls_cert=str(d / "server.pem"),
        tls_key=str(d / "server.key"), tls_client_ca=str(d / "ca.pem"), http_port=0,
        engine=EngineConfig(max_sessions=1, max_context=128))).start()
    try:
        base = f"https://127.0.0.1:{srv.http_port}"
        anonymous = ssl.create_default_context(cafile=str(d / "ca.pem"))
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
            _models(base, anonymous)  # the handshake fails without a client certificate
        rogue = ssl.create_default_context(cafile=str(d / "ca.pem"))
        rogue.load_cert_chain(str(d / "rogue.pem"), str(d / "rogue.key"))
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
            _models(base, rogue)  # nor with one another CA signed
        client = ssl.create_default_context(cafile=str(d / "ca.pem"))
        client.load_cert_chain(str(d / "client.pem"), str(d / "client.key"))
        assert _models(base, client) == 200
        status = ["status", "--address", f"127.0.0.1:{srv.port}", "--tls-ca",
                  str(d / "ca.pem"), "--json", "--timeout", "30"]
        assert main(status + ["--tls-cert", str(d / "client.pem"), "--tls-key",
                              str(d / "client.key")]) == 0
        assert '"kv_slots": 1' in capsys.readouterr().out
        assert main(status + ["--timeout", "2"]) == 1  # no certificate: no status
    finally:
        srv.stop(drain_timeout_s=0)


def test_a_client_ca_that_is_not_a_certificate_is_refused_naming_it(pki, tmp_path):
    import grpc
    from concurrent import futures

    from edgespec.config import ConfigError
    from edgespec.wire.channels import bind

    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    server = grpc.server(futures.ThreadPoolExecutor(1))
    for ca, needle in ((junk, "not a PEM certificate"), (tmp_path / "none.pem", "cannot read")):
        with pytest.raises(ConfigError, match=needle) as e:
            bind(server, "127.0.0.1:0", str(pki / "server.pem"), str(pki / "server.key"),
                 client_ca=str(ca))
        assert "--tls-client-ca" in str(e.value)
    assert bind(server, "127.0.0.1:0", str(pki / "server.pem"), str(pki / "server.key"),
                client_ca=str(pki / "ca.pem")) > 0
    server.stop(0)
