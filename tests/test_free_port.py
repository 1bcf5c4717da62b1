"""``free_port``: a loopback port nothing listens on, never one this process was given among
its last 64 (a server asks for two in a row, its gRPC and HTTP ports; the kernel handed the
port it had just freed out again now and then, and the server refused the pair)."""

from __future__ import annotations

import socket
from collections import deque

from edgespec.wire import channels


class _Kernel:
    """A socket whose port 0 binds to the next of ``ports``: a kernel that hands one out
    again."""

    def __init__(self, ports: list[int]):
        self.ports = ports

    def __call__(self, *args):
        kernel = self

        class _Socket:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def bind(self, address):
                self.port = kernel.ports.pop(0)

            def getsockname(self):
                return ("127.0.0.1", self.port)

        return _Socket()


def test_a_port_handed_out_again_by_the_kernel_is_not_given_twice(monkeypatch):
    monkeypatch.setattr(channels, "_handed_out", deque(maxlen=64), raising=False)
    monkeypatch.setattr(channels.socket, "socket", _Kernel([41001, 41001, 41001, 41002]))
    assert [channels.free_port(), channels.free_port()] == [41001, 41002]


def test_ports_in_a_row_are_distinct_and_free():
    ports = [channels.free_port() for _ in range(64)]
    assert len(set(ports)) == 64
    for port in ports[-4:]:  # nothing listens: each binds
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
