"""Starting edgespec's own processes (serve, drafters) on loopback for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import edgespec

from edgespec.wire.channels import free_port


def run_edgespec(*args, timeout=300):
    """``python -m edgespec_cli ARGS`` run to its end: its exit status, stdout and stderr."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "edgespec_cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


class Proc:
    """``python -m edgespec_cli ARGS`` logging to a file; ``python``: another environment's
    interpreter (default: this one's)."""

    def __init__(self, args: list[str], log_path, env: dict | None = None,
                 python: str = sys.executable, new_session: bool = False):
        self.args = args
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.popen = subprocess.Popen([python, "-m", "edgespec_cli", *map(str, args)],
                                  stdout=self.log, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
                                  start_new_session=new_session)

    def text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_for(self, needle: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.text():
                return
            if self.popen.poll() is not None:
                raise RuntimeError(f"process exited ({self.popen.returncode}):\n{self.text()}")
            time.sleep(0.1)
        raise TimeoutError(f"{needle!r} not seen:\n{self.text()}")

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait()

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.send_signal(signal.SIGUSR1)  # its threads' stacks, into its log
                time.sleep(1)
                self.kill()
                print(f"{self.args[0]} did not stop on SIGTERM in 15 s; its log:\n{self.text()}",
                      file=sys.stderr)
        self.log.close()
        if "did not stop within" in self.text():  # a drafter's stop that hung (its stacks)
            warnings.warn(f"{self.args[0]} exited after its stop hung; its log:\n{self.text()}",
                          stacklevel=2)
        return self.popen.returncode


def _channel(address: str, tls_ca=None) -> grpc.Channel:
    if tls_ca:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(open(tls_ca, "rb").read()))
    return grpc.insecure_channel(address)


def health_status(address: str, service: str = "", tls_ca=None, timeout: float = 10) -> int:
    """One grpc.health.v1 check: the status the server reports for ``service``."""
    with _channel(address, tls_ca) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


def wait_health(address: str, status: int = health_pb2.HealthCheckResponse.SERVING,
                timeout: float = 60, tls_ca=None, service: str = "",
                alive: subprocess.Popen | None = None) -> None:
    """Poll until the server reports ``status`` (calls that fail meanwhile are retried);
    ``alive``: the server's process, whose exit ends the wait at once (TimeoutError)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if health_status(address, service, tls_ca, timeout=1) == status:
                return
        except grpc.RpcError:
            pass
        if alive is not None and alive.poll() is not None:
            raise TimeoutError(f"{address}: the server exited ({alive.returncode}) before it "
                               f"reported health status {status}")
        time.sleep(0.2)
    raise TimeoutError(f"{address} never reported health status {status}")


def wait_healthy(address: str, timeout: float = 60, tls_ca=None,
                 alive: subprocess.Popen | None = None) -> None:
    wait_health(address, timeout=timeout, tls_ca=tls_ca, alive=alive)


# A drafter frozen with SIGSTOP that must stay attached, its sessions waited for at every step
# (tests that make "mid-generation" structural): the liveness checks that would detach it, and
# the lateness rule that would stop waiting for it, put out of reach. The verifier also needs
# ``--late-after 0`` and ``--keep-drafting`` (else drafting-worth rests a board that slow).
FROZEN_DRAFTER_ENV = {"EDGESPEC_HEARTBEAT_S": "3600", "EDGESPEC_KEEPALIVE_S": "3600",
                      "EDGESPEC_KEEPALIVE_TIMEOUT_S": "3600"}


def start_serve(model_dir, tmp_path, redis_url=None, port=None, token="s3cret",
                extra=(), tls_ca=None, env: dict | None = None,
                fill: str = "none", new_session: bool = False) -> tuple[Proc, str]:
    """``edgespec serve`` on loopback, healthy. ``fill``: its ``--fill-drafts`` (none unless
    said: the tests through it assert on what the boards' own drafts do). ``new_session``: in
    a session and process group of its own (a test may signal its whole group)."""
    port = port or free_port()
    address = f"127.0.0.1:{port}"
    args = ["serve", "--listen", address, "--model", model_dir, "--auth-token", token,
            "--max-sessions", 8, "--max-context", 512, "--log-level", "INFO",
            "--dtype", "float32", "--fill-drafts", fill, *extra]
    if redis_url:
        args += ["--redis-url", redis_url]
    proc = Proc(args, tmp_path / f"serve-{port}-{time.monotonic_ns()}.log", env=env,
                new_session=new_session)
    try:
        wait_healthy(address, tls_ca=tls_ca, alive=proc.popen)
    except TimeoutError:
        proc.stop()
        raise TimeoutError(f"serve did not become healthy:\n{proc.text()}") from None
    return proc, address


def start_drafter(address, device, tmp_path, drafter="mag", token="s3cret", extra=(),
                  env: dict | None = None) -> Proc:
    return Proc(["drafter", "--cache", address, "--device-id", device, "--drafter", drafter,
                 "--auth-token", token, "--log-level", "INFO", *extra],
                tmp_path / f"drafter-{device}.log", env=env)


class Streamer(threading.Thread):
    """One generation read as a stream through the SDK on its own thread; ``first`` is set at
    the first token (or when the call ends). Afterwards: ``ids``, the ``final`` piece, the SDK's
    ``resumes`` and the session's ``seed``, or the ``error`` it raised."""

    def __init__(self, address: str, token: str, **kw):
        super().__init__(daemon=True)
        self.address, self.token, self.kw = address, token, kw
        self.first = threading.Event()
        self.ids: list[int] = []
        self.final = None
        self.error: Exception | None = None
        self.resumes = 0
        self.seed: int | None = None

    def run(self):
        try:
            with edgespec.Client(self.address, token=self.token, timeout=240) as c:
                for piece in c.stream(**self.kw):
                    self.ids.extend(piece.token_ids)
                    if piece.token_ids:
                        self.first.set()
                    if piece.finish_reason:
                        self.final = piece
                self.resumes, self.seed = c.last_resumes, c.last_seed
        except Exception as e:  # reported by the test
            self.error = e
        finally:
            self.first.set()


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command's name (state, parent pid, ...), or
    None where there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:  # exited (or never was)
        return None


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie, exited but not yet reaped
    by init, counts as gone)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None and int(fields[1]) == pid:
                out.append(int(entry))
    return out
