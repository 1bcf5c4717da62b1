"""Stopping and inspecting edgespec's processes: SIGUSR1 prints every thread's stack and the
command goes on; a drafter whose clean stop hangs exits after a grace rather than waiting for
a service manager's SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys

from procs import start_drafter

from edgespec.wire.channels import free_port


def test_sigusr1_prints_every_threads_stack_and_the_drafter_goes_on(tmp_path):
    drafter = start_drafter(f"127.0.0.1:{free_port()}", "probed", tmp_path)  # nothing there
    try:
        drafter.wait_for("cannot reach the cache")
        drafter.popen.send_signal(signal.SIGUSR1)
        drafter.wait_for("_attach_until_stopped")  # the main thread, in the agent's link loop
        drafter.wait_for("run_drafting")  # the drafting loop's thread
        assert drafter.text().count("most recent call first") >= 2
        assert drafter.popen.poll() is None
    finally:
        assert drafter.stop() == 0


def test_a_stop_that_hangs_exits_zero_after_the_grace_with_the_stacks():
    code = ("import threading, time\n"
            "from edgespec_cli.cluster import _exit_if_stuck\n"
            "_exit_if_stuck(0.5)\n"
            "threading.Event().wait(60)  # a clean stop that never ends\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == 0
    assert "did not stop within" in done.stderr
    assert "most recent call first" in done.stderr and "<string>" in done.stderr
