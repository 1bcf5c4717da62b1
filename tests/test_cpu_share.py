"""The server's and the boards' cores (``edgespec_cli.deployment.cpu_share``): parsing, the
default split, refusals, pinning a real thread, and CPU seconds read from /proc."""

from __future__ import annotations

import os
import threading

import pytest

from edgespec.config import ConfigError
from edgespec_cli.deployment.cpu_share import (CpuSplit, busy_share, parse_cpus, pin_thread,
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


def test_a_pinned_thread_runs_on_its_cpus_only_and_the_process_keeps_its_own():
    seen = {}

    def work():
        pin_thread([CPUS[-1]])
        seen["cpus"] = os.sched_getaffinity(0)

    t = threading.Thread(target=work)
    t.start()
    t.join(30)
    assert seen["cpus"] == {CPUS[-1]}
    assert sorted(os.sched_getaffinity(0)) == CPUS


def test_cpu_seconds_of_a_process_tree_grow_with_work():
    before = process_tree_cpu_s()
    assert before is not None and before > 0
    x = 0
    for i in range(3_000_000):
        x += i
    assert process_tree_cpu_s() > before
    assert busy_share(1.0, 2.0, 1) == 0.5 and busy_share(None, 2.0, 1) is None
    assert busy_share(1.0, 0.0, 1) is None
