"""Links that fail quietly, on real TCP: a relay between a board (or a client) and the server
that can be told to break the way edge links break.

``FaultyLink`` listens on loopback and forwards every connection to a target; while it runs the
link can:

- ``blackhole()``: forward nothing either way and keep every socket open (a partition: TCP
  retransmits underneath, and the bytes held flow again after ``heal()``);
- ``abandon()``: close the server's side of every open connection and leave the board's side
  open and silent, never read nor answered (a NAT box or middlebox that forgot the connection);
  new connections pass;
- ``reset()``: reset both sides of every open connection (RST);
- ``refuse()``: reset every open connection and refuse new ones (nothing listens) until
  ``heal()``;
- ``slow(delay_s)``: hold each chunk ``delay_s`` before forwarding it, until ``heal()``.

``simulate`` uses it for its partition schedules and the product's tests for the link faults.
One thread per direction of a connection (blocking sockets, a short poll to see a change of
mode): meant for a handful of connections, not for load.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import dataclass

FAULTS = ("blackhole", "abandon", "reset", "refuse", "slow")
POLL_S = 0.05
CHUNK = 64 * 1024


def _hard_close(sock: socket.socket) -> None:
    """Close with RST instead of FIN (linger on, zero seconds)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


@dataclass
class _Conn:
    board: socket.socket  # the side the board (or client) connected
    server: socket.socket
    abandoned: bool = False
    closed: bool = False


class FaultyLink:
    def __init__(self, target: str, listen_host: str = "127.0.0.1", port: int = 0):
        host, _, p = target.rpartition(":")
        self.target = (host.strip("[]") or "127.0.0.1", int(p))
        self.listen_host, self._port = listen_host, port
        self.mode = "pass"  # or "blackhole", "refuse", "slow"
        self.delay_s = 0.0
        self.connections = 0  # accepted in all
        self._conns: list[_Conn] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self._port}"

    # -- faults ----------------------------------------------------------------------------------
    def blackhole(self) -> None:
        self.mode = "blackhole"

    def slow(self, delay_s: float) -> None:
        self.delay_s, self.mode = delay_s, "slow"

    def abandon(self) -> None:
        with self._lock:
            for c in self._conns:
                if not c.closed and not c.abandoned:
                    c.abandoned = True
                    c.server.close()

    def reset(self) -> None:
        with self._lock:
            for c in self._conns:
                self._close(c, hard=True)

    def refuse(self) -> None:
        self.mode = "refuse"
        self._close_listener()
        self.reset()

    def heal(self) -> None:
        """Back to forwarding (abandoned connections stay abandoned, as a forgotten one does)."""
        self.mode, self.delay_s = "pass", 0.0
        if self._listener is None and not self._stopping.is_set():
            self._listen()  # a refusal closed it (even one overlaid by another fault since)

    def apply(self, fault: str, delay_s: float = 0.2) -> None:
        """One of FAULTS by name."""
        if fault not in FAULTS:
            raise ValueError(f"a link fault is one of {', '.join(FAULTS)}, not {fault!r}")
        if fault == "slow":
            self.slow(delay_s)
        else:
            getattr(self, fault)()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> FaultyLink:
        self._listen()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._close_listener()
        with self._lock:
            for c in self._conns:
                self._close(c, hard=False)
                if c.abandoned:
                    c.board.close()

    def __enter__(self) -> FaultyLink:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _listen(self) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.listen_host, self._port))
        sock.listen(64)
        self._port = sock.getsockname()[1]  # the same port again after a refusal
        self._listener = sock
        threading.Thread(target=self._accept, args=(sock,), daemon=True,
                         name="faulty-link-accept").start()

    def _close_listener(self) -> None:
        sock, self._listener = self._listener, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                board, _ = listener.accept()
            except OSError:
                return  # the listener was closed (refuse, stop)
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                _hard_close(board)
                continue
            for s in (board, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(POLL_S)
            conn = _Conn(board, server)
            with self._lock:
                self._conns = [c for c in self._conns if not c.closed] + [conn]
                self.connections += 1
            for src, dst, up in ((board, server, True), (server, board, False)):
                threading.Thread(target=self._pump, args=(conn, src, dst, up), daemon=True,
                                 name="faulty-link-pump").start()

    def _pump(self, conn: _Conn, src: socket.socket, dst: socket.socket, up: bool) -> None:
        while not conn.closed and not self._stopping.is_set():
            if conn.abandoned:
                return  # the board's side stays open, unread and unanswered
            if self.mode == "blackhole":
                time.sleep(POLL_S)
                continue
            try:
                data = src.recv(CHUNK)
            except socket.timeout:
                continue
            except OSError:
                data = b""
            if conn.abandoned:
                return
            if not data:
                with self._lock:
                    self._close(conn, hard=False)
                return
            while self.mode == "blackhole" and not conn.closed:
                time.sleep(POLL_S)  # a chunk read as the partition began waits for its end
            if self.mode == "slow":
                time.sleep(self.delay_s)
            try:
                self._send_all(conn, dst, data)
            except OSError:
                if not conn.abandoned:
                    with self._lock:
                        self._close(conn, hard=False)
                return

    def _send_all(self, conn: _Conn, dst: socket.socket, data: bytes) -> None:
        """``dst.sendall`` that waits out a full buffer (the sockets poll with a timeout)."""
        view = memoryview(data)
        while view and not conn.closed and not self._stopping.is_set():
            if conn.abandoned:
                return
            try:
                view = view[dst.send(view):]
            except socket.timeout:
                continue

    @staticmethod
    def _close(conn: _Conn, hard: bool) -> None:
        if conn.closed:
            return
        conn.closed = True
        for s in (conn.board, conn.server):
            if conn.abandoned and s is conn.board and not hard:
                continue
            if hard:
                _hard_close(s)
            else:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()


@dataclass(frozen=True)
class ScheduledFault:
    """One link fault of a partition schedule: ``fault`` (one of FAULTS) at ``at_s`` seconds
    into a run, healed ``for_s`` later (blackhole, refuse, slow; abandon and reset are
    instants), on ``links``: "drafters", "clients" or "all", and ``device``: a device index, or
    None for every device."""

    fault: str
    at_s: float
    for_s: float = 0.0
    links: str = "drafters"
    device: int | None = None

    def describe(self) -> str:
        who = "every device" if self.device is None else f"device {self.device}"
        span = f" for {self.for_s:g} s" if self.for_s else ""
        return f"{self.fault} at {self.at_s:g} s{span} on {who}'s {self.links} link"


def parse_fault_schedule(text: str) -> list[ScheduledFault]:
    """``FAULT@START[+DURATION][:LINKS][/DEVICE]`` items, comma-separated: e.g.
    ``blackhole@20+10,abandon@40:clients/0,slow@60+20:all``. LINKS: drafters (default),
    clients or all; DEVICE: a device's index (default: every device). ConfigError on anything
    else."""
    from edgespec.config import ConfigError

    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            head, _, device = item.partition("/")
            head, _, links = head.partition(":")
            fault, _, when = head.partition("@")
            start, _, span = when.partition("+")
            event = ScheduledFault(fault, float(start), float(span or 0), links or "drafters",
                                   int(device) if device else None)
        except ValueError:
            raise ConfigError(f"--link-faults: {item!r} is not FAULT@START[+DURATION]"
                              "[:LINKS][/DEVICE] (e.g. blackhole@20+10)") from None
        if event.fault not in FAULTS:
            raise ConfigError(f"--link-faults: {event.fault!r} is not one of "
                              f"{', '.join(FAULTS)}")
        if event.links not in ("drafters", "clients", "all"):
            raise ConfigError(f"--link-faults: links {event.links!r} is not drafters, clients "
                              "or all")
        if not (event.at_s >= 0 and event.for_s >= 0) or (event.device or 0) < 0:
            raise ConfigError(f"--link-faults: {item!r}: times and the device must be >= 0")
        if event.fault in ("blackhole", "refuse", "slow") and not event.for_s:
            raise ConfigError(f"--link-faults: {item!r}: {event.fault} needs +DURATION")
        if event.fault in ("abandon", "reset") and event.for_s:
            raise ConfigError(f"--link-faults: {item!r}: {event.fault} is an instant: no "
                              "+DURATION")
        out.append(event)
    return out
