"""CPU seconds a process and its children have used, read from ``/proc`` (Linux): what a
server's compute costs, for its metrics (``edgespec:server_cpu_seconds_total``) and for the
benchmarks that split a machine between a server and its boards. Elsewhere: None."""

from __future__ import annotations

import os


def process_tree_cpu_s(pid: int | None = None) -> float | None:
    """User + system CPU seconds of a process (default: this one) and its descendants, all
    their threads: the living ones' own, and those that exited and were waited for (each
    process's ``cutime`` and ``cstime``), so the sum does not fall when a child exits; None
    where ``/proc`` cannot tell."""
    pid = os.getpid() if pid is None else pid
    tick = os.sysconf("SC_CLK_TCK")
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            if p == pid:
                return None
            continue  # a child that exited meanwhile
        total += sum(int(x) for x in fields[11:15]) / tick  # utime, stime, cutime, cstime
        todo.extend(_children(p))
    return total


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out
