"""Link emulation (a delaying TCP proxy) and the emulated device profiles.

Real loopback servers only; timing assertions are lower bounds (the machine may be loaded)."""

from __future__ import annotations

import os
import random
import socket
import socketserver
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from edgespec.config import ConfigError
from edgespec_cli.deployment.device_profiles import (PROFILES, DeviceProfile, fleet_profiles,
                                                     parse_profiles)
from edgespec_cli.deployment.link_emulation import (LinkDirection, LinkProfile, LinkProxy,
                                                    split_host_port)

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


# --- the link model


def test_bandwidth_queues_chunks_behind_earlier_ones():
    link = LinkDirection(LinkProfile(rtt_ms=0, bandwidth_mbps=8), random.Random(0))
    assert link.arrival(0.0, 1000) == pytest.approx(0.001)
    assert link.arrival(0.0, 1000) == pytest.approx(0.002)
    assert link.arrival(1.0, 1000) == pytest.approx(1.001)


def test_loss_delays_chunks_by_the_retransmission_timeout():
    profile = LinkProfile(rtt_ms=10, loss=0.3)
    link = LinkDirection(profile, random.Random(42))
    arrivals = [link.arrival(0.0, 1000) for _ in range(200)]
    assert link.retransmissions > 0
    assert min(arrivals) >= 0.005
    assert max(arrivals) >= 0.005 + profile.rto_s
    assert LinkProfile(rtt_ms=10).rto_s == 0.2 and LinkProfile(rtt_ms=300).rto_s == 0.6


def test_no_loss_never_retransmits_in_the_model():
    link = LinkDirection(LinkProfile(rtt_ms=10, jitter_ms=5), random.Random(0))
    assert all(link.retransmission_delay_s(10 ** 6) == 0 for _ in range(100))
    assert link.retransmissions == 0


def test_jitter_varies_the_delay_and_a_negative_draw_is_clamped_to_zero():
    """Jitter far above the one-way delay (1 ms): about half the draws would be negative; they
    are delivered at once (0 s), not reflected or redrawn, and the rest vary around 1 ms."""
    link = LinkDirection(LinkProfile(rtt_ms=2, jitter_ms=50), random.Random(0))
    delays = [link.propagation_s() for _ in range(1000)]
    clamped = sum(d == 0.0 for d in delays)
    assert 300 < clamped < 700 and min(delays) == 0.0
    assert len(set(delays)) > 300  # the others vary
    steady = LinkDirection(LinkProfile(rtt_ms=2, jitter_ms=0), random.Random(0))
    assert {steady.propagation_s() for _ in range(10)} == {0.001}


@pytest.mark.parametrize("kwargs", [
    {"rtt_ms": -1}, {"rtt_ms": float("nan")}, {"rtt_ms": float("inf")},
    {"rtt_ms": 10, "jitter_ms": -0.5}, {"rtt_ms": 10, "loss": 1.0},
    {"rtt_ms": 10, "loss": -0.1}, {"rtt_ms": 10, "bandwidth_mbps": 0},
    {"rtt_ms": 10, "bandwidth_mbps": -5},
])
def test_invalid_link_profiles_are_refused(kwargs):
    with pytest.raises(ConfigError):
        LinkProfile(**kwargs)


def test_describe():
    assert LinkProfile(30, 5, 0.01, 20).describe() == "rtt 30 ms ±5, loss 1%, 20 Mbit/s"
    assert LinkProfile(0).describe() == "rtt 0 ms, unlimited bandwidth"


@pytest.mark.parametrize("address", ["nohost", "host:", ":50051", "host:port", "host:70000"])
def test_bad_target_addresses_are_refused(address):
    with pytest.raises(ConfigError):
        LinkProxy(address, LinkProfile(1))


def test_split_host_port():
    assert split_host_port("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert split_host_port("[::1]:80") == ("::1", 80)


# --- device profiles


def test_shipped_profiles_are_valid_and_their_drafters_parse():
    from edgespec.drafters import parse_drafter_spec

    assert {"local", "rpi5", "jetson-orin-nano", "phone-lte", "rpi5-llamacpp",
            "jetson-orin-nano-llamacpp", "local-llamacpp"} <= set(PROFILES)
    for name, profile in PROFILES.items():
        assert profile.name == name and profile.description
        assert profile.compute_slowdown >= 1
        parse_drafter_spec(profile.drafter, allowed=("mag", "model", "llamacpp"))
    local = PROFILES["local"]
    assert local.compute_slowdown == 1 and local.link.rtt_ms == 0 and not local.link.loss


def test_parse_profiles():
    assert [p.name for p in parse_profiles(" rpi5, phone-lte,rpi5 ")] == [
        "rpi5", "phone-lte", "rpi5"]
    with pytest.raises(ConfigError, match="jetson-orin-nano"):
        parse_profiles("rpi5,toaster")
    with pytest.raises(ConfigError):
        parse_profiles(" , ")


def test_fleet_profiles_cycle_through_the_list():
    assert [p.name for p in fleet_profiles("rpi5,phone-lte", 5)] == [
        "rpi5", "phone-lte", "rpi5", "phone-lte", "rpi5"]
    assert fleet_profiles(["local"], 2) == [PROFILES["local"]] * 2
    custom = DeviceProfile("slow", "mag", 10.0, LinkProfile(rtt_ms=200))
    assert fleet_profiles([custom, "rpi5"], 3) == [custom, PROFILES["rpi5"], custom]
    for bad in (0, -1):
        with pytest.raises(ConfigError):
            fleet_profiles("rpi5", bad)
    with pytest.raises(ConfigError):
        fleet_profiles([], 1)


def test_device_profile_slowdown():
    with pytest.raises(ConfigError):
        DeviceProfile("fast", "mag", 0.5, LinkProfile(rtt_ms=1))
    assert PROFILES["rpi5"].extra_compute_s(0.01) == pytest.approx(0.02)
    assert PROFILES["local"].extra_compute_s(0.01) == 0


def test_a_device_with_a_published_speed_drafts_no_faster_than_it():
    """A profile's tokens_per_s: a step of n tokens takes at least n / tokens_per_s; a machine
    slower than that adds nothing (it cannot be sped up); the slowdown still applies."""
    jetson = PROFILES["jetson-orin-nano-super-gpu-llamacpp"]
    assert jetson.tokens_per_s == 165.0 and jetson.drafter == "llamacpp:default"
    assert jetson.extra_compute_s(0.01, 33) == pytest.approx(0.19)  # 33 / 165 = 0.2 s
    assert jetson.extra_compute_s(0.5, 33) == 0  # this machine is slower than the board
    assert jetson.extra_compute_s(0.01, 0) == 0
    paced = DeviceProfile("p", "mag", 3.0, LinkProfile(rtt_ms=1), tokens_per_s=100.0)
    assert paced.extra_compute_s(0.1, 4) == pytest.approx(0.2)  # the slowdown is longer
    for bad in (0, -5.0, float("inf")):
        with pytest.raises(ConfigError):
            DeviceProfile("p", "mag", 1.0, LinkProfile(rtt_ms=1), tokens_per_s=bad)


def test_a_paced_drafter_sleeps_to_its_published_speed_and_counts_what_it_cannot(monkeypatch):
    from edgespec.config import SamplingParams
    from edgespec.drafters import MaGDrafter
    from edgespec_cli.deployment import device_emulation

    clock = iter([10.0, 10.01, 20.0, 21.0])
    slept = []
    monkeypatch.setattr(device_emulation.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(device_emulation.time, "sleep", slept.append)
    paced = device_emulation.SlowedDrafter(MaGDrafter(), 1.0, tokens_per_s=100.0)
    session = paced.open([1, 5, 6, 7, 5, 6, 7, 5], SamplingParams())
    n = len(session.propose_tree(4, 1).tokens)
    assert n > 0 and slept[0] == pytest.approx(n / 100 - 0.01)
    session.propose_tree(4, 1)  # a whole second here: slower than the board, nothing added
    assert slept[1] == 0 and paced.slower_than_published == 1
    with pytest.raises(ConfigError):
        device_emulation.SlowedDrafter(MaGDrafter(), 1.0, tokens_per_s=0)


def test_a_slowed_drafter_sleeps_its_slowdown_after_each_proposal(monkeypatch):
    """The simulated device's compute: (slowdown - 1) x each proposal's own time asleep after
    it; the drafts themselves are the inner drafter's."""
    from edgespec.config import SamplingParams
    from edgespec.drafters import MaGDrafter
    from edgespec_cli.deployment import device_emulation

    clock = iter([10.0, 10.5, 20.0, 20.25, 30.0, 30.5])
    slept = []
    monkeypatch.setattr(device_emulation.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(device_emulation.time, "sleep", slept.append)
    slowed = device_emulation.SlowedDrafter(MaGDrafter(), 3.0)
    tokens = [1, 5, 6, 7, 5, 6]
    session = slowed.open(tokens, SamplingParams())
    plain = MaGDrafter().open(tokens, SamplingParams())
    # what the drafting loop calls: a chain (width 1, which MaG drafts with its own propose)
    # and a tree, each slowed once
    assert session.propose_tree(2, 1).tokens == plain.propose_tree(2, 1).tokens
    assert session.propose_tree(2, 2).tokens == plain.propose_tree(2, 2).tokens
    assert slept == [1.0, 0.5]
    assert session.propose(1).tokens == plain.propose(1).tokens and len(slept) == 2
    with pytest.raises(ConfigError):
        device_emulation.SlowedDrafter(MaGDrafter(), 0.5)
