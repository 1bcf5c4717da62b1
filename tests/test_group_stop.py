"""A stop signal sent to every process of an ``edgespec serve``, not to the server alone, still
drains its running sessions to their end: a terminal's Ctrl-C sends SIGINT to the whole
foreground process group, and systemd's default stop (``KillMode=control-group``) SIGTERM to
every process of the service. Either reached the embedded redis-server too, which stopped at
once, and the drain then had nowhere to commit: a running stream stalled for the whole drain
and failed. The embedded Redis now runs in a session of its own (out of the group's reach), and
one stopped by a signal of its own is restarted during the drain (its sessions come back from
its append-only file)."""

from __future__ import annotations

import os
import signal

import pytest

from conftest import hf_greedy
from edgespec.runner.kernel_caches import CACHE_ENTRIES, CAPACITY_VARIABLES
from procs import (FROZEN_DRAFTER_ENV, Streamer, child_pids, process_alive, start_drafter,
                   start_serve)

pytestmark = pytest.mark.slow  # processes

TOKEN = "gr0up"
N = 60  # tokens: >= 3 s with the frozen board's sessions waited for 50 ms a step
PROMPT = [1, 10, 11, 12, 13, 10, 11]


@pytest.mark.parametrize("how", ["ctrl-c", "service-stop"])
def test_a_stop_signal_to_every_process_of_the_server_still_drains(looping, looping_dir,
                                                                   tmp_path, how):
    ref = hf_greedy(looping.model, PROMPT, N)
    serve, address = start_serve(looping_dir, tmp_path, token=TOKEN, new_session=True,
                                 env=FROZEN_DRAFTER_ENV,
                                 extra=["--draft-wait-ms", 50, "--late-after", 0, "--keep-drafting",
                                        "--drain-timeout", 90])
    drafter = start_drafter(address, "frozen", tmp_path, token=TOKEN, env=FROZEN_DRAFTER_ENV)
    stream = None
    try:
        drafter.wait_for("attached to")
        drafter.popen.send_signal(signal.SIGSTOP)  # mid-generation for as long as N tokens take
        redis_pids = child_pids(serve.popen.pid)  # the embedded redis-server
        assert redis_pids, "serve has no embedded redis-server child"
        folder = embedded_redis_folder(serve.popen.pid)
        stream = Streamer(address, TOKEN, prompt_ids=PROMPT, max_new_tokens=N,
                          device_id="frozen")
        stream.start()
        assert stream.first.wait(120), "no first token"
        if how == "ctrl-c":  # a terminal: SIGINT to the foreground process group
            os.killpg(serve.popen.pid, signal.SIGINT)
        else:  # systemd's control-group stop: SIGTERM to each of the service's processes
            for pid in [serve.popen.pid, *redis_pids]:
                os.kill(pid, signal.SIGTERM)
        assert serve.popen.wait(timeout=180) == 0, serve.text()
        stream.join(60)
        assert not stream.is_alive(), "the stream is still waiting for the stopped server"
        assert stream.error is None, (stream.error, serve.text())
        assert stream.ids == ref
        assert "timed out" not in serve.text()  # the drain ended with its sessions
        entries = os.environ.get(CAPACITY_VARIABLES[0], str(CACHE_ENTRIES))  # the user's, or ours
        assert f"oneDNN kernel caches: {entries} entries" in serve.text()
        # the server closed its Redis (a restarted one too): its folder went, no server holds
        # its socket
        assert not os.path.exists(folder)
        assert not any(process_alive(pid) for pid in redis_pids)
        assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and
                    folder in _cmdline(int(pid))]
    finally:
        drafter.popen.send_signal(signal.SIGCONT)
        assert drafter.stop() == 0
        if serve.popen.poll() is None:
            serve.kill()
        if stream is not None:
            stream.join(10)


def embedded_redis_folder(pid: int) -> str:
    """The embedded-Redis folder process ``pid`` owns (its owner record)."""
    import glob
    import tempfile

    from cache_service.redis_folders import OWNER_FILE, PREFIX

    for path in glob.glob(os.path.join(tempfile.gettempdir(), PREFIX + "*")):
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                if f.read().strip() == str(pid):
                    return path
        except OSError:
            continue
    raise AssertionError(f"no embedded-Redis folder is owned by {pid}")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
