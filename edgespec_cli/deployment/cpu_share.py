"""The machine's cores split between the server and the boards, for fleets on one machine.

A fleet simulated on one machine (``edgespec simulate``) measures nothing about edge drafting
unless the boards draft on cores the server does not use: a drafter that costs compute would
otherwise take it from the verifier it is meant to relieve. So the verifier, the draft cache and
its Redis are confined to the server's cores, the drafters (and the clients, the users' side) to
the boards' cores, each process with every thread it has (``pin_process``), and the verifier's
torch threads set to its share.

CPU use per side is read from ``/proc`` (``edgespec.runner.cpu_time.process_tree_cpu_s``: a
process and its children, Redis under the cache), so a report can say how busy each side's
cores were and which side's cores bound the run. On a system without ``/proc`` or CPU affinity
(not Linux), pinning is refused and CPU use is None.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from edgespec.config import ConfigError
from edgespec.runner.cpu_time import process_tree_cpu_s  # noqa: F401 (its callers import it here)

BOUND_SHARE = 0.9  # a side whose cores were busier than this bounded the run


@dataclass(frozen=True)
class CpuSplit:
    """Which cores the server's roles and the boards' drafters run on."""

    server: tuple[int, ...]
    boards: tuple[int, ...]

    def describe(self) -> str:
        return f"server on cpus {_ranges(self.server)}, boards on cpus {_ranges(self.boards)}"


def parse_cpus(text: str, flag: str) -> tuple[int, ...]:
    """``0``, ``0-3``, ``0,2,4-5``: the cpus named, sorted; each must be one this process may
    run on."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                cpus.update(range(lo, hi + 1))
            elif part:
                cpus.add(int(part))
    except ValueError:
        raise ConfigError(f"{flag} takes cpus like 0, 0-3 or 0,2-3, got {text!r}") from None
    if not cpus:
        raise ConfigError(f"{flag} names no cpu")
    allowed = available_cpus()
    if allowed is not None and not cpus <= allowed:
        raise ConfigError(f"{flag} {text}: cpus {_ranges(sorted(cpus - allowed))} are not "
                          f"available here (this process may run on {_ranges(sorted(allowed))})")
    return tuple(sorted(cpus))


def available_cpus() -> set[int] | None:
    """The cpus this process may run on (None where the system cannot say)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def split_cpus(server: str | None, boards: str | None) -> CpuSplit | None:
    """The split asked for, or the default: the first half of the available cpus for the
    server, the rest for the boards (on a machine of two or more). None on one cpu, or where
    affinity cannot be set. The two sides may not share a cpu."""
    allowed = available_cpus()
    if allowed is None:
        if server or boards:
            raise ConfigError("--server-cpus and --board-cpus need CPU affinity (Linux)")
        return None
    cpus = sorted(allowed)
    if server is None and boards is None:
        if len(cpus) < 2:
            return None
        half = len(cpus) // 2
        return CpuSplit(tuple(cpus[:half]), tuple(cpus[half:]))
    s = parse_cpus(server, "--server-cpus") if server else None
    b = parse_cpus(boards, "--board-cpus") if boards else None
    if s is None:
        s = tuple(c for c in cpus if c not in set(b or ()))
    if b is None:
        b = tuple(c for c in cpus if c not in set(s))
    if not s or not b:
        raise ConfigError("the server and the boards each need at least one cpu")
    if set(s) & set(b):
        raise ConfigError(f"--server-cpus and --board-cpus share cpus "
                          f"{_ranges(sorted(set(s) & set(b)))}")
    return CpuSplit(s, b)


def pin_process(cpus: tuple[int, ...] | list[int] | None) -> None:
    """Confine this process, every thread it has now and those it starts later (children
    too), to ``cpus`` (None: leave it as it is)."""
    if not cpus:
        return
    target = set(cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, target)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError as e:  # cpus this machine does not have (a cluster's other node)
            raise ConfigError(f"cannot run on cpus {_ranges(sorted(target))} here: {e}") \
                from None


def pin_pid(pid: int, cpus: tuple[int, ...] | list[int]) -> None:
    """Confine another process (every thread it has now; those it starts later inherit) to
    ``cpus``: for a child just started, instead of an unsafe ``preexec_fn``."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, set(cpus))
        except ProcessLookupError:
            continue


def busy_share(cpu_s: float | None, wall_s: float, cpus: int) -> float | None:
    """The share of ``cpus`` cores' time over ``wall_s`` that ``cpu_s`` CPU seconds took."""
    if cpu_s is None or wall_s <= 0 or cpus <= 0:
        return None
    return cpu_s / (wall_s * cpus)


def _ranges(cpus) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out: list[str] = []
    cpus = sorted(cpus)
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)
