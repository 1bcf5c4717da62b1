"""`ray up` with the shipped deploy/ray-onprem.yaml, for real, against this machine over ssh on
loopback; then `edgespec deploy` on that cluster, generations through it compared token for
token with target-only decoding (one pinned to a plain `edgespec drafter`, a board without Ray),
the status commands, `edgespec deploy --down`, and `ray down`.

The launcher file is the shipped one changed only where one machine needs it (tests/sshd.py,
loopback_config): head 127.0.0.1 declaring `edge` too, no boards, a throwaway ssh user/key and
sshd, this environment instead of the source mount and pip installs, `--node-ip-address
127.0.0.1` and free ports.
Skipped only where no sshd can be started here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import hf_greedy

from edgespec.wire.channels import free_port
from procs import Proc
from sshd import (RAY_LOOPBACK_ENV, LoopbackSshd, SshdUnavailable, close_ssh_masters,
                  loopback_config)

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier

SHIPPED = Path(__file__).resolve().parents[1] / "deploy" / "ray-onprem.yaml"
RAY = str(Path(sys.executable).parent / "ray")
PROMPT = [1, 10, 11, 12, 13, 10, 11, 12, 13, 10]


@pytest.mark.parametrize("name", ["ray-onprem.yaml", "ray-cloud-head.yaml"])
def test_launcher_yamls_pass_rays_validation(name):
    """Both launcher files parse and pass the checks `ray up` makes before touching a machine
    (the cloud one cannot be run here), with the Ray port 6380 and the roles' resources."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((SHIPPED.parent / name).read_text())
    validate_config(prepare_config(cfg))
    head = " ".join(cfg["head_start_ray_commands"])
    assert "--port=6380" in head and "6379" not in head
    workers = " ".join(cfg["worker_start_ray_commands"])
    if cfg["provider"]["type"] == "local":  # no node types: resources come from ray start
        assert """--resources='{"verifier": 1}'""" in head
        assert "$RAY_HEAD_IP:6380" in workers
        assert """--resources='{"edge": 1}'""" in workers
    else:
        assert cfg["available_node_types"][cfg["head_node_type"]]["resources"] == {"verifier": 1}


def _run(args, env, log: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run a command, keep its output in ``log`` (appended) and return it."""
    res = subprocess.run([str(a) for a in args], env=env, capture_output=True, text=True,
                         timeout=timeout, stdin=subprocess.DEVNULL)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(map(str, args))}  -> {res.returncode}\n{res.stdout}{res.stderr}\n")
    return res


def _tail(res: subprocess.CompletedProcess, n: int = 6000) -> str:
    return (res.stdout + res.stderr)[-n:]


def _cluster_processes(marker: str) -> list[str]:
    """Ray processes of this cluster still alive: their command lines name its temp dir."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if marker in cmd and ("raylet" in cmd or "gcs_server" in cmd):
            found.append(f"{p.pid}: {cmd[:200]}")
    return found


def _ray_status(address: str, env, log: Path, timeout: float = 60) -> str:
    """`ray status` until the autoscaler has reported the cluster's resources."""
    deadline = time.monotonic() + timeout
    while True:
        res = _run([RAY, "status", "--address", address], env, log, timeout=60)
        if res.returncode == 0 and "verifier" in res.stdout and "edge" in res.stdout:
            return res.stdout
        if time.monotonic() > deadline:
            raise AssertionError(f"ray status never showed verifier and edge:\n{_tail(res)}")
        time.sleep(1)


def test_ray_up_onprem_yaml_then_deploy_on_loopback(looping_dir, looping):
    # a short root: Ray's unix sockets go under it, and their paths are limited to 107 bytes
    root = Path(tempfile.mkdtemp(prefix="rayup-", dir="/tmp"))
    sshd = LoopbackSshd(root)
    try:
        sshd.start()
    except SshdUnavailable as e:
        sshd.stop()
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"cannot start an sshd on loopback: {e}")
    if shutil.which("rsync") is None:  # `ray up` copies its bootstrap files with rsync
        sshd.stop()
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip("rsync is not installed (ray up needs it: apt-get install rsync)")

    cluster_name = f"edgespec-loopback-{os.getpid()}"
    ray_port = free_port()
    address = f"127.0.0.1:{ray_port}"
    cfg = loopback_config(yaml.safe_load(SHIPPED.read_text()), sshd, cluster_name, ray_port)
    # no source mount: nothing installs from it here, and `ray up` would hash every file under
    # it (this checkout's .venv included)
    cfg["file_mounts"] = {}
    cluster_yaml = root / "cluster.yaml"
    cluster_yaml.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log = root / "commands.log"
    # RAY_TMPDIR/TMPDIR: the launcher's cluster state (cluster-NAME.state/.lock) and config
    # cache go under root, not /tmp/ray; RAY_LOOPBACK_ENV: 127.0.0.1 stays 127.0.0.1
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(sshd.ray_tmp),
               TMPDIR=str(sshd.ray_tmp), PYTHONUNBUFFERED="1", **RAY_LOOPBACK_ENV)
    # edgespec deploy keeps the cache's Redis data under the driver's ~/.cache: the sessions'
    # HOME, not the user's
    es_env = dict(env, HOME=str(sshd.home))
    # the cluster's nodes, started over ssh with the user's HOME, turn token authentication on
    # where the user has a Ray token: the driver then needs that token, not the sessions' HOME's
    token = Path.home() / ".ray" / "auth_token"
    if token.exists() and "RAY_AUTH_TOKEN_PATH" not in es_env:
        es_env["RAY_AUTH_TOKEN_PATH"] = str(token)
    try:
        check = sshd.ssh("echo ok")
        assert check.stdout.strip() == "ok", f"ssh to the test sshd failed:\n{check.stderr}\n" \
                                             f"{sshd.log()}"
        t0 = time.monotonic()
        up = _run([RAY, "up", "-y", "--no-config-cache", cluster_yaml], env, log, timeout=300)
        print(f"ray up: {time.monotonic() - t0:.1f} s")
        assert up.returncode == 0, f"ray up failed:\n{_tail(up)}"

        status = _ray_status(address, env, log)
        assert "verifier" in status and "edge" in status

        # the roles, placed by edgespec deploy on that cluster
        port, cache_port = free_port(), free_port()
        dep = _run([sys.executable, "-m", "edgespec_cli", "deploy", "--address", address,
                    "--model", looping_dir, "--drafter", "mag", "--port", port,
                    "--cache-port", cache_port, "--threads", 1], es_env, log, timeout=300)
        assert dep.returncode == 0, f"edgespec deploy failed:\n{_tail(dep)}"
        endpoint = dep.stdout.strip().splitlines()[-1].strip()
        assert endpoint.rsplit(":", 1)[-1].isdigit(), f"not HOST:PORT: {endpoint!r}"

        from edgespec.client import Client

        ref = hf_greedy(looping.model, PROMPT, 24)
        with Client(endpoint, timeout=120) as client:
            res = client.generate(prompt_ids=PROMPT, raw=True, max_new_tokens=24)
        assert res.token_ids == ref

        # the checks docs/deploy.md ("Check it is up") gives
        st = _run([sys.executable, "-m", "edgespec_cli", "deploy", "--address", address,
                   "--status"], es_env, log, timeout=120)
        assert st.returncode == 0 and "verifier" in st.stdout and "drafter" in st.stdout, \
            _tail(st)
        st = _run([sys.executable, "-m", "edgespec_cli", "status", "--address", endpoint],
                  es_env, log, timeout=120)
        assert st.returncode == 0, _tail(st)

        # a board without Ray: a plain `edgespec drafter` attached to the deployed cache, side
        # by side with the drafter actor
        plain = Proc(["drafter", "--cache", f"127.0.0.1:{cache_port}", "--device-id",
                      "plain-board", "--drafter", "mag", "--threads", 1],
                     root / "plain-drafter.log")
        try:
            plain.wait_for("attached to")
            with Client(endpoint, timeout=120) as client:
                res = client.generate(prompt_ids=PROMPT, raw=True, max_new_tokens=24,
                                      device_id="plain-board")
            assert res.token_ids == ref and res.device_id == "plain-board"
        finally:
            plain_code = plain.stop()
        assert plain_code == 0, "the plain drafter did not exit cleanly on SIGTERM"

        undeploy = _run([sys.executable, "-m", "edgespec_cli", "deploy", "--address", address,
                         "--down"], es_env, log, timeout=120)
        assert undeploy.returncode == 0, f"edgespec deploy --down failed:\n{_tail(undeploy)}"
    finally:
        t0 = time.monotonic()
        try:
            down = _run([RAY, "down", "-y", cluster_yaml], env, log, timeout=180)
        except subprocess.TimeoutExpired as e:  # still clean up below
            down = subprocess.CompletedProcess(e.cmd, -1, "", f"timed out after {e.timeout} s")
        print(f"ray down: {time.monotonic() - t0:.1f} s")
        left = _cluster_processes(str(sshd.ray_tmp))
        sshd.stop()  # in a PID namespace this also ends whatever ray down left
        close_ssh_masters(cluster_name)
        print(log.read_text()[-20000:])
        shutil.rmtree(root, ignore_errors=True)
    assert down.returncode == 0, f"ray down failed:\n{_tail(down)}"
    assert not left, "Ray processes left after ray down:\n" + "\n".join(left)
