"""A client's first contact: wait for a server that is not up yet, and say so; name a wrong
address, a TLS mismatch or a port that is not an edgespec server's, and only when that is what
was seen.

A call with ``wait_for_ready`` waits for a server that is not up, so a mistyped address looks
like a hang that ends in DEADLINE_EXCEEDED. Before its first call, a client waits until its
channel connects (READY: go on, and retry as usual from then on), up to the call's deadline
(without one: ``FIRST_CONTACT_WAIT_S`` for nothing listening yet, ``STARTING_WAIT_S`` once the
port is open and the server loads its model), logging once what it waits for. Meanwhile it
probes the address (``probe``: one TCP connection sending the HTTP/2 preface) every
``RECHECK_S``:

- nothing listening, a host that does not resolve or answer, a port that accepts connections
  and stays silent (an edgespec server opens its port before it loads its model), or a gRPC
  server answering plaintext HTTP/2 to a plaintext channel (it is up; its handshake timed out,
  seen on a loaded 2-core machine while the model loaded): waited for;
- a plaintext gRPC server reached by a TLS channel, a server that closes a plaintext HTTP/2
  connection (a TLS server) reached by a plaintext channel, or something that answers but not
  HTTP/2: a mismatch, said at once;
- a TLS server that a TLS channel cannot complete a handshake with: retried for
  ``CONNECT_GRACE_S`` from when it was first seen up (silent while it loads its model: waited
  for), then called a certificate problem.

When the wait ends without a connection the client says why in words, with the seconds waited.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Literal

import grpc

from ..config import ConfigError

log = logging.getLogger("edgespec.client")

PROBE_TIMEOUT_S = 2.0
SILENCE_S = 1.0  # a server that answers the HTTP/2 preface at all does so within this
FIRST_CONTACT_WAIT_S = 120.0  # a server not up yet, when the call has no deadline
STARTING_WAIT_S = 600.0  # one whose port is open (loading its model: a first pull), likewise
RECHECK_S = 2.0  # how often the address is probed again while waiting
CONNECT_GRACE_S = 10.0  # a TLS handshake failing this long is a certificate problem
POLLER_END_S = 2.0  # grpc's poller ends within 0.2 s of a wait's end; more on a loaded machine
# the HTTP/2 client preface and an empty SETTINGS frame: a gRPC server answers with SETTINGS
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
SETTINGS_FRAME = 4
Probe = Literal["refused", "unresolved", "no answer", "silent", "h2", "closed", "answered",
                "unknown"]
WAITED_FOR = ("refused", "unresolved", "no answer", "silent", "unknown")


class ConnectWatch:
    """A blocking client's first contact (``unreachable_reason``); it holds nothing between
    calls (each wait subscribes through ``channel_ready_future`` and ends its subscription)."""

    def __init__(self, channel: grpc.Channel, address: str, tls: bool = False):
        self.channel, self.address, self.tls = channel, address, tls
        self.closed = False  # the client was closed: no wait starts, a running one ends
        self._lock = threading.Lock()
        self._pending: grpc.Future | None = None  # the running wait's readiness future

    def close(self, timeout: float = POLLER_END_S) -> None:
        """Before the channel is closed: a wait running in another thread is cancelled (its
        call ends saying the client was closed), and grpc's connectivity poller is given up to
        ``timeout`` to end. grpc (1.85) goes on polling in a thread of its own for up to 0.2 s
        after a wait's subscription ends (``channel_ready_future``), and a close that lands
        between its wake-up and its next look at the channel makes that thread raise ValueError
        ("Channel closed!"), printed as a traceback that is no error of the user's. Only a poller
        winding down (nothing subscribed) is waited for: one the user still subscribes to would
        not end. It reads grpc's private ``_connectivity_state``; without it, nothing is waited
        for."""
        with self._lock:
            self.closed = True
            _end_wait(self._pending)  # the waiting call sees ``closed``
        state = getattr(self.channel, "_connectivity_state", None)
        end = time.monotonic() + timeout
        while getattr(state, "polling", False) and \
                not getattr(state, "callbacks_and_connectivities", True) and \
                time.monotonic() < end:
            time.sleep(0.005)

    def unreachable_reason(self, timeout: float | None) -> str | None:
        """None when the channel connects within ``timeout`` seconds (FIRST_CONTACT_WAIT_S when
        None); else a sentence saying why it does not."""
        began = time.monotonic()
        waiting = _Waiting(self.address, self.tls, timeout)
        while True:
            left = waiting.limit - (time.monotonic() - began)
            if self._ready_within(max(0.0, min(RECHECK_S, left))):
                return None
            if self.closed:
                return f"the client of {self.address} was closed while it waited for the server"
            spent = time.monotonic() - began
            failure = waiting.saw(*probe(self.address), spent)
            if failure is not None or spent >= waiting.limit:
                return waiting.verdict(failure, spent)

    def _ready_within(self, seconds: float) -> bool:
        """Whether the channel connects within ``seconds`` (it keeps trying meanwhile); False
        at once, or as soon as it is, once the client is closed."""
        with self._lock:
            if self.closed:
                return False
            ready = self._pending = grpc.channel_ready_future(self.channel)
        try:
            ready.result(timeout=seconds)
            return True
        except (grpc.FutureTimeoutError, grpc.FutureCancelledError):
            return False
        finally:
            with self._lock:
                _end_wait(ready)
                self._pending = None


def _end_wait(ready: grpc.Future | None) -> None:
    """Under the watch's lock: a readiness future's subscription ended, once (grpc's
    ``_ChannelReadyFuture.cancel`` called a second time raises TypeError)."""
    if ready is not None and not ready.done():
        ready.cancel()


async def unreachable_reason_aio(channel: grpc.aio.Channel, address: str,
                                 timeout: float | None, tls: bool = False) -> str | None:
    """``ConnectWatch.unreachable_reason`` for a grpc.aio channel."""
    began = time.monotonic()
    waiting = _Waiting(address, tls, timeout)
    loop = asyncio.get_running_loop()
    while True:
        left = waiting.limit - (time.monotonic() - began)
        if await _ready_within_aio(channel, max(0.0, min(RECHECK_S, left))):
            return None
        kind, why = await loop.run_in_executor(None, probe, address)
        spent = time.monotonic() - began
        failure = waiting.saw(kind, why, spent)
        if failure is not None or spent >= waiting.limit:
            return waiting.verdict(failure, spent)


class _Waiting:
    """What a first contact has seen so far, and whether it is worth waiting for more."""

    def __init__(self, address: str, tls: bool, timeout: float | None):
        self.address, self.tls, self.timeout = address, tls, timeout
        self.why = f"{address} did not connect"
        self.told = False
        self.starting = False  # its port was seen open: a server loading its model
        self.closed_since: float | None = None  # when a TLS server was first seen up, in a row

    @property
    def limit(self) -> float:
        """How long the first contact may wait in all."""
        if self.timeout is not None:
            return self.timeout
        return STARTING_WAIT_S if self.starting else FIRST_CONTACT_WAIT_S

    def verdict(self, failure: str | None, spent: float) -> str | None:
        """The sentence to fail with; None where a call's own deadline ended while the server was
        up or starting (the call then ends DEADLINE_EXCEEDED, as it should)."""
        if failure is None and self.timeout is not None and self.starting:
            return None
        return f"{failure or self.why} (waited {spent:.0f} s)"

    def saw(self, kind: Probe, why: str, spent: float) -> str | None:
        """A failure sentence to give up with, or None to wait on (logged once)."""
        self.why = why
        self.starting = self.starting or kind in ("silent", "h2")
        closed_since = self.closed_since = (
            (spent if self.closed_since is None else self.closed_since)
            if kind == "closed" else None)
        addr = self.address
        if kind == "h2" and self.tls:
            return (f"{addr} serves gRPC without TLS: a TLS mismatch (drop --tls/--tls-ca, or "
                    "start the server with --tls-cert/--tls-key)")
        if kind == "closed" and not self.tls:
            return (f"{addr} closes a plaintext HTTP/2 connection: a TLS server (give --tls or "
                    "--tls-ca) or not an edgespec server?")
        # the grace runs from when the server was first seen up: one that loaded its model
        # for longer (silent meanwhile) is not a certificate problem at its first answer
        if closed_since is not None and spent - closed_since >= CONNECT_GRACE_S:
            return (f"{addr} speaks TLS but the TLS handshake keeps failing: is its certificate "
                    "signed by the CA given (--tls-ca), and for this host name?")
        if kind == "answered":
            return (f"{addr} answers but not as a gRPC server: the server's --http-port or "
                    "--metrics-port (give its gRPC address, serve's --listen), another "
                    "program, or a TLS mismatch?")
        if not self.told:
            self.told = True
            what = "the server to start serving" if kind in ("silent", "h2") else "a server"
            log.warning("waiting for %s at %s (%s); up to %.0f s", what, addr, why, self.limit)
        return None


async def _ready_within_aio(channel: grpc.aio.Channel, seconds: float) -> bool:
    try:
        await asyncio.wait_for(channel.channel_ready(), seconds)
        return True
    except asyncio.TimeoutError:
        return False


def describe_failure(address: str) -> str:
    """Why a gRPC connection to ``address`` failed, in words (``probe``'s sentence)."""
    return probe(address)[1]


def probe(address: str) -> tuple[Probe, str]:
    """One plain TCP connection to ``address`` sending the HTTP/2 preface: what is there, and a
    sentence saying it. "silent": the port accepts connections and answers nothing (a server
    that opened its port and is not serving yet); "h2": a plaintext HTTP/2 (gRPC) server
    answered; "closed": the peer closed or reset without answering (a TLS server does);
    "answered": something answered that is not HTTP/2."""
    host_port = split_address(address)
    if host_port is None:
        return "unknown", f"cannot connect to {address}"
    try:
        with socket.create_connection(host_port, timeout=PROBE_TIMEOUT_S) as conn:
            conn.settimeout(SILENCE_S)
            try:
                conn.sendall(H2_PREFACE)
                answer = conn.recv(64)
            except TimeoutError:
                return "silent", (f"{address} accepts connections but does not answer yet: a "
                                  "server that has not started serving (still loading its "
                                  "model?)")
            except OSError:
                answer = b""  # reset by the peer: something there refuses this connection
    except ConnectionRefusedError:
        return "refused", f"nothing is listening at {address}"
    except socket.gaierror as e:
        return "unresolved", f"cannot resolve the host of {address}: {e.strerror}"
    except TimeoutError:
        return "no answer", f"nothing answers at {address} (is the host up and the port open?)"
    except OSError as e:
        return "refused", f"nothing is listening at {address} ({e.strerror or e})"
    if len(answer) >= 4 and answer[3] == SETTINGS_FRAME:
        return "h2", f"{address} serves plaintext gRPC, but the connection failed"
    if not answer:
        return "closed", f"{address} closed the connection without answering"
    return "answered", f"{address} answers, but not as a gRPC server"


def speaks_tls(address: str) -> bool:
    """Whether a TLS handshake with ``address`` completes (the certificate not checked, ALPN
    h2 offered, as gRPC does): what tells a TLS server apart from anything else that closes a
    plaintext connection unanswered (a TCP forwarder whose backend is not up yet, a server
    resetting the connections queued as it stops)."""
    import ssl

    host_port = split_address(address)
    if host_port is None:
        return False
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection(host_port, timeout=PROBE_TIMEOUT_S) as conn:
            with context.wrap_socket(conn, server_hostname=host_port[0]):
                return True
    except (ssl.SSLError, OSError):
        return False


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
    split = split_address(address)
    if split is None:
        raise ConfigError(f"{option} {address!r}: give HOST:PORT, the port included ({example})")
    if not 0 <= split[1] <= 65535:  # gRPC would take the port modulo 65536: another one
        raise ConfigError(f"{option} {address!r}: the port must be in 0-65535 ({example})")


def _bind_results(host: str, port: int, reuse: bool = False) -> list[OSError | None] | None:
    """A plain socket bound at each address ``host:port`` resolves to, in order (SO_REUSEADDR
    set where ``reuse``, as gRPC sets it): the OSError of each that failed, None where it bound;
    None where the host does not resolve (a name IDNA refuses, a..b, raises UnicodeError)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError, ValueError):
        return None
    results: list[OSError | None] = []
    for family, kind, proto, _, where in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                if reuse:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(where)
        except OSError as e:
            results.append(e)
            continue
        except (UnicodeError, ValueError):
            pass
        results.append(None)
    return results


def port_in_use(host: str, port: int) -> bool:
    """Whether a server already listens on ``host:port``, as gRPC's own bind would find it
    (SO_REUSEADDR set, as gRPC sets it: a port held only by closed connections is free), so
    that the one-line error comes before gRPC logs a line of its own."""
    import errno

    results = _bind_results(host, port, reuse=True)  # a host that does not resolve: gRPC says
    return any(e is not None and e.errno == errno.EADDRINUSE for e in results or ())


def why_not_listening(host: str, port: int, option: str, host_option: str | None = None
                      ) -> str:
    """Why a server cannot listen on ``host:port``, found by binding a plain socket at its
    first address (gRPC and uvicorn say it only in a log line of their own): the port in use,
    an address this machine lacks, a port that needs privileges; "" where the bind works or
    the reason is another. ``option``: what sets the port (and the host, unless
    ``host_option`` does)."""
    import errno

    results = _bind_results(host, port)
    if results is None:
        return f": the host {host!r} does not resolve"
    e = results[0]
    if e is None:
        return ""
    if e.errno == errno.EADDRINUSE:
        return (f": the port is in use (another server, an edgespec serve still running?); "
                f"stop it or give {option} another port")
    if e.errno == errno.EADDRNOTAVAIL:
        return f": this machine has no address {host} (give {host_option or option} one of its own)"
    if e.errno == errno.EACCES:
        return f": port {port} needs privileges (give {option} a port above 1023)"
    return f": {e.strerror}"
