"""The server's and the boards' cores (``edgespec_cli.deployment.cpu_share``): parsing, the
default split, refusals, pinning a real thread, and CPU seconds read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from edgespec.config import ConfigError
from edgespec_cli.deployment.cpu_share import (CpuSplit, busy_share, parse_cpus,
                                               process_tree_cpu_s, split_cpus)

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity")
CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def test_cpu_lists_parse_and_unknown_cpus_are_refused():
    first = CPUS[0]
    assert parse_cpus(str(first), "--server-cpus") == (first,)
    assert parse_cpus(f"{first}-{first}", "--x") == (first,)
    for bad in ["", "a", "3-1", ","]:
        with pytest.raises(ConfigError):
            parse_cpus(bad, "--x")
    with pytest.raises(ConfigError, match="not available"):
        parse_cpus(str(max(CPUS) + 1000), "--board-cpus")


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two cpus")
def test_the_default_split_halves_the_cpus_and_given_sides_complete_each_other():
    split = split_cpus(None, None)
    half = len(CPUS) // 2
    assert split == CpuSplit(tuple(CPUS[:half]), tuple(CPUS[half:]))
    assert split_cpus(str(CPUS[-1]), None) == CpuSplit((CPUS[-1],), tuple(CPUS[:-1]))
    assert split_cpus(None, str(CPUS[0])) == CpuSplit(tuple(CPUS[1:]), (CPUS[0],))
    with pytest.raises(ConfigError, match="share"):
        split_cpus(str(CPUS[0]), str(CPUS[0]))
    with pytest.raises(ConfigError, match="at least one"):
        split_cpus(",".join(map(str, CPUS)), None)
    assert "server on cpus" in split.describe()


def test_a_pinned_process_runs_on_its_cpus_only_and_so_do_its_later_threads():
    """``pin_process`` in a process of its own (it pins every thread it has): its threads, one
    already running and one started after, and a child it starts, all on the cpu given."""
    code = (
        "import os, subprocess, sys, threading\n"
        "from edgespec_cli.deployment.cpu_share import pin_process\n"
        "ev = threading.Event(); seen = {}\n"
        "def early():\n"
        "    ev.wait(30); seen['early'] = os.sched_getaffinity(0)\n"
        "t = threading.Thread(target=early); t.start()\n"
        f"pin_process([{CPUS[-1]}]); ev.set(); t.join(30)\n"
        "late = threading.Thread(target=lambda: seen.update(late=os.sched_getaffinity(0)))\n"
        "late.start(); late.join(30)\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; "
        "print(sorted(os.sched_getaffinity(0)))'], capture_output=True, text=True)\n"
        "print(sorted(seen['early']), sorted(seen['late']), child.stdout.strip())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [f"[{CPUS[-1]}]"] * 3
    assert sorted(os.sched_getaffinity(0)) == CPUS  # this process untouched


def test_a_child_that_exited_keeps_its_cpu_seconds_in_the_tree():
    """The server's CPU counter must not fall when a child exits: a child waited for is
    counted in its parent's ``cutime``/``cstime``."""
    import resource

    before, kids = process_tree_cpu_s(), resource.getrusage(resource.RUSAGE_CHILDREN)
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    assert subprocess.run([sys.executable, "-c", busy], timeout=60).returncode == 0
    after, kids_after = process_tree_cpu_s(), resource.getrusage(resource.RUSAGE_CHILDREN)
    child_s = (kids_after.ru_utime + kids_after.ru_stime) - (kids.ru_utime + kids.ru_stime)
    assert child_s >= 0.3 and after - before >= child_s - 0.05  # /proc counts in 10 ms ticks


def test_cpu_seconds_of_a_process_tree_grow_with_work():
    before = process_tree_cpu_s()
    assert before is not None and before > 0
    x = 0
    for i in range(3_000_000):
        x += i
    assert process_tree_cpu_s() > before
    assert busy_share(1.0, 2.0, 1) == 0.5 and busy_share(None, 2.0, 1) is None
    assert busy_share(1.0, 0.0, 1) is None
