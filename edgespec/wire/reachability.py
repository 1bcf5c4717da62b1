"""Telling a wrong address from a slow server before a client's first call.

A call with ``wait_for_ready`` waits for a server that is not up, so a mistyped address looks
like a hang that ends in DEADLINE_EXCEEDED. Before its first call, a client waits until its
channel either connects (READY: go on, and retry as usual from then on) or fails to
(TRANSIENT_FAILURE: the connection cannot be made at all). A server that is starting is given
``CONNECT_GRACE_S`` (within the call's deadline) to come up; past that the client says why in
words: nothing listening, or something listening that does not speak this channel's gRPC.
A channel still connecting when the call's time is up is left to the call itself.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import grpc

SETTLED = (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE)
PROBE_TIMEOUT_S = 2.0
CONNECT_GRACE_S = 3.0  # a server starting up (a client started first) is waited for this long


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
        with self._cond:
            self._cond.wait_for(lambda: self._state in SETTLED, timeout)
            state = self._state
        if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE and \
                not _ready_within(self.channel, _grace(timeout)):
            return f"{describe_failure(self.address)} (waited {_grace(timeout):g} s)"
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
    try:
        state = await asyncio.wait_for(_settled_state(channel), timeout)
    except asyncio.TimeoutError:
        return None
    if state == grpc.ChannelConnectivity.READY:
        return None
    try:  # a server starting up
        await asyncio.wait_for(channel.channel_ready(), _grace(timeout))
        return None
    except asyncio.TimeoutError:
        pass
    why = await asyncio.get_running_loop().run_in_executor(None, describe_failure, address)
    return f"{why} (waited {_grace(timeout):g} s)"


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
    """Why a gRPC connection to ``address`` failed, from one plain TCP connection attempt."""
    host_port = split_address(address)
    if host_port is None:
        return f"cannot connect to {address}"
    try:
        with socket.create_connection(host_port, timeout=PROBE_TIMEOUT_S):
            pass
    except ConnectionRefusedError:
        return f"nothing is listening at {address}"
    except socket.gaierror as e:
        return f"cannot resolve the host of {address}: {e.strerror}"
    except TimeoutError:
        return f"nothing answers at {address} (is the host up and the port open?)"
    except OSError as e:
        return f"nothing is listening at {address} ({e.strerror or e})"
    return (f"{address} accepts connections but the gRPC connection failed: a TLS mismatch "
            "(a TLS server without --tls/--tls-ca, or the reverse) or not an edgespec server?")


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
