"""Telling a wrong address from a slow server before a client's first call.

A call with ``wait_for_ready`` waits for a server that is not up, so a mistyped address looks
like a hang that ends in DEADLINE_EXCEEDED. Before its first call, a client waits until its
channel either connects (READY: go on, and retry as usual from then on) or fails to
(TRANSIENT_FAILURE: the connection cannot be made at all). A server process that is starting
is given ``CONNECT_GRACE_S`` (within the call's deadline) to open its port. An edgespec server
opens its port before it loads its model and serves only once the model is loaded, so a port
that accepts connections and stays silent (``probe``: the HTTP/2 preface gets no answer) is a
server still starting, and is waited for up to the call's deadline (``STARTING_WAIT_S`` without
one). Past that the client says why in words: nothing listening, a server that never started
serving, or something answering that does not speak this channel's gRPC (a TLS mismatch).
A channel still connecting when the call's time is up is left to the call itself.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Literal

import grpc

from ..config import ConfigError

SETTLED = (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE)
PROBE_TIMEOUT_S = 2.0
SILENCE_S = 1.0  # a server that answers the HTTP/2 preface at all does so within this
# a server process starting (a client started with it) is given this long to open its port:
# importing edgespec's server takes a few seconds on a small, loaded machine
CONNECT_GRACE_S = 10.0
STARTING_WAIT_S = 600.0  # a server loading its model, when the call has no deadline
# the HTTP/2 client preface and an empty SETTINGS frame: a gRPC server answers with SETTINGS
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
Probe = Literal["refused", "unresolved", "no answer", "silent", "answered", "unknown"]


class ConnectWatch:
    """Follows a channel's connectivity from a client's first call until the channel
    connects (or ``stop``, before the channel closes). One subscription for all that time: grpc's
    polling thread, subscribed to again before it noticed an unsubscription, may poll a
    channel closed meanwhile and die with a ValueError."""

    def __init__(self, channel: grpc.Channel, address: str):
        self.channel, self.address = channel, address
        self._cond = threading.Condition()
        self._state: grpc.ChannelConnectivity | None = None
        self._subscribed = False

    def unreachable_reason(self, timeout: float | None) -> str | None:
        """None when the channel connects (or is still connecting after ``timeout`` seconds);
        else a sentence saying why it cannot."""
        with self._cond:
            subscribe = not self._subscribed
            self._subscribed = True
        if subscribe:
            self.channel.subscribe(self._record, try_to_connect=True)
        began = time.monotonic()
        with self._cond:
            self._cond.wait_for(lambda: self._state in SETTLED, timeout)
            state = self._state
        if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE and \
                not _ready_within(self.channel, _grace(timeout)):
            kind, why = probe(self.address)
            if kind != "silent" or not _ready_within(
                    self.channel, _starting_wait(timeout, time.monotonic() - began)):
                return f"{why} (waited {time.monotonic() - began:.0f} s)"
        self.stop()  # connected, or left to the call: the client asks no more
        return None

    def stop(self) -> None:
        with self._cond:
            subscribed, self._subscribed = self._subscribed, False
        if subscribed:
            self.channel.unsubscribe(self._record)

    def _record(self, state: grpc.ChannelConnectivity) -> None:
        with self._cond:
            self._state = state
            self._cond.notify_all()


async def unreachable_reason_aio(channel: grpc.aio.Channel, address: str,
                                 timeout: float | None) -> str | None:
    """``unreachable_reason`` for a grpc.aio channel."""
    began = time.monotonic()
    try:
        state = await asyncio.wait_for(_settled_state(channel), timeout)
    except asyncio.TimeoutError:
        return None
    if state == grpc.ChannelConnectivity.READY or \
            await _ready_within_aio(channel, _grace(timeout)):
        return None
    kind, why = await asyncio.get_running_loop().run_in_executor(None, probe, address)
    if kind == "silent" and await _ready_within_aio(
            channel, _starting_wait(timeout, time.monotonic() - began)):
        return None
    return f"{why} (waited {time.monotonic() - began:.0f} s)"


async def _ready_within_aio(channel: grpc.aio.Channel, seconds: float) -> bool:
    try:
        await asyncio.wait_for(channel.channel_ready(), seconds)
        return True
    except asyncio.TimeoutError:
        return False


def _starting_wait(timeout: float | None, spent: float) -> float:
    """How much longer a silent (starting) server is waited for: the rest of the deadline."""
    return STARTING_WAIT_S if timeout is None else max(0.0, timeout - spent)


def _grace(timeout: float | None) -> float:
    return CONNECT_GRACE_S if timeout is None else max(0.0, min(timeout, CONNECT_GRACE_S))


def _ready_within(channel: grpc.Channel, seconds: float) -> bool:
    """Whether the channel connects within ``seconds`` (it keeps trying meanwhile)."""
    ready = grpc.channel_ready_future(channel)
    try:
        ready.result(timeout=seconds)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        ready.cancel()  # its subscription ends with it


async def _settled_state(channel: grpc.aio.Channel) -> grpc.ChannelConnectivity:
    state = channel.get_state(try_to_connect=True)
    while state not in SETTLED:
        await channel.wait_for_state_change(state)
        state = channel.get_state(try_to_connect=True)
    return state


def describe_failure(address: str) -> str:
    """Why a gRPC connection to ``address`` failed, in words (``probe``'s sentence)."""
    return probe(address)[1]


def probe(address: str) -> tuple[Probe, str]:
    """One plain TCP connection to ``address`` sending the HTTP/2 preface: what is there, and a
    sentence saying it. "silent": the port accepts connections and answers nothing (a server
    that opened its port and is not serving yet); "answered": something answers, yet the gRPC
    connection failed (a TLS mismatch, or not a gRPC server)."""
    host_port = split_address(address)
    if host_port is None:
        return "unknown", f"cannot connect to {address}"
    try:
        with socket.create_connection(host_port, timeout=PROBE_TIMEOUT_S) as conn:
            conn.settimeout(SILENCE_S)
            try:
                conn.sendall(H2_PREFACE)
                conn.recv(64)  # an answer, or b"" when the peer closes: it is not starting
            except TimeoutError:
                return "silent", (f"{address} accepts connections but does not answer: a "
                                  "server that has not started serving (still loading its "
                                  "model?), or not a gRPC server")
            except OSError:
                pass  # reset by the peer: something there refuses this kind of connection
    except ConnectionRefusedError:
        return "refused", f"nothing is listening at {address}"
    except socket.gaierror as e:
        return "unresolved", f"cannot resolve the host of {address}: {e.strerror}"
    except TimeoutError:
        return "no answer", f"nothing answers at {address} (is the host up and the port open?)"
    except OSError as e:
        return "refused", f"nothing is listening at {address} ({e.strerror or e})"
    return "answered", (f"{address} answers but the gRPC connection failed: a TLS mismatch "
                        "(a TLS server without --tls/--tls-ca, or the reverse) or not an "
                        "edgespec server?")


def split_address(address: str) -> tuple[str, int] | None:
    """``host:port``, ``[v6]:port`` or ``dns:///host:port`` as (host, port); None for other
    forms (unix sockets, ...)."""
    if address.startswith("dns:///"):
        address = address[len("dns:///"):]
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or "/" in host:
        return None
    if host.startswith("[") and host.endswith("]"):
        return host[1:-1], int(port)
    return None if ":" in host else (host, int(port))


def check_address(address: str, option: str) -> None:
    """Refuse (ConfigError) an address gRPC would misread: one with a scheme (``http://``) or
    without a port (gRPC would try 443). Accepted: ``HOST:PORT``, ``[V6]:PORT``,
    ``dns:///HOST:PORT`` and unix sockets (``unix:PATH``)."""
    if address.startswith(("unix:", "unix-abstract:")):
        return
    example = "e.g. 127.0.0.1:50051"
    if "://" in address and not address.startswith("dns:///"):
        raise ConfigError(f"{option} {address!r}: give HOST:PORT without a scheme ({example})")
    if split_address(address) is None:
        raise ConfigError(f"{option} {address!r}: give HOST:PORT, the port included ({example})")
