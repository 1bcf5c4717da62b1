"""A throwaway sshd on loopback, and the loopback variant of deploy/ray-onprem.yaml: what a test
needs to run Ray's cluster launcher (`ray up` / `ray down`) against this machine.

Nothing of the user's is read or changed: the host key, the client key, `authorized_keys` and
the sshd config live in a temporary directory (sshd's `AuthorizedKeysFile` points there), the
client never reads `~/.ssh` (Ray passes `-i KEY -o IdentitiesOnly=yes
-o UserKnownHostsFile=/dev/null`), and the ssh sessions get a HOME of their own (`SetEnv`), so
`~/.bashrc` and the `~/ray_bootstrap_config.yaml` that `ray up` copies to the head land there.
"""

from __future__ import annotations

import copy
import getpass
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from edgespec.wire.channels import free_port

SSHD = "/usr/sbin/sshd"

# Ray's ssh client has no port setting (auth has ssh_user, ssh_private_key, ssh_proxy_command),
# and a HOME override would not help: OpenSSH reads ~/.ssh/config from the passwd entry's home,
# not from $HOME. `auth.ssh_proxy_command` is the way in: Ray passes it as `-o ProxyCommand=...`
# to every ssh and to rsync's `--rsh`, and this relay connects it to the sshd's port. It is a
# file with no spaces in its path, so no quoting layer (ssh's, rsync's --rsh) can split it.
_PROXY = """#!{python}
# ssh ProxyCommand: relay stdin/stdout to the test sshd on 127.0.0.1:{port}
import os, socket, threading
s = socket.create_connection(("127.0.0.1", {port}))
def up():
    while data := os.read(0, 65536):
        s.sendall(data)
    s.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while data := s.recv(65536):
    os.write(1, data)
"""

# Without a PID namespace, `ray stop` (which `ray down` runs on the head) would stop every Ray
# process on this machine, other people's included: the sessions' PATH then starts with this
# wrapper, whose `stop` stops only the processes of this cluster (those whose command lines
# name its RAY_TMPDIR, where their session directory is, and their children), as `ray stop`
# does (SIGTERM, then SIGKILL after 10 s).
_RAY_WRAPPER = """#!/bin/sh
[ "$1" = stop ] && exec {python} -c '
import os, psutil
me = {{os.getpid(), *(p.pid for p in psutil.Process().parents())}}
procs = {{}}
for p in psutil.process_iter(["cmdline"]):
    if p.pid not in me and any("{root}" in a for a in p.info["cmdline"] or []):
        try:  # with their children: workers rename themselves (ray::...)
            for q in [p, *p.children(recursive=True)]:
                procs[q.pid] = q
        except psutil.Error:
            pass
procs = list(procs.values())
for p in procs:
    try:
        p.terminate()
    except psutil.Error:
        pass
for p in psutil.wait_procs(procs, timeout=10)[1]:
    p.kill()
print(f"stopped {{len(procs)}} processes of this cluster")
'
exec {ray} "$@"
"""


# Ray turns the address 127.0.0.1 into the machine's interface address wherever it meets it
# (`ray start --node-ip-address`, `ray status --address`, `ray.init(address=...)`:
# services.resolve_ip_for_localhost), unless Ray's "local only" switch is on: meant for
# Windows/macOS, it makes Ray pick loopback and refuse to join a head as a worker (the loopback
# head joins nothing). The head's `ray start` and every Ray client of a loopback cluster need it.
RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class SshdUnavailable(Exception):
    pass


def _pid_namespace_works() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class LoopbackSshd:
    """An sshd on 127.0.0.1 (a free port) that lets the current user in with one throwaway key.

    ``root`` should be a short path: Ray's unix sockets go under ``root/ray`` (RAY_TMPDIR of
    the sessions), and a socket path is limited to 107 bytes.

    Where PID namespaces can be made (root here), sshd is PID 1 of its own
    (`unshare --pid --fork --mount-proc --kill-child`): everything started over ssh, the whole Ray
    cluster, lives there, `ray stop` sees only those processes, and stop() (killing the
    namespace's PID 1) ends whatever is left. Elsewhere `ray` on the sessions' PATH is the
    wrapper above.
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.dir = self.root / "ssh"
        self.home = self.root / "home"  # the sessions' HOME
        self.ray_tmp = self.root / "ray"  # the sessions' RAY_TMPDIR
        self.key = self.dir / "id_ed25519"
        self.proxy = self.dir / "proxy"
        self.user = getpass.getuser()
        self.port = 0
        self.pid_namespace = False
        self.popen: subprocess.Popen | None = None
        self._made_privsep_dir = False

    # -- lifecycle

    def start(self) -> "LoopbackSshd":
        if not os.access(SSHD, os.X_OK):
            raise SshdUnavailable(f"{SSHD} not found (apt-get install openssh-server)")
        if not shutil.which("ssh") or not shutil.which("ssh-keygen"):
            raise SshdUnavailable("ssh or ssh-keygen not found (apt-get install openssh-client)")
        for d in (self.dir, self.home, self.ray_tmp):
            d.mkdir(parents=True, exist_ok=True)
        self.dir.chmod(0o700)
        try:
            for name in ("host_ed25519", "id_ed25519"):
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "test",
                                "-f", str(self.dir / name)], check=True, capture_output=True)
        except subprocess.CalledProcessError as e:
            raise SshdUnavailable(f"ssh-keygen failed: {e.stderr.decode()}") from None
        shutil.copy(self.dir / "id_ed25519.pub", self.dir / "authorized_keys")
        (self.home / ".bashrc").write_text("")
        self.pid_namespace = _pid_namespace_works()
        if not self.pid_namespace:
            bin_dir = self.root / "bin"
            bin_dir.mkdir(exist_ok=True)
            wrapper = bin_dir / "ray"
            wrapper.write_text(_RAY_WRAPPER.format(python=sys.executable, root=self.ray_tmp,
                                                   ray=Path(sys.executable).parent / "ray"))
            wrapper.chmod(0o755)
        if os.geteuid() == 0 and not os.path.isdir("/run/sshd"):
            # a root sshd refuses to start without its privilege separation directory (the
            # openssh-server package's service creates it at boot)
            os.makedirs("/run/sshd", mode=0o755)
            self._made_privsep_dir = True
        for attempt in range(3):  # the free port may be taken before sshd binds it
            self.port = free_port()
            self._write_config()
            if self._launch():
                break
        else:
            raise SshdUnavailable(f"sshd did not start:\n{self.log()}")
        self.proxy.write_text(_PROXY.format(python=sys.executable, port=self.port))
        self.proxy.chmod(0o755)
        return self

    def _write_config(self) -> None:
        lines = [
            f"Port {self.port}",
            "ListenAddress 127.0.0.1",
            f"HostKey {self.dir / 'host_ed25519'}",
            "PidFile none",
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            # the key files live under /tmp, which is world-writable: StrictModes would refuse
            "StrictModes no",
            # as root: keys only (the Debian default, stated since this config starts empty)
            "PermitRootLogin prohibit-password",
            # the sessions' own HOME and Ray temp dir (/tmp/ray and ~ stay untouched); TMPDIR
            # too, which Ray also reads
            f"SetEnv HOME={self.home} RAY_TMPDIR={self.ray_tmp} TMPDIR={self.ray_tmp}",
            "LogLevel ERROR",
        ]
        (self.dir / "sshd_config").write_text("\n".join(lines) + "\n")

    def _launch(self) -> bool:
        cmd = [SSHD, "-f", str(self.dir / "sshd_config"), "-D", "-e"]
        if self.pid_namespace:
            cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *cmd]
        self._log = open(self.dir / "sshd.log", "w")
        self.popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log,
                                      stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                self._log.close()
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    if s.recv(64).startswith(b"SSH-"):
                        return True
            except OSError:
                time.sleep(0.1)
        self.stop()
        return False

    def log(self) -> str:
        try:
            return (self.dir / "sshd.log").read_text()
        except OSError:
            return ""

    def ssh(self, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run one command over ssh as Ray would reach this machine (a check that it works)."""
        return subprocess.run(
            ["ssh", "-i", str(self.key), "-o", "IdentitiesOnly=yes",
             "-o", "StrictHostKeyChecking=no", "-o", f"UserKnownHostsFile={os.devnull}",
             "-o", f"ProxyCommand={self.proxy}", "-o", "BatchMode=yes",
             f"{self.user}@127.0.0.1", command],
            capture_output=True, text=True, timeout=timeout)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            # unshare forwards nothing, but --kill-child SIGKILLs the namespace's PID 1 when
            # unshare dies, and the kernel then kills every process left in the namespace
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
            self._log.close()
        if self._made_privsep_dir:
            try:
                os.rmdir("/run/sshd")
            except OSError:
                pass
            self._made_privsep_dir = False


def ssh_control_dir(cluster_name: str) -> Path:
    """Where Ray's ssh client keeps its ControlMaster sockets for a cluster (command_runner.py:
    /tmp/ray_ssh_ + the first 10 hex digits of sha256(user) / of sha256(cluster name))."""
    user = hashlib.sha256(getpass.getuser().encode()).hexdigest()[:10]
    cluster = hashlib.sha256(cluster_name.encode()).hexdigest()[:10]
    return Path(f"/tmp/ray_ssh_{user}/{cluster}")


def close_ssh_masters(cluster_name: str) -> None:
    """End the ssh ControlMasters `ray up`/`ray down` left behind (they linger 10 s) and remove
    their directory."""
    d = ssh_control_dir(cluster_name)
    if d.is_dir():
        for sock in d.iterdir():
            subprocess.run(["ssh", "-S", str(sock), "-O", "exit", "x"], capture_output=True,
                           timeout=10)
        shutil.rmtree(d, ignore_errors=True)
        try:
            d.parent.rmdir()  # only if no other cluster's sockets are there
        except OSError:
            pass


def _replace(command: str, old: str, new: str) -> str:
    if old not in command:
        raise AssertionError(f"{old!r} not in the shipped start command {command!r}")
    return command.replace(old, new)


def _distinct_free_ports(n: int, avoid: set[int]) -> list[int]:
    """``n`` free loopback ports, none of them in ``avoid`` nor twice: each ``free_port`` is
    free when asked, not held, so two calls may give the same one (Ray then refuses to start,
    "trying to use a port number ... used by other components")."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in avoid and port not in ports:
            ports.append(port)
    return ports


def loopback_config(shipped: dict, sshd: LoopbackSshd, cluster_name: str, ray_port: int) -> dict:
    """deploy/ray-onprem.yaml changed only where a one-machine loopback run needs it:

    - head_ip 127.0.0.1 and no boards (one machine cannot host a second raylet on the same IP),
      so the head declares `edge` as well as `verifier`;
    - the throwaway user/key, and the ssh proxy that reaches the test sshd's port;
    - setup: activate this interpreter's environment instead of installing edgespec;
    - every `ray start`: `--node-ip-address 127.0.0.1` (Ray binds the interface address
      otherwise), free ports instead of 6380 and of the head's fixed default ports (the Ray
      client server's 10001, the dashboard agent's 52365) so it can run beside other Ray
      clusters, and no dashboard (faster).
    """
    cfg = copy.deepcopy(shipped)
    cfg["cluster_name"] = cluster_name
    cfg["provider"]["head_ip"] = "127.0.0.1"
    cfg["provider"]["worker_ips"] = []
    cfg["auth"] = {"ssh_user": sshd.user, "ssh_private_key": str(sshd.key),
                   "ssh_proxy_command": str(sshd.proxy)}
    setup = [f"echo '. {sys.prefix}/bin/activate' >> ~/.bashrc"]
    if not sshd.pid_namespace:
        setup.append(f"echo 'export PATH={sshd.root}/bin:$PATH' >> ~/.bashrc")
    cfg["setup_commands"] = setup
    cfg["head_setup_commands"] = []
    cfg["worker_setup_commands"] = []

    def start(command: str, head: bool) -> str:
        if "ray start" not in command:
            return command
        command = _replace(command, "6380", str(ray_port))
        if head:
            command = _replace(command, '{"verifier": 1}', '{"verifier": 1, "edge": 1}')
            client, agent = _distinct_free_ports(2, avoid={ray_port, sshd.port})
            command += (f" --ray-client-server-port={client}"
                        f" --dashboard-agent-listen-port={agent}"
                        " --include-dashboard=false")
        if head:
            command = "".join(f"export {k}={v}; " for k, v in RAY_LOOPBACK_ENV.items()) + command
        return command + " --node-ip-address=127.0.0.1"

    cfg["head_start_ray_commands"] = [start(c, True) for c in cfg["head_start_ray_commands"]]
    cfg["worker_start_ray_commands"] = [start(c, False)
                                        for c in cfg["worker_start_ray_commands"]]
    assert all(re.search(r"ray start .*--node-ip-address=127\.0\.0\.1", c)
               for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
               if "ray start" in c)
    return cfg
