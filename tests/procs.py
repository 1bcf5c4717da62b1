"""Starting edgespec's own processes (serve, drafters) on loopback for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgespec.wire import free_port


class Proc:
    def __init__(self, args: list[str], log_path, env: dict | None = None):
        self.args = args
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.popen = subprocess.Popen([sys.executable, "-m", "edgespec_cli", *map(str, args)],
                                  stdout=self.log, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))

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
                self.kill()
        self.log.close()
        return self.popen.returncode


def wait_healthy(address: str, timeout: float = 60, tls_ca=None) -> None:
    if tls_ca:
        creds = grpc.ssl_channel_credentials(open(tls_ca, "rb").read())
        channel = grpc.secure_channel(address, creds)
    else:
        channel = grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{address} not healthy")
    finally:
        channel.close()


def start_serve(model_dir, tmp_path, redis_url=None, port=None, token="s3cret",
                extra=(), tls_ca=None) -> tuple[Proc, str]:
    port = port or free_port()
    address = f"127.0.0.1:{port}"
    args = ["serve", "--listen", address, "--model", model_dir, "--auth-token", token,
            "--max-sessions", 8, "--max-context", 512, "--log-level", "INFO", *extra]
    if redis_url:
        args += ["--redis-url", redis_url]
    proc = Proc(args, tmp_path / f"serve-{port}-{time.monotonic_ns()}.log")
    try:
        wait_healthy(address, tls_ca=tls_ca)
    except TimeoutError:
        proc.stop()
        raise TimeoutError(f"serve did not become healthy:\n{proc.text()}") from None
    return proc, address


def start_drafter(address, device, tmp_path, drafter="mag", token="s3cret") -> Proc:
    return Proc(["drafter", "--cache", address, "--device-id", device, "--drafter", drafter,
                 "--auth-token", token, "--log-level", "INFO"], tmp_path / f"drafter-{device}.log")
