"""The commands that start ``edgespec`` processes of their own (``bench-net``, ``bench-edge``)
stop them when they are sent SIGTERM: Python's default for SIGTERM ends the interpreter without
running the ``finally`` blocks that stop them (a ``bench-net`` killed so left its server
running, holding its port, found by a newcomer's probe). Held structurally: the command waits
on its child for ever, so the signal always lands while the child runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from edgespec_cli.bench.distributed import run_bench_net, stops_its_processes_on_sigterm
from edgespec_cli.bench.edge_vs_server import run_bench_edge

pytestmark = pytest.mark.slow  # processes: not the fast tier

COMMAND = textwrap.dedent("""
    import subprocess, sys
    from edgespec_cli.bench.distributed import stops_its_processes_on_sigterm
    from edgespec_cli.terminated import STATUS, Terminated

    @stops_its_processes_on_sigterm
    def run():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 stdout=subprocess.DEVNULL)  # the pipe ends with the command
        try:
            print(child.pid, flush=True)
            child.wait()
        finally:
            child.terminate()
            child.wait(timeout=30)
            print("stopped", flush=True)
        return 0

    try:  # as edgespec's main answers Terminated
        sys.exit(run())
    except Terminated:
        sys.exit(STATUS)
""")


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _gone(pid: int, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _terminate_while_it_waits(command: str) -> None:
    """Run ``command``, send it SIGTERM once its child runs, and hold it to exiting 143 after
    its cleanup ran, its child gone."""
    proc = subprocess.Popen([sys.executable, "-c", command], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(proc.stdout.readline())  # the child runs: the command waits on it
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        assert proc.stdout.read().strip() == "stopped"
        assert _gone(child), "the command's child outlived it"
    finally:
        if proc.poll() is None:
            proc.kill()
        if child is not None:
            _stop(child)


def test_sigterm_stops_the_commands_processes_and_exits_143():
    _terminate_while_it_waits(COMMAND)


def test_a_second_sigterm_does_not_cut_the_cleanup_short():
    """The first SIGTERM starts the command's cleanup; one more while it runs is ignored."""
    code = COMMAND.replace("        child.terminate()\n",
                           "        import os, signal\n"
                           "        os.kill(os.getpid(), signal.SIGTERM)\n"
                           "        child.terminate()\n")
    assert code != COMMAND
    _terminate_while_it_waits(code)


def test_the_sigterm_handler_is_the_callers_again_after_the_command():
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    @stops_its_processes_on_sigterm
    def run() -> int:
        seen.append(signal.getsignal(signal.SIGTERM))
        return 7

    assert run() == 7
    assert seen[0] is not before  # SIGTERM raised Terminated meanwhile
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("command", [run_bench_net, run_bench_edge])
def test_the_commands_that_start_processes_stop_them_on_sigterm(command):
    wrapper = stops_its_processes_on_sigterm(lambda: 0)
    assert command.__code__ is wrapper.__code__  # this decorator's wrapper, not another's
    assert command.__wrapped__.__name__ == command.__name__
