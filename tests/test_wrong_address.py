"""A wrong server address fails with words, not a bare deadline: the SDK (blocking and asyncio)
waits within the call's deadline for a server that may still come up, then raises Unavailable
"nothing is listening at ADDR (waited N s)"; ``edgespec status`` prints it and exits non-zero;
a TLS mismatch is said at once. No timing is asserted: a wait would show up as a hung test."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest

import edgespec
from edgespec.wire.reachability import describe_failure, split_address
from edgespec.wire.channels import free_port


@pytest.fixture()
def nowhere() -> str:
    """An address nothing listens at."""
    return f"127.0.0.1:{free_port()}"


def test_the_client_waits_its_deadline_then_says_nothing_is_listening(nowhere, caplog):
    with caplog.at_level("WARNING", logger="edgespec.client"):
        with edgespec.Client(nowhere, timeout=2) as client:
            with pytest.raises(edgespec.Unavailable,
                               match=f"nothing is listening at {nowhere} \\(waited"):
                client.generate("hello", max_new_tokens=4)
    assert f"waiting for a server at {nowhere}" in caplog.text  # said while it waits
    with edgespec.Client(nowhere, timeout=1) as client:
        with pytest.raises(edgespec.Unavailable, match=f"nothing is listening at {nowhere}"):
            client.status()


def test_without_a_deadline_the_first_contact_waits_the_default(nowhere, monkeypatch):
    from edgespec.wire import reachability

    assert reachability.FIRST_CONTACT_WAIT_S >= 60  # the default is at least a minute
    monkeypatch.setattr(reachability, "FIRST_CONTACT_WAIT_S", 1.0)
    with edgespec.Client(nowhere) as client:
        with pytest.raises(edgespec.Unavailable, match="nothing is listening"):
            client.generate("hello", max_new_tokens=4)


def test_the_async_client_says_nothing_is_listening(nowhere):
    async def generate():
        async with edgespec.AsyncClient(nowhere, timeout=2) as client:
            await client.generate("hello", max_new_tokens=4)

    with pytest.raises(edgespec.Unavailable, match=f"nothing is listening at {nowhere}"):
        asyncio.run(generate())


@pytest.mark.slow  # a process of its own
def test_status_command_says_nothing_is_listening(nowhere):
    r = subprocess.run([sys.executable, "-m", "edgespec_cli", "status", "--address", nowhere,
                        "--timeout", "3"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert f"nothing is listening at {nowhere}" in r.stderr


def test_something_listening_that_is_not_grpc_is_told_apart():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        address = f"127.0.0.1:{s.getsockname()[1]}"
        assert "accepts connections" in describe_failure(address)


def test_a_tls_server_that_loaded_its_model_for_long_is_not_a_certificate_problem():
    """A TLS client started beside a TLS server: the port is silent while the model loads,
    then the server closes plaintext probes (it is up) and the client's channel connects within
    its reconnect backoff. The grace for a failing handshake runs from that first answer, not
    from the call's start (a load over 10 s was called a certificate problem at once)."""
    from edgespec.wire.reachability import CONNECT_GRACE_S, _Waiting

    waiting = _Waiting("127.0.0.1:1", tls=True, timeout=None)
    for spent in (2.0, 12.0, 30.0):
        assert waiting.saw("silent", "loading", spent) is None
    assert waiting.saw("closed", "up", 32.0) is None  # up at last: its handshake gets a grace
    assert waiting.saw("closed", "up", 32.0 + CONNECT_GRACE_S - 1) is None
    failure = waiting.saw("closed", "up", 32.0 + CONNECT_GRACE_S)
    assert failure is not None and "TLS handshake keeps failing" in failure


def test_an_http_port_given_for_the_grpc_one_is_named_as_the_likely_mistake():
    """The SDK pointed at the server's --http-port (an HTTP/1.1 server answers the probe): one
    error naming the likely mix-up, as the drafter's does, at once."""
    import http.server
    import threading

    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with edgespec.Client(f"127.0.0.1:{httpd.server_port}", timeout=60) as client:
            with pytest.raises(edgespec.Unavailable) as e:
                client.generate("hi")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert "answers but not as a gRPC server: the server's --http-port or --metrics-port" \
        in str(e.value), str(e.value)


@pytest.mark.parametrize("address,parts", [
    ("127.0.0.1:50051", ("127.0.0.1", 50051)), ("[::1]:7", ("::1", 7)),
    ("dns:///example.org:443", ("example.org", 443)), ("unix:/tmp/sock", None),
    ("ipv4:127.0.0.1:5", None), ("no-port", None)])
def test_split_address(address, parts):
    assert split_address(address) == parts


def _bound_verifier(model: str):
    """A gRPC server with a Verifier whose Status names ``model``, bound to a free port on
    loopback but not started: (server, address)."""
    from concurrent import futures

    import grpc

    from edgespec.v1 import edgespec_pb2 as pb
    from edgespec.v1 import edgespec_pb2_grpc as pb_grpc

    class Verifier(pb_grpc.VerifierServicer):
        def Status(self, request, context):
            return pb.StatusResponse(model=model)

    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_VerifierServicer_to_server(Verifier(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    return server, f"127.0.0.1:{port}"


def _status_once_started(server, address: str, after_s: float) -> str:
    """The model a client's first call reads, the server starting ``after_s`` into it."""
    import threading

    late = threading.Timer(after_s, server.start)
    late.start()
    try:
        with edgespec.Client(address, timeout=120) as client:
            return client.status()["model"]
    finally:
        late.join()
        server.stop(0)


def test_a_server_that_comes_up_late_is_waited_for():
    """A client started before its server (start order, a restart) is not refused: the server
    listening a moment later answers the first call."""
    server, address = _bound_verifier("late")
    assert _status_once_started(server, address, 0.5) == "late"


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_closed_client_leaves_no_grpc_connectivity_poller_behind():
    """A first contact waits through grpc's connectivity poller (a thread of grpc's that goes on
    polling a while after the wait): the client's close waits for it to end, so that closing
    the channel under it (its ValueError "Channel closed!" printed from its thread) cannot
    happen, whether the first contact found the server serving or gave up on it."""
    server, address = _bound_verifier("polled")
    server.start()
    try:
        for addr in (address, f"127.0.0.1:{free_port()}"):  # serving; nothing listening
            # the serving one waited for as long as a loaded machine needs; nothing is
            # listening at the other: a second is enough to give up on it
            client = edgespec.Client(addr, timeout=60.0 if addr == address else 1.0)
            channel, polling_at_close = client.channel, []
            if not hasattr(channel, "_connectivity_state"):
                pytest.skip("this grpc keeps no connectivity poller where edgespec reads it")
            close = channel.close
            channel.close = lambda: (
                polling_at_close.append(channel._connectivity_state.polling), close())
            try:
                assert client.status()["model"] == "polled"
            except edgespec.Unavailable:
                assert addr != address
            client.close()
            assert polling_at_close == [False]
    finally:
        server.stop(0)


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_client_closed_while_its_first_contact_waits_stops_waiting(monkeypatch):
    """A call waiting for a server that is not there (a deadline of ten minutes) while another
    thread closes the client ends, saying the client was closed: its wait is cancelled, not
    waited out on a closed channel, and grpc's poller has ended before the channel closes (its
    ValueError, raised in grpc's thread, fails the test)."""
    import threading

    from edgespec.wire import reachability

    waiting = threading.Event()
    ready_within = reachability.ConnectWatch._ready_within

    def noted(watch, seconds):
        waiting.set()
        return ready_within(watch, seconds)

    monkeypatch.setattr(reachability.ConnectWatch, "_ready_within", noted)
    client = edgespec.Client(f"127.0.0.1:{free_port()}", timeout=600)
    raised: list[Exception] = []

    def call():
        try:
            client.status()
        except Exception as e:  # the call's end, whatever it is, is asserted below
            raised.append(e)

    caller = threading.Thread(target=call)
    caller.start()
    assert waiting.wait(120)
    client.close()
    caller.join(120)
    assert not caller.is_alive(), "the call went on waiting on a closed client"
    assert len(raised) == 1 and isinstance(raised[0], edgespec.Unavailable), raised
    assert "was closed while it waited" in str(raised[0])


def test_a_deadline_before_any_answer_says_so_not_resuming():
    import time

    from edgespec.sdk.stream import Resumer as _Resumer
    from edgespec.v1 import edgespec_pb2 as pb

    res = _Resumer(pb.GenerateRequest(prompt="hi"), 0.01, 8)
    time.sleep(0.05)
    with pytest.raises(edgespec.DeadlineExceeded, match="before the verifier took the request"):
        res.time_left()


def test_a_server_that_opened_its_port_but_does_not_serve_yet_is_waited_for():
    """An edgespec server opens its port, then loads its model, then serves: a client started
    with it sees a port that accepts connections and answers nothing ("silent"), and waits for
    it instead of calling it a TLS mismatch."""
    from edgespec.wire import reachability

    server, address = _bound_verifier("loaded")  # bound, not serving: the model "loads"
    assert reachability.probe(address)[0] == "silent"
    assert _status_once_started(server, address, 2.0) == "loaded"


def test_a_tls_mismatch_is_told_from_a_starting_server():
    """A plaintext server that serves, reached by a TLS client, answers the probe with HTTP/2:
    told as a TLS mismatch at once, not after the deadline."""
    from concurrent import futures

    import grpc

    from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
    from edgespec.wire import reachability

    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_VerifierServicer_to_server(pb_grpc.VerifierServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        assert reachability.probe(f"127.0.0.1:{port}")[0] == "h2"
        with edgespec.Client(f"127.0.0.1:{port}", tls=True, timeout=300) as client:
            with pytest.raises(edgespec.Unavailable, match="TLS mismatch"):
                client.status()
    finally:
        server.stop(0)


def test_without_a_deadline_a_starting_server_is_waited_for_longer():
    """No deadline: two minutes for a port nothing listens at, ten once the port is open (a
    server loading its model, its first start pulling it); a deadline always wins."""
    from edgespec.wire import reachability

    waiting = reachability._Waiting("127.0.0.1:1", tls=False, timeout=None)
    assert waiting.limit == reachability.FIRST_CONTACT_WAIT_S
    assert waiting.saw("refused", "nothing is listening", 1.0) is None
    assert waiting.limit == reachability.FIRST_CONTACT_WAIT_S
    assert waiting.saw("silent", "accepts connections", 2.0) is None
    assert waiting.limit == reachability.STARTING_WAIT_S > reachability.FIRST_CONTACT_WAIT_S
    assert reachability._Waiting("127.0.0.1:1", tls=False, timeout=5).limit == 5
    tls = reachability._Waiting("127.0.0.1:1", tls=True, timeout=None)
    assert "TLS mismatch" in tls.saw("h2", "serves plaintext gRPC", 0.5)
    plain = reachability._Waiting("127.0.0.1:1", tls=False, timeout=None)
    assert "TLS server" in plain.saw("closed", "closed the connection", 0.5)


@pytest.mark.parametrize("address,why", [
    ("127.0.0.1:70000", "0-65535"), ("127.0.0.1:-1", "the port included"),
    ("127.0.0.1", "the port included"), ("http://127.0.0.1:5", "without a scheme")])
def test_a_listen_address_grpc_would_read_as_another_is_refused_naming_it(address, why):
    """gRPC takes a port past 65535 modulo 65536 and an address without one as 443: a server
    would listen where nobody asked. ``bind`` (every role's --listen) refuses them."""
    import grpc

    from edgespec.config import ConfigError
    from edgespec.wire.channels import bind

    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(1))
    with pytest.raises(ConfigError, match=why) as e:
        bind(server, address)
    assert "--listen" in str(e.value)
    assert bind(server, "127.0.0.1:0") > 0  # a free port: still taken
    server.stop(0)


def test_the_status_command_refuses_an_address_without_a_port():
    from cli_inprocess import run_cli

    got = run_cli("status", "--address", "127.0.0.1")
    assert got.returncode == 2 and "--address" in got.stderr
    assert "the port included" in got.stderr


def test_a_port_in_use_or_an_address_not_here_is_said_in_the_error():
    """gRPC and uvicorn say why they cannot listen only in a log line of their own: the
    error names it (a port in use, an address this machine lacks) and the option to change."""
    import grpc

    from concurrent import futures

    from edgespec.config import ConfigError
    from edgespec.wire.channels import bind
    from edgespec.wire.reachability import why_not_listening

    from edgespec.wire.reachability import port_in_use

    free = free_port()
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    server = grpc.server(futures.ThreadPoolExecutor(1))
    try:
        assert port_in_use("127.0.0.1", port)
        with pytest.raises(ConfigError, match="the port is in use") as e:
            bind(server, f"127.0.0.1:{port}")
        assert "another port" in str(e.value) and "--listen" in str(e.value)
        assert "--http-port" in why_not_listening("127.0.0.1", port, "--http-port",
                                                  "--http-host")
        # said in one line, before gRPC logs one of its own (its bind is never tried)
        r = subprocess.run([sys.executable, "-m", "edgespec_cli", "serve", "--listen",
                            f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "the port is in use" in r.stderr, r.stderr
        assert "add_port" not in r.stderr and "Failed to add port" not in r.stderr, r.stderr
        # the HTTP API's port too, before uvicorn logs its own line
        r = subprocess.run([sys.executable, "-m", "edgespec_cli", "serve", "--listen",
                            "127.0.0.1:0", "--http-port", str(port)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "the port is in use" in r.stderr, r.stderr
        assert "--http-port" in r.stderr and "attempting to bind" not in r.stderr, r.stderr
        # the gRPC port itself: said as such
        r = subprocess.run([sys.executable, "-m", "edgespec_cli", "serve", "--listen",
                            f"127.0.0.1:{free}", "--http-port", str(free)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "the server's gRPC port (--listen) is" in r.stderr, r.stderr
    finally:
        server.stop(0)
        held.close()
    # a port whose last connection closed here (TIME_WAIT) is free to gRPC, and so here
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server's side closes first: its port holds a TIME_WAIT
    client.close()
    listener.close()
    assert not port_in_use("127.0.0.1", port)
    # TEST-NET-1 (RFC 5737): an address no machine of the suite's has
    assert "--http-host" in why_not_listening("192.0.2.1", 0, "--http-port", "--http-host")
    assert why_not_listening("127.0.0.1", 0, "--listen") == ""  # a free port: no reason
    # a name IDNA refuses raises UnicodeError, not OSError: said, not a traceback
    assert "does not resolve" in why_not_listening("a..b", 5000, "--listen")
