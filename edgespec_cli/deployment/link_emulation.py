"""Emulate a device's network link on real TCP traffic: a proxy that delays what it forwards.

``LinkProxy`` listens on loopback and forwards every connection to a target (a gRPC server, the
draft cache); a drafter pointed at the proxy's address sees the link a ``LinkProfile`` describes.
Each direction of each connection is modelled on its own, chunk by chunk (a chunk is whatever one
read from the socket returned, at most 64 KiB):

- serialisation: a chunk of n bytes occupies the link for n*8/bandwidth seconds, queued behind
  the bytes sent before it in that direction (the queue is the proxy's whole link, shared by its
  connections, as a device's uplink is);
- propagation: then it travels rtt/2 plus jitter, drawn per chunk from a normal distribution with
  standard deviation jitter/sqrt(2) (so a round trip varies by about ``jitter_ms``), clipped so a
  one-way delay is never negative;
- loss, as TCP shows it to an application: nothing is dropped, but each ~1460-byte segment is lost
  with probability ``loss`` and then arrives one retransmission timeout later, RTO =
  max(200 ms, 2*rtt) (Linux's minimum RTO, and a round trip plus its variance), doubling on each
  further loss of the same segment (at most 15 times, Linux's tcp_retries2); a chunk is as late
  as its latest segment;
- order: a chunk is delivered at max(its own due time, the previous chunk's delivery time), so
  later bytes never overtake earlier ones and a lost segment stalls the stream behind it
  (head-of-line blocking), as in TCP.

Opening a connection costs one round trip (the TCP handshake) before the first byte is forwarded;
a half-close (FIN) travels like data, after the bytes before it. The receiver's flow control is
real: a slow reader stops the proxy's writer, whose queue (64 chunks) then stops its reader.
Not modelled: congestion control (a loss delays bytes but does not slow the sender down),
outages, and loss bursts (losses are independent). Everything runs on one asyncio loop in one
daemon thread: no thread per connection, and no polling (each chunk waits on a timer).
"""

from __future__ import annotations

import asyncio
import math
import random
import socket
import threading
from dataclasses import dataclass

from edgespec.config import ConfigError

SEGMENT_BYTES = 1460  # a typical TCP MSS on Ethernet-sized MTUs
MIN_RTO_S = 0.2
MAX_RETRANSMISSIONS = 15
READ_BYTES = 64 * 1024
QUEUED_CHUNKS = 64


@dataclass(frozen=True)
class LinkProfile:
    """A network link: round-trip time, its jitter, packet loss and bandwidth (each direction)."""

    rtt_ms: float
    jitter_ms: float = 0.0
    loss: float = 0.0  # probability that a TCP segment is lost, in [0, 1)
    bandwidth_mbps: float | None = None  # None: unlimited

    def __post_init__(self) -> None:
        for name in ("rtt_ms", "jitter_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"link {name} must be a finite number >= 0, got {value!r}")
        if not (isinstance(self.loss, (int, float)) and 0 <= self.loss < 1):
            raise ConfigError(f"link loss must be a probability in [0, 1), got {self.loss!r}")
        bw = self.bandwidth_mbps
        if bw is not None and not (isinstance(bw, (int, float)) and math.isfinite(bw) and bw > 0):
            raise ConfigError(f"link bandwidth_mbps must be > 0 (or None: unlimited), got {bw!r}")

    @property
    def rto_s(self) -> float:
        """The retransmission timeout a lost segment costs (before any backoff)."""
        return max(MIN_RTO_S, 2 * self.rtt_ms / 1000)

    def describe(self) -> str:
        """A short human summary, e.g. ``rtt 30 ms ±5, loss 1%, 20 Mbit/s``."""
        text = f"rtt {self.rtt_ms:g} ms" + (f" ±{self.jitter_ms:g}" if self.jitter_ms else "")
        if self.loss:
            text += f", loss {self.loss * 100:g}%"
        bw = self.bandwidth_mbps
        return text + (f", {bw:g} Mbit/s" if bw is not None else ", unlimited bandwidth")


class LinkDirection:
    """One direction of an emulated link: when a chunk put on it reaches the far end.

    Ordering is not applied here (it is per connection); the caller takes the max with the
    previous delivery time of its stream."""

    def __init__(self, profile: LinkProfile, rng: random.Random):
        self.profile = profile
        self._rng = rng
        self._link_free_at = 0.0
        self.retransmissions = 0

    def propagation_s(self) -> float:
        p = self.profile
        delay = p.rtt_ms / 2000
        if p.jitter_ms:
            delay += self._rng.gauss(0.0, p.jitter_ms / 1000 / math.sqrt(2))
        return max(0.0, delay)

    def retransmission_delay_s(self, nbytes: int) -> float:
        if not self.profile.loss:
            return 0.0
        worst = 0.0
        for _ in range(max(1, math.ceil(nbytes / SEGMENT_BYTES))):
            delay, rto = 0.0, self.profile.rto_s
            for _ in range(MAX_RETRANSMISSIONS):
                if self._rng.random() >= self.profile.loss:
                    break
                self.retransmissions += 1
                delay += rto
                rto *= 2
            worst = max(worst, delay)
        return worst

    def arrival(self, now: float, nbytes: int) -> float:
        """When ``nbytes`` handed to the link at ``now`` (loop clock, seconds) arrive."""
        sent = now
        if self.profile.bandwidth_mbps is not None:
            start = max(now, self._link_free_at)
            sent = self._link_free_at = start + nbytes * 8 / (self.profile.bandwidth_mbps * 1e6)
        return sent + self.propagation_s() + self.retransmission_delay_s(nbytes)


def split_host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); ConfigError if it is not one."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"expected HOST:PORT, got {address!r}")
    return host, int(port)


class LinkProxy:
    """A TCP proxy to ``target`` that emulates ``profile`` on everything it forwards.

    ``start()`` binds an ephemeral port on ``listen_host``; connect to ``address``. Counters:
    ``connections``, ``bytes_to_target``, ``bytes_from_target``, ``retransmissions``."""

    def __init__(self, target: str, profile: LinkProfile, listen_host: str = "127.0.0.1",
                 seed: int | None = None):
        self.target = target
        self._target_host, self._target_port = split_host_port(target)
        self.profile = profile
        self.listen_host = listen_host
        rng = random.Random(seed)
        self._up = LinkDirection(profile, rng)  # towards the target
        self._down = LinkDirection(profile, rng)
        self.connections = 0
        self.bytes_to_target = 0
        self.bytes_from_target = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._handlers: set[asyncio.Task] = set()

    @property
    def retransmissions(self) -> int:
        return self._up.retransmissions + self._down.retransmissions

    @property
    def active_connections(self) -> int:
        return len(self._handlers)

    def counters(self) -> dict[str, int]:
        return {"connections": self.connections, "bytes_to_target": self.bytes_to_target,
                "bytes_from_target": self.bytes_from_target,
                "retransmissions": self.retransmissions}

    @property
    def address(self) -> str:
        if self._port is None:
            raise RuntimeError("LinkProxy is not started")
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        return f"{host}:{self._port}"

    def start(self) -> LinkProxy:
        if self._loop is not None:
            raise RuntimeError("LinkProxy already started")
        sock = socket.create_server((self.listen_host, 0))
        self._port = sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"link-proxy:{self._port}->{self.target}")
        self._thread.start()
        try:
            self._server = asyncio.run_coroutine_threadsafe(
                asyncio.start_server(self._accept, sock=sock), self._loop).result(10)
        except BaseException:
            sock.close()
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Close the listener and every forwarded connection; idempotent."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            assert self._thread is not None  # started together with the loop
            self._thread.join(10)
            if not loop.is_running():
                loop.close()

    def __enter__(self) -> LinkProxy:
        return self if self._loop is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        me = asyncio.current_task()
        for _ in range(100):
            await asyncio.sleep(0)  # lets accepts under way reach their handlers, closes finish
            others = [t for t in asyncio.all_tasks() if t is not me]
            if not others:
                return
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

    def _accept(self, client_reader, client_writer) -> None:
        self.connections += 1
        task = asyncio.get_running_loop().create_task(
            self._serve_connection(client_reader, client_writer))
        self._handlers.add(task)

        def finished(task):
            self._handlers.discard(task)
            if not client_writer.transport.is_closing():  # cancelled before it started
                client_writer.transport.abort()

        task.add_done_callback(finished)

    async def _serve_connection(self, client_reader, client_writer) -> None:
        target_writer, tasks, clean = None, [], False
        try:
            await asyncio.sleep(self._up.propagation_s() + self._down.propagation_s())
            target_reader, target_writer = await asyncio.open_connection(
                self._target_host, self._target_port)
            # (delivery time, chunk); an empty chunk is the half-close
            up: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUED_CHUNKS)
            down: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUED_CHUNKS)
            tasks = [asyncio.create_task(c) for c in (
                self._read_side(client_reader, self._up, up),
                self._write_side(up, target_writer, "bytes_to_target"),
                self._read_side(target_reader, self._down, down),
                self._write_side(down, client_writer, "bytes_from_target"))]
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            clean = not pending and not any(t.cancelled() or t.exception() for t in done)
        except (OSError, asyncio.CancelledError):
            pass  # the target refused, a side reset, or the proxy is stopping: drop both sides
        finally:
            for task in tasks:
                task.cancel()
            for writer in (client_writer, target_writer):  # before any await: stop() cancels
                if writer is not None and clean:
                    writer.close()
                elif writer is not None:
                    writer.transport.abort()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read_side(self, reader, link: LinkDirection, queue: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        delivered_at = 0.0
        while True:
            data = await reader.read(READ_BYTES)
            now = loop.time()
            due = link.arrival(now, len(data)) if data else now + link.propagation_s()
            delivered_at = max(due, delivered_at)
            await queue.put((delivered_at, data))
            if not data:
                return

    async def _write_side(self, queue: asyncio.Queue, writer, counter: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
            setattr(self, counter, getattr(self, counter) + len(data))
