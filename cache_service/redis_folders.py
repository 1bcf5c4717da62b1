"""The embedded Redis's private folders: each made with a record of the process that owns it, and
those whose owner died without removing them swept away when another embedded Redis starts.

A process that ends normally removes its folder (``RedisHandle.close``, or the temporary
folder's finalizer at exit). One killed outright (SIGKILL, the OOM killer, a machine's service
manager after its grace period) cannot: its redis-server follows it (the parent-death signal)
and removes its socket, but the folder stays, holding the server's log and append-only file, and
nothing else ever reads it (a restart of the embedded server happens within its owner). A fleet
server that crashes now and then, or a test suite that kills servers on purpose, would fill the
temporary folder with them.

A folder is an orphan when its owner process is gone *and* nothing answers on its socket (a pid
can be reused, and another PID namespace sharing this ``/tmp`` sees other pids: the socket is
the check that cannot be fooled into deleting a live server's folder). A folder without an owner
record (made by an older edgespec, or by a process between making it and writing the record) is
an orphan only once it is older than ``UNOWNED_GRACE_S`` and its socket is dead.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time

log = logging.getLogger("edgespec.redis")

PREFIX = "edgespec-redis-"
OWNER_FILE = "owner.pid"
SOCKET_FILE = "redis.sock"
UNOWNED_GRACE_S = 600.0


def make_folder() -> tempfile.TemporaryDirectory[str]:
    """A new private folder for an embedded Redis, its owner (this process) recorded in it."""
    folder = tempfile.TemporaryDirectory(prefix=PREFIX)
    with open(os.path.join(folder.name, OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    return folder


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _socket_answers(path: str) -> bool:
    """Whether a server accepts connections on the unix socket ``path``."""
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:  # cannot tell (a path too long for a socket, a timeout): keep it
            return True
    return True


def is_orphan(path: str) -> bool:
    """Whether the embedded-Redis folder ``path`` belongs to no live process and no server."""
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            owner: int | None = int(f.read().strip())
    except (OSError, ValueError):
        owner = None
    if owner == os.getpid():  # this process's own folder, in use or about to be
        return False
    if owner is not None and _process_alive(owner):
        return False
    if owner is None:
        try:
            age = time.time() - os.stat(path).st_mtime
        except OSError:
            return False
        if age < UNOWNED_GRACE_S:
            return False
    return not _socket_answers(os.path.join(path, SOCKET_FILE))


def sweep_orphaned_folders(root: str | None = None) -> list[str]:
    """Remove this user's orphaned embedded-Redis folders under ``root`` (the temporary
    folder by default); the paths removed. A folder that cannot be read or removed is left."""
    root = root or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != uid:
                continue
        except OSError:
            continue
        if is_orphan(entry.path):
            shutil.rmtree(entry.path, ignore_errors=True)
            if not os.path.exists(entry.path):
                removed.append(entry.path)
    if removed:
        log.info("removed %d embedded-Redis folder(s) left by processes that were killed",
                 len(removed))
    return removed
