"""Link emulation's delaying TCP proxy on real traffic: payloads and byte order unchanged, the
RTT, handshake and bandwidth waited, connections closed from either side and left with no
threads, gRPC calls through it. The link model and the device profiles without a socket:
tests/test_link_and_device_profiles.py.

Real loopback servers only; timing assertions are lower bounds (the machine may be loaded)."""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from edgespec_cli.deployment.link_emulation import LinkProfile, LinkProxy, split_host_port

SLACK_S = 0.001  # timer and clock granularity; delays are never shorter than configured


class _Echo(socketserver.BaseRequestHandler):
    """Echo every byte; on the client's EOF, half-close back."""

    def handle(self):
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
            self.request.shutdown(socket.SHUT_WR)
        except OSError:
            pass


@pytest.fixture
def echo_address():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def connect(address: str) -> socket.socket:
    sock = socket.create_connection(split_host_port(address), timeout=20)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_until_eof(sock: socket.socket) -> bytes:
    parts = []
    while data := sock.recv(1 << 16):
        parts.append(data)
    return b"".join(parts)


def exchange(address: str, chunks: list[bytes], gap_s: float = 0.0) -> bytes:
    """Send ``chunks`` (then EOF) from a thread while reading the reply until EOF."""
    with connect(address) as sock:
        def send():
            for chunk in chunks:
                sock.sendall(chunk)
                if gap_s:
                    time.sleep(gap_s)
            sock.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        reply = read_until_eof(sock)
        sender.join()
    return reply


def round_trip(sock: socket.socket, message: bytes) -> float:
    start = time.monotonic()
    sock.sendall(message)
    got = b""
    while len(got) < len(message):
        got += sock.recv(len(message) - len(got))
    assert got == message
    return time.monotonic() - start


def wait_until(condition, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# --- the proxy on real traffic


def test_large_payload_passes_unchanged_both_ways(echo_address):
    payload = os.urandom(3 * 1024 * 1024)
    profile = LinkProfile(rtt_ms=2, jitter_ms=1)
    with LinkProxy(echo_address, profile, seed=1) as proxy:
        assert exchange(proxy.address, [payload[i:i + 100_000]
                                        for i in range(0, len(payload), 100_000)]) == payload
        assert proxy.counters() == {"connections": 1, "bytes_to_target": len(payload),
                                    "bytes_from_target": len(payload), "retransmissions": 0}


def test_byte_order_survives_heavy_jitter(echo_address):
    chunks = [f"<{i:04d}>".encode() for i in range(150)]
    with LinkProxy(echo_address, LinkProfile(rtt_ms=4, jitter_ms=30), seed=7) as proxy:
        assert exchange(proxy.address, chunks, gap_s=0.001) == b"".join(chunks)


def test_round_trip_takes_at_least_the_rtt_and_setup_one_more(echo_address):
    with LinkProxy(echo_address, LinkProfile(rtt_ms=100), seed=1) as proxy:
        start = time.monotonic()  # before the connect: the handshake's wait starts at accept
        with connect(proxy.address) as sock:
            # the first bytes wait for the emulated handshake (one RTT), then a round trip
            round_trip(sock, b"hello")
            assert time.monotonic() - start >= 0.2 - SLACK_S
            assert round_trip(sock, b"again") >= 0.1 - SLACK_S


def test_bandwidth_delays_by_serialisation_time(echo_address):
    payload = os.urandom(250_000)  # 2 Mbit at 8 Mbit/s: 0.25 s each way
    with LinkProxy(echo_address, LinkProfile(rtt_ms=0, bandwidth_mbps=8)) as proxy:
        start = time.monotonic()
        assert exchange(proxy.address, [payload]) == payload
        assert time.monotonic() - start >= 0.25 - SLACK_S


def test_no_loss_means_no_retransmission(echo_address):
    with LinkProxy(echo_address, LinkProfile(rtt_ms=1, jitter_ms=1, loss=0.0), seed=3) as proxy:
        for _ in range(5):
            assert exchange(proxy.address, [os.urandom(50_000)] * 4)
        assert proxy.retransmissions == 0 and proxy.connections == 5


def test_target_closing_first_is_forwarded_to_the_client():
    listener = socket.create_server(("127.0.0.1", 0))

    def greet_and_close():
        conn, _ = listener.accept()
        with conn:
            conn.sendall(b"bye")

    server = threading.Thread(target=greet_and_close)
    server.start()
    try:
        with LinkProxy(f"127.0.0.1:{listener.getsockname()[1]}", LinkProfile(rtt_ms=2)) as proxy:
            with connect(proxy.address) as sock:
                assert read_until_eof(sock) == b"bye"
            assert wait_until(lambda: proxy.active_connections == 0)
    finally:
        server.join(10)
        listener.close()


def test_connections_leave_no_tasks_or_threads(echo_address):
    proxy = LinkProxy(echo_address, LinkProfile(rtt_ms=1)).start()
    try:
        for i in range(20):
            assert exchange(proxy.address, [b"x" * (i + 1)]) == b"x" * (i + 1)
        for _ in range(5):  # clients that vanish without a half-close
            connect(proxy.address).close()
        assert wait_until(lambda: proxy.connections == 25 and proxy.active_connections == 0)
        assert len([t for t in threading.enumerate() if t.name.startswith("link-proxy")]) == 1
    finally:
        proxy.stop()
    assert not [t for t in threading.enumerate() if t.name.startswith("link-proxy")]
    proxy.stop()  # idempotent


def test_stop_drops_open_connections(echo_address):
    proxy = LinkProxy(echo_address, LinkProfile(rtt_ms=1)).start()
    with connect(proxy.address) as sock:
        round_trip(sock, b"ping")
        proxy.stop()
        try:
            assert sock.recv(10) == b""
        except ConnectionResetError:
            pass


def test_unreachable_target_closes_the_client_connection():
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        port = placeholder.getsockname()[1]
    with LinkProxy(f"127.0.0.1:{port}", LinkProfile(rtt_ms=0)) as proxy:
        with connect(proxy.address) as sock:
            try:
                assert sock.recv(10) == b""
            except ConnectionResetError:
                pass
        assert wait_until(lambda: proxy.active_connections == 0)


def test_grpc_unary_and_streaming_calls_through_the_proxy():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Status = health_pb2.HealthCheckResponse
    servicer.set("", Status.SERVING)
    servicer.set("svc", Status.SERVING)
    try:
        profile = LinkProfile(rtt_ms=40, bandwidth_mbps=20)
        with LinkProxy(f"127.0.0.1:{port}", profile, seed=5) as proxy, grpc.insecure_channel(
                proxy.address, options=[("grpc.enable_http_proxy", 0)]) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="")
            assert stub.Check(request, timeout=20).status == Status.SERVING
            start = time.monotonic()
            assert stub.Check(request, timeout=20).status == Status.SERVING
            assert time.monotonic() - start >= 0.04 - SLACK_S
            calls = [stub.Check.future(request, timeout=20) for _ in range(8)]  # multiplexed
            assert all(c.result().status == Status.SERVING for c in calls)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="svc"), timeout=20)
            assert next(watch).status == Status.SERVING
            servicer.set("svc", Status.NOT_SERVING)
            assert next(watch).status == Status.NOT_SERVING
            watch.cancel()
            assert proxy.connections >= 1
            assert proxy.bytes_to_target > 0 and proxy.bytes_from_target > 0
    finally:
        server.stop(None)
