"""A stop signal the moment health says SERVING drains and exits 0: a supervisor (systemd, a
Kubernetes rollout, a test harness) may stop a server as soon as its health check passes. The
handlers were installed only after ``start`` returned, so a SIGTERM in between found Python's
default and killed the process (exit -15, nothing drained, the embedded Redis's folder left)."""

from __future__ import annotations

import re
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
    assert re.search(r" edgespec\.server INFO stopped$", serve.text(), re.M), serve.text()


class _Started(Exception):
    pass


def test_the_command_catches_stop_signals_before_the_server_starts(looping_dir, monkeypatch):
    """In order, not by how a race falls: the handler a started server's health runs under is
    the drain's, set before ``start`` (its SERVING), not Python's default."""
    from edgespec_cli.server import EdgespecServer
    from cli_inprocess import run_cli

    seen = []
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def start(self):
        seen.append({sig: signal.getsignal(sig) for sig in saved})
        self.stop(drain_timeout_s=0)  # what __init__ made: its Redis, its threads
        raise _Started

    monkeypatch.setattr(EdgespecServer, "start", start)
    try:
        with pytest.raises(_Started):
            run_cli("serve", "--listen", "127.0.0.1:0", "--model", looping_dir, "--dtype",
                    "float32", "--max-sessions", 2, "--max-context", 256, "--threads", 1)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert len(seen) == 1
    for sig, handler in seen[0].items():
        assert handler not in (signal.SIG_DFL, signal.default_int_handler, saved[sig]), sig


def test_sigterm_while_the_model_loads_ends_the_command_with_its_cleanup(
        looping_dir, monkeypatch, tmp_path):
    """Before the server's drain handler is set (its model loading), SIGTERM ends the command
    as Ctrl-C would: 143, one line, the embedded Redis stopped and its folder removed (Python's
    default ended the process on the spot, the folder left behind). The handler main set is
    called directly, in the load, as the interpreter would call it: no signal is sent to the
    test's process."""
    import tempfile

    import edgespec.models.loading as loading
    from cli_inprocess import run_cli

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the Redis's folder goes
    folders: list[list[str]] = []

    def load_model(*args, **kwargs):
        folders.append([p.name for p in tmp_path.glob("edgespec-redis-*")])
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler), f"SIGTERM's handler while the model loads: {handler!r}"
        handler(signal.SIGTERM, None)
        raise AssertionError("the handler returned")

    monkeypatch.setattr(loading, "load_model", load_model)
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what a command starts with
    try:
        r = run_cli("serve", "--listen", "127.0.0.1:0", "--model", looping_dir, "--dtype",
                    "float32", "--max-sessions", 2, "--max-context", 256, "--threads", 1)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # main put it back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert r.returncode == 143, r.stderr
    assert r.stderr.strip().endswith("edgespec: terminated"), r.stderr
    assert len(folders) == 1 and len(folders[0]) == 1  # the Redis was running when it came
    assert not list(tmp_path.glob("edgespec-redis-*"))  # and its folder is gone
