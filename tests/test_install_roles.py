"""The roles that need no torch install and run without it, installed the way the on-premises
Ray config installs a board (deploy/ray-onprem.yaml's setup and worker setup commands, run in a
fresh environment whose home holds the repository at ~/edgespec-src).

In that environment: torch is absent; the client SDK, the draft cache and the drafter agent with
MaG, Cacheback and llama.cpp import; the commands start and a command that needs torch says which
install it needs; and a fleet whose cache, drafter and client all run there (the verifier runs in
the test environment, sharing one Redis) generates exactly what target-only decoding does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TOKEN = "s3cret"
PROMPT = [1, 10, 11, 12, 13, 10, 11, 12, 13, 10]


def _pip_cache() -> str:
    """This user's pip cache, so the fresh environment does not download what is cached."""
    out = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True,
                         text=True)
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else ""


@pytest.fixture(scope="module")
def board(tmp_path_factory) -> Path:
    """The bin folder of an environment installed by the board's commands in the YAML."""
    yaml = pytest.importorskip("yaml", reason="pyyaml is not installed (pip install pyyaml, "
                                              "or the test extra)")
    cfg = yaml.safe_load((REPO / "deploy" / "ray-onprem.yaml").read_text())
    commands = [*cfg["setup_commands"], *cfg["worker_setup_commands"]]
    assert any("edgespec-src" in c for c in commands), "the board no longer installs edgespec " \
                                                       "from ~/edgespec-src: update this test"
    home = tmp_path_factory.mktemp("board-home")
    (home / "edgespec-src").symlink_to(REPO)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(HOME=str(home), PIP_CACHE_DIR=_pip_cache() or str(home / ".pip-cache"))
    # pip's bytecode pass over every installed file (Ray's thousands) off (--compile's
    # variable): the board's modules compile as they are imported instead (the install 57 ->
    # 38 s on a 2-core Zen 3)
    env["PIP_COMPILE"] = "0"
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not p.startswith(sys.prefix))
    for command in commands:
        # as Ray's launcher runs them: each in its own shell that has read ~/.bashrc
        done = subprocess.run(["bash", "-c", f"[ -f ~/.bashrc ] && . ~/.bashrc; {command}"],
                              env=env, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, f"{command!r} failed:\n{done.stdout}\n{done.stderr}"
    return home / "edgespec-venv" / "bin"


def _run(board: Path, code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the board's own install
    return subprocess.run([str(board / "python"), "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout, cwd="/", env=env)


def test_the_board_environment_has_no_torch(board):
    done = _run(board, "import torch")
    assert done.returncode == 1 and "No module named 'torch'" in done.stderr
    # the package came from the install, not from the working tree
    done = _run(board, "import edgespec; print(edgespec.__file__)")
    assert done.returncode == 0 and "site-packages" in done.stdout


def test_client_cache_and_board_drafters_import_and_run_without_torch(board):
    done = _run(board, """
        import sys
        import numpy as np
        from edgespec import AsyncClient, Client, Unavailable
        import cache_service.service, cache_service.store, drafter_node.agent
        import drafter_node.edge_drafter
        from edgespec.config import ConfigError, SamplingParams
        from edgespec.drafters import build_drafter
        from edgespec.drafters.token_choice import choose_token

        tokens = [1, 5, 6, 7, 5, 6, 7, 5, 6]
        for spec in ("mag", "cacheback", "mag+cacheback"):
            session = build_drafter(spec).open(tokens, SamplingParams())
            assert session.propose(3).tokens == [7, 5, 6], spec
        token, conf, probs = choose_token(np.arange(10.0), SamplingParams(temperature=1.0, seed=3),
                                          7)
        assert 0 <= token < 10 and abs(probs.sum() - 1) < 1e-9
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            try:
                build_drafter("llamacpp:default")
            except ConfigError as e:
                assert '.[llamacpp]' in str(e), e
            else:
                raise AssertionError("llamacpp without its extra was built")
        assert "torch" not in sys.modules, "something imported torch"
        print("ok")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_commands_start_without_torch_and_name_the_install_they_need(board):
    for args in (["--help"], ["cache", "--help"], ["drafter", "--help"], ["status", "--help"]):
        done = subprocess.run([str(board / "edgespec"), *args], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, (args, done.stderr)
    done = subprocess.run([str(board / "edgespec"), "generate", "hello"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "needs torch" in done.stderr and ".[models]" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_fleet_of_torchless_roles_is_lossless(board, external_redis, looping_dir, looping,
                                                tmp_path):
    """The cache, a MaG drafter and the client from the board's environment; the verifier from
    this one; one Redis. The output is target-only greedy decoding's."""
    import redis as redis_lib

    from conftest import hf_greedy
    from procs import Proc, wait_healthy
    from edgespec.wire.channels import free_port

    redis_lib.Redis.from_url(external_redis).flushdb()
    v_addr, c_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    common = ["--redis-url", external_redis, "--auth-token", TOKEN]
    python = str(board / "python")
    verifier = Proc(["verifier", "--listen", v_addr, "--model", looping_dir, "--dtype",
                     "float32", "--max-context", 512, "--draft-wait-ms", 5000, "--no-adaptive",
                     *common], tmp_path / "v.log")
    cache = Proc(["cache", "--listen", c_addr, *common], tmp_path / "c.log", python=python)
    drafter = None
    try:
        wait_healthy(v_addr)
        wait_healthy(c_addr)
        drafter = Proc(["drafter", "--cache", c_addr, "--device-id", "board", "--drafter",
                        "mag", "--auth-token", TOKEN], tmp_path / "d.log", python=python)
        drafter.wait_for("attached to")
        done = _run(board, f"""
            import json, edgespec
            with edgespec.Client({v_addr!r}, token={TOKEN!r}, timeout=60) as c:
                res = c.generate(prompt_ids={PROMPT!r}, max_new_tokens=60, device_id="board")
            print(json.dumps({{"ids": res.token_ids, "accepted": res.stats["accepted"]}}))
        """)
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout)
        assert got["ids"] == hf_greedy(looping.model, PROMPT, 60)
        assert got["accepted"] > 0  # the board's drafts were verified
    finally:
        codes = {name: p.stop() for name, p in
                 (("drafter", drafter), ("cache", cache), ("verifier", verifier)) if p}
    assert all(code == 0 for code in codes.values()), codes
