"""TLS switched on with certificate paths: a client that trusts the CA gets through, a
plaintext client does not."""

import pytest

import edgespec
from cache_harness import self_signed_certificate
from procs import start_serve

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


def test_tls_server_serves_trusting_clients_only(certs, tiny_dir, tmp_path):
    cert, key = certs
    serve, address = start_serve(tiny_dir, tmp_path, token="t",
                                 extra=["--tls-cert", cert, "--tls-key", key], tls_ca=cert)
    try:
        with edgespec.Client(address, token="t", tls_ca=str(cert), timeout=60) as c:
            res = c.generate(prompt_ids=[1, 10, 11, 12], max_new_tokens=8)
        assert len(res.token_ids) >= 1
        with edgespec.Client(address, token="t", timeout=5) as plain:
            with pytest.raises(edgespec.EdgespecError):
                plain.generate(prompt_ids=[1, 10, 11, 12], max_new_tokens=8)
    finally:
        code = serve.stop()
    assert code == 0


def test_tls_needs_both_certificate_and_key(tiny_dir, certs):
    from procs import run_edgespec as run_cli

    r = run_cli("serve", "--model", tiny_dir, "--tls-cert", certs[0], "--listen", "127.0.0.1:0")
    assert r.returncode == 2 and "--tls-key" in r.stderr
