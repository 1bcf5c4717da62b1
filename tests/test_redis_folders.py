"""The embedded Redis's folders (``cache_service.redis_folders``): a process killed outright
leaves its folder, and the next embedded Redis started removes it, but never a folder whose
owner lives or whose socket answers."""

from __future__ import annotations

import time

from cache_service.redis_conn import RedisHandle
from procs import process_alive as _alive


def test_a_killed_processs_embedded_redis_folder_is_swept_by_the_next_start(monkeypatch):
    """A process killed outright cannot remove its embedded Redis's folder; the next embedded
    Redis started on the machine removes it, and only folders whose owner is gone and whose
    socket is dead: a live owner's, a serving one's and a fresh unowned one stay."""
    import os
    import select
    import shutil
    import subprocess
    import sys
    import tempfile

    from cache_service.redis_folders import OWNER_FILE, PREFIX, UNOWNED_GRACE_S

    root = tempfile.mkdtemp(prefix="es-sweep-")  # short: a unix socket's path has 108 bytes
    monkeypatch.setattr(tempfile, "tempdir", root)
    code = ("import sys\nfrom cache_service.redis_conn import RedisHandle\n"
            "h = RedisHandle()\nprint(h.proc.pid, h._tmp.name, flush=True)\nsys.stdin.read()\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": root})
    handle = None
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 60)
        assert ready, "the process never reported its redis-server"
        server_pid, killed_folder = parent.stdout.readline().split()
        os.kill(parent.pid, 9)
        assert parent.wait(timeout=60) == -9
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _alive(int(server_pid)):
            time.sleep(0.05)
        assert not _alive(int(server_pid))
        assert os.path.isdir(killed_folder)  # what the sweep is for

        def folder(name: str, owner: str | None) -> str:
            path = os.path.join(root, PREFIX + name)
            os.mkdir(path)
            if owner is not None:
                with open(os.path.join(path, OWNER_FILE), "w") as f:
                    f.write(owner)
            return path

        live_owner = folder("live", str(os.getppid()))
        unowned_new = folder("new", None)
        unowned_old = folder("old", None)
        old = time.time() - UNOWNED_GRACE_S - 60
        os.utime(unowned_old, (old, old))
        unreadable = folder("unreadable", "not a pid")  # a record that names no process
        os.utime(unreadable, (old, old))
        unrelated = os.path.join(root, "edgespec-other-thing")
        os.mkdir(unrelated)

        handle = RedisHandle()
        assert handle.client.ping()
        assert not os.path.exists(killed_folder)
        assert not os.path.exists(unowned_old) and not os.path.exists(unreadable)
        for kept in (live_owner, unowned_new, unrelated, handle._tmp.name):
            assert os.path.isdir(kept), kept
        # a second start keeps the first's folder: its owner is the starting process
        second = RedisHandle()
        try:
            assert os.path.isdir(handle._tmp.name) and handle.client.ping()
        finally:
            second.close()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if handle is not None:
            handle.close()
        shutil.rmtree(root, ignore_errors=True)


def test_a_folder_whose_owner_is_gone_but_whose_socket_answers_is_kept():
    """A pid can be reused or belong to another PID namespace: a server answering on the
    folder's socket keeps it whatever its owner record says."""
    import shutil
    import socket
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from cache_service.redis_folders import OWNER_FILE, PREFIX, sweep_orphaned_folders

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    assert dead.wait() == 0
    root = Path(tempfile.mkdtemp(prefix="es-sweep-"))  # short: a socket's path has 108 bytes
    serving, silent = root / (PREFIX + "serving"), root / (PREFIX + "silent")
    for path in (serving, silent):
        path.mkdir()
        (path / OWNER_FILE).write_text(str(dead.pid))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(serving / "redis.sock"))
        listener.listen()
        assert sweep_orphaned_folders(str(root)) == [str(silent)]
        assert serving.is_dir() and not silent.exists()
    finally:
        listener.close()
        shutil.rmtree(root, ignore_errors=True)
