"""The README's three-process quick start works pasted as is: its three commands, started at
once (the client before the server is ready, as a pasted block does), give the client's answer
and exit 0; the server and the drafter then stop cleanly on SIGTERM. The only changes to the
pasted lines: a free port for 50051, and the tiny test model for the default one (``--model``),
so that no download is needed."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec.wire.channels import free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def quick_start_lines() -> list[str]:
    """The three commands of the README's distributed quick start (the block after "Run the
    distributed system on one machine")."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"Run the distributed system on one machine.*?\n```\n(.+?)\n```", text,
                      re.S).group(1)
    return [line.removesuffix("&").strip() for line in block.splitlines() if line.strip()]


def _argv(line: str, port: int, model: str) -> list[str]:
    argv = shlex.split(line.replace("50051", str(port)))
    if argv[0] == "edgespec":
        argv = [sys.executable, "-m", "edgespec_cli", *argv[1:]]
        if argv[3] == "serve":
            argv += ["--model", model]
    elif argv[0] == "python":
        argv[0] = sys.executable
    return argv


def test_the_pasted_quick_start_answers(tiny_dir, tmp_path, server_delay_s=16):
    """The server starts 16 s after the drafter and the client, as on a slow machine whose
    server takes that long to serve (the client's first contact once gave up after 10 s): the
    pasted block works there, and so where the server is quick."""
    lines = quick_start_lines()
    assert [line.split()[:2] for line in lines] == [["edgespec", "serve"],
                                                    ["edgespec", "drafter"], ["python", "-c"]]
    port = free_port()
    logs = [open(tmp_path / f"{i}.log", "w") for i in range(3)]
    argvs = [_argv(line, port, str(tiny_dir)) for line in lines]
    if server_delay_s:
        argvs[0] = ["bash", "-c", f"sleep {server_delay_s} && exec \"$@\"", "serve", *argvs[0]]
    procs = [subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
             for argv, log in zip(argvs, logs)]
    server, drafter, client = procs
    try:
        assert client.wait(timeout=600) == 0, (tmp_path / "2.log").read_text()
        assert (tmp_path / "2.log").read_text().strip()  # it printed the answer
    finally:
        for p in (drafter, server):
            p.terminate()
        codes = [p.wait(timeout=120) for p in (drafter, server)]
        for log in logs:
            log.close()
    assert codes == [0, 0], [(tmp_path / f"{i}.log").read_text() for i in (0, 1)]
