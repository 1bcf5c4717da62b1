"""The cache's connection to Redis (``cache_service.redis_conn``, the chunk waker's subscription): a
password never shows in errors or logs, an embedded Redis restarted from a thread outlives that
thread and dies with the process that started it, the waker outlives a connection closed under its
read, a URL of no scheme Redis reads is refused naming it, an external Redis that evicts keys is
warned of, and a fleet's worth of blocking reads all get connections."""

from __future__ import annotations

import time
import uuid

import pytest

from cache_service.redis_conn import RedisHandle
from edgespec.config import ConfigError
from procs import process_alive as _alive


def test_a_redis_password_never_shows_in_errors_or_logs():
    from cache_service.redis_conn import RedisHandle, shown_url
    from edgespec.wire.channels import free_port

    assert shown_url("redis://:s3cret@10.0.0.2:6379/0") == "redis://:***@10.0.0.2:6379/0"
    assert shown_url("rediss://app:p%40ss@cache:6380") == "rediss://app:***@cache:6380"
    assert shown_url("redis://10.0.0.2:6379/0") == "redis://10.0.0.2:6379/0"
    assert shown_url("unix:///tmp/r.sock") == "unix:///tmp/r.sock"
    assert shown_url("redis://cache:6379/0?password=s3cret&db=1") == \
        "redis://cache:6379/0?password=***&db=1"
    assert shown_url("unix:///tmp/r.sock?password=s3cret") == "unix:///tmp/r.sock?password=***"
    with pytest.raises(ConfigError) as e:  # nothing listens there: the error names the URL
        RedisHandle(f"redis://:TopSecret123@127.0.0.1:{free_port()}/0")
    assert "TopSecret123" not in str(e.value) and ":***@127.0.0.1" in str(e.value)


def test_an_embedded_redis_restarted_from_a_thread_outlives_that_thread():
    """Linux's parent-death signal follows the thread that started the child: a restart made by
    a health monitor's thread must not die when that thread ends (a drain stops the monitor
    first)."""
    import os
    import signal
    import subprocess
    import threading

    handle = RedisHandle()
    try:
        handle.client.set("es:kept", "1")
        first = handle.proc
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        monitor = threading.Thread(target=handle.ensure_running)
        monitor.start()
        monitor.join()
        assert handle.proc is not first and handle.proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):  # not sent SIGTERM as the thread ended
            handle.proc.wait(timeout=2)
        assert handle.client.get("es:kept") == b"1"  # the append-only file came back with it
    finally:
        handle.close()


def test_an_embedded_redis_is_spawned_not_forked_with_code_for_the_child():
    """The embedded server's process is spawned: a fork with code to run in the child before
    the server (a ``preexec_fn``) runs every loaded library's fork handlers in it, and gRPC's,
    restarting its threads there, deadlocked a child now and then. Python's own fork hooks
    (``os.register_at_fork``) see such forks; none comes from the launching thread."""
    import os
    import threading

    forks: list[str] = []
    os.register_at_fork(before=lambda: forks.append(threading.current_thread().name))
    handle = RedisHandle()
    try:
        assert handle.client.ping() and handle.proc.poll() is None
        handle.proc.kill()  # and a restart, from another thread
        handle.proc.wait()
        restart = threading.Thread(target=handle.ensure_running)
        restart.start()
        restart.join()
        assert handle.client.ping()
    finally:
        handle.close()
    assert not [name for name in forks if name.startswith("embedded-redis")]


def test_an_embedded_redis_server_that_cannot_run_is_said_once(monkeypatch, tmp_path):
    """A server binary that cannot be run (gone, say) is one line in the error, naming it, and
    not tried again: the same would follow."""
    import cache_service.redis_conn as redis_conn

    missing = str(tmp_path / "no such" / "redis-server")
    monkeypatch.setattr(redis_conn, "embedded_redis_binary", lambda: missing)
    with pytest.raises(ConfigError) as e:
        RedisHandle()
    assert str(e.value).count(f"cannot run {missing}: No such file or directory") == 1, e.value
    assert "Traceback" not in str(e.value)


def test_an_embedded_redis_dies_with_the_process_that_started_it_from_a_busy_process():
    """A process killed outright leaves no redis-server behind (the child's parent-death
    signal), and the child is started safely from a process whose other threads are busy
    importing and allocating as it starts (it is spawned: the signal is asked for by the
    spawned process before it becomes the server). Several starts, each from a fresh process."""
    import os
    import select
    import subprocess
    import sys
    import time

    code = (
        "import threading, importlib, sys\n"
        "from cache_service.redis_conn import RedisHandle\n"
        "stop = threading.Event()\n"
        "def churn():\n"
        "    while not stop.is_set():\n"
        "        [bytearray(4096) for _ in range(64)]\n"
        "        for m in ('json', 'csv', 'decimal', 'fractions'):\n"
        "            sys.modules.pop(m, None); importlib.import_module(m)\n"
        "threads = [threading.Thread(target=churn, daemon=True) for _ in range(3)]\n"
        "[t.start() for t in threads]\n"
        "h = RedisHandle()\n"
        "assert h.client.ping()\n"
        "print(h.proc.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    for _ in range(3):
        parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            # a child stuck between fork and exec (what this guards against) fails the test
            # after a minute rather than hanging it
            ready, _, _ = select.select([parent.stdout], [], [], 60)
            assert ready, "the parent never reported its redis-server"
            line = parent.stdout.readline()
            assert line.strip().isdigit(), f"the parent printed {line!r}"
            pid = int(line)
            os.kill(parent.pid, 9)
            assert parent.wait(timeout=60) == -9
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.05)
            assert not _alive(pid), "the embedded redis-server outlived its parent"
        finally:
            if parent.poll() is None:
                parent.kill()
                parent.wait()


def test_the_chunk_waker_outlives_a_connection_closed_under_its_read(monkeypatch):
    """redis-py raises an AttributeError when a connection is closed under a read (its buffer
    dropped): the listener counts a lost subscription and subscribes again, and later chunks
    still wake the verifier."""
    import time

    import redis

    from cache_service.chunk_waker import ChunkWaker

    real = redis.client.PubSub.get_message
    channel = f"es:test-wake-{uuid.uuid4().hex}"
    broke = []

    def get_message(self, *args, **kwargs):
        # only this test's subscription breaks: another test's waker still listening in this
        # process (its thread ends within a read) must not take the one fault
        mine = any(key in (channel, channel.encode()) for key in self.channels)
        if mine and not broke:
            broke.append(True)
            raise AttributeError("'NoneType' object has no attribute 'readline'")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(redis.client.PubSub, "get_message", get_message)
    handle = RedisHandle()
    waker = ChunkWaker(handle.client, channel)
    try:
        deadline = time.monotonic() + 30
        while not waker.seq:  # the lost subscription's own wake-up
            assert time.monotonic() < deadline and waker._thread.is_alive()
            time.sleep(0.01)
        seen = waker.seq
        while waker.seq == seen:  # subscribed again: a chunk's message wakes it
            assert time.monotonic() < deadline and waker._thread.is_alive()
            handle.client.publish(channel, "es:s:abc")
            waker.wait(seen, 0.2)
        keys, _ = waker.woken_since(seen)
        assert keys is not None and "es:s:abc" in keys
    finally:
        waker.stop()
        handle.close()


@pytest.mark.parametrize("url", ["foo", "http://x:1"])
def test_a_redis_url_of_no_scheme_redis_reads_is_a_config_error_naming_it(url):
    with pytest.raises(ConfigError, match="--redis-url"):
        RedisHandle(url)


@pytest.mark.parametrize("answer", [None, b"HTTP/1.1 400 Bad Request\r\n\r\n"])
def test_a_redis_url_whose_port_is_no_redis_is_a_config_error_not_a_hang(answer):
    """A port that accepts and never answers, or answers as another server (an HTTP port): the
    first contact, without the client's retries, ends in a ConfigError saying so (it waited
    silently for minutes under the retries of ten 10 s reads)."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held = []

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            if answer is not None:
                conn.recv(256)
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    try:
        with pytest.raises(ConfigError, match="is it a Redis server's address"):
            RedisHandle(f"redis://127.0.0.1:{listener.getsockname()[1]}/0")
    finally:
        listener.close()
        for conn in held:
            conn.close()


def test_an_external_redis_that_evicts_keys_is_warned_of_at_connect(external_redis, caplog):
    """A Redis with a maxmemory and an eviction policy takes sessions' and boards' keys under
    pressure (sessions lost, boards taken for detached): said when the cache connects, with the
    setting to change; the same Redis at noeviction, or unbounded, is not warned of."""
    import redis

    admin = redis.Redis.from_url(external_redis)
    old = admin.config_get("maxmemory*")
    try:
        for memory, policy, warned in ((64 << 20, "allkeys-lru", True),
                                       (64 << 20, "volatile-ttl", True),
                                       (64 << 20, "noeviction", False),
                                       (0, "allkeys-lru", False)):
            admin.config_set("maxmemory", memory)
            admin.config_set("maxmemory-policy", policy)
            caplog.clear()
            with caplog.at_level("WARNING", logger="edgespec.redis"):
                RedisHandle(external_redis).close()
            said = [r.getMessage() for r in caplog.records if "evicts keys" in r.getMessage()]
            assert bool(said) == warned, (memory, policy, said)
            if warned:
                assert policy in said[0] and "maxmemory-policy noeviction" in said[0]
    finally:
        admin.config_set("maxmemory", old["maxmemory"])
        admin.config_set("maxmemory-policy", old["maxmemory-policy"])
        admin.close()


def test_a_fleets_worth_of_blocking_reads_get_connections_at_once():
    """The draft cache holds a connection in a blocking read for each attached drafter, and
    takes others for their chunks: 150 blocking reads at once on one client all get a
    connection (redis-py's default pool of 100 refused the 101st, "Too many connections", and
    a fleet of 64 busy boards lost their streams to it)."""
    import threading

    from cache_service.redis_conn import MAX_CONNECTIONS

    handle = RedisHandle()
    n, errors, got = 150, [], []
    start = threading.Barrier(n + 1)

    def read() -> None:
        start.wait()
        try:
            # read again after a block runs out (a loaded machine may add late), within the
            # client's 10 s socket timeout
            reply, deadline = [], time.monotonic() + 60
            while not reply and time.monotonic() < deadline:
                reply = handle.client.xread({"wake": "0-0"}, block=5000, count=1)
            got.append(reply)
        except Exception as e:  # noqa: BLE001 - any error is the test's failure
            errors.append(e)

    try:
        threads = [threading.Thread(target=read) for _ in range(n)]
        for t in threads:
            t.start()
        start.wait()
        handle.client.xadd("wake", {"x": "1"})
        for t in threads:
            t.join(90)
        assert errors == [] and len(got) == n and all(got)
        assert handle.client.connection_pool.max_connections == MAX_CONNECTIONS >= 2 * 256
    finally:
        handle.close()

