"""A stop signal the moment health says SERVING drains and exits 0: a supervisor (systemd, a
Kubernetes rollout, a test harness) may stop a server as soon as its health check passes. The
handlers were installed only after ``start`` returned, so a SIGTERM in between found Python's
default and killed the process (exit -15, nothing drained, the embedded Redis's folder left)."""

from __future__ import annotations

import signal

import pytest

from procs import start_serve

pytestmark = pytest.mark.slow  # a process


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_as_soon_as_health_says_serving_drains_and_exits_0(looping_dir, tmp_path, sig):
    serve, _ = start_serve(looping_dir, tmp_path)  # returns at the first SERVING answer
    serve.popen.send_signal(sig)
    assert serve.popen.wait(timeout=120) == 0, serve.text()
    serve.stop()
    assert "shutting down: draining" in serve.text()
    assert "stopped" in serve.text()
