"""The default thread count steps down where no dtype is batch-invariant at it: all cores but
one is what a process runs at unless told, and on a laptop's CPU (MKL's AVX2 path) float32's
products split their rows by the thread count from 4 threads on, so that default would refuse
to start (``edgespec.runner.thread_step_down``). A count the user gave (``--threads``,
``$EDGESPEC_THREADS``), set in torch, or already serving a model is never changed: it is
refused, with the hint that fewer threads may pass. A drafter that runs no model in torch
(MaG, Cacheback, llama.cpp) keeps its count without importing torch."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from edgespec.config import ConfigError
from edgespec.runner import dtype_choice, threads

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def restore_threads(monkeypatch):
    monkeypatch.delenv("EDGESPEC_THREADS", raising=False)
    before, state = torch.get_num_threads(), (threads._threads, threads._adjustable)
    yield
    torch.set_num_threads(before)
    threads._threads, threads._adjustable = state


def _exact_up_to(limit: int):
    """A probe's answer: float32 exact at ``limit`` threads or fewer, bfloat16 nowhere."""
    return lambda name, device="cpu": name == "float32" and torch.get_num_threads() <= limit


def test_fewer_threads_halve_down_to_one():
    assert threads.fewer_threads(8) == [4, 2, 1]
    assert threads.fewer_threads(7) == [3, 1]
    assert threads.fewer_threads(2) == [1]
    assert threads.fewer_threads(1) == []


def test_a_default_count_steps_down_to_the_highest_at_which_the_dtype_is_exact(
        monkeypatch, caplog, restore_threads):
    monkeypatch.setattr(threads, "default_threads", lambda: 8)
    monkeypatch.setattr(dtype_choice, "exact_here", _exact_up_to(3))
    probed = []
    exact = dtype_choice.exact_here
    monkeypatch.setattr(dtype_choice, "exact_here", lambda name, device="cpu": probed.append(
        (name, torch.get_num_threads())) or exact(name, device))
    assert threads.set_threads(None) == 8 and threads.threads_adjustable()
    with caplog.at_level(logging.WARNING, logger="edgespec.dtype"):
        assert dtype_choice.resolve_dtype("auto") == "float32"
    # 8 and 4 fail, 2 passes, then 3 (between 2 and the last failure) passes: served at 3
    assert [n for name, n in probed if name == "float32"] == [8, 4, 2, 3]
    assert torch.get_num_threads() == 3 and threads.threads_in_use() == 3
    said = caplog.text
    assert "no dtype is batch-invariant here at 8 threads" in said and "serving at 3" in said
    # settled: a later resolve in the process refuses rather than move the runner built at 3
    assert not threads.threads_adjustable()
    monkeypatch.setattr(dtype_choice, "exact_here", _exact_up_to(2))
    with pytest.raises(ConfigError, match="at 3 threads .*fewer --threads may pass"):
        dtype_choice.resolve_dtype("float32")
    assert torch.get_num_threads() == 3
    # a dtype by name steps down the same way from a fresh default
    threads.set_threads(None)
    assert dtype_choice.resolve_dtype("float32") == "float32" and torch.get_num_threads() == 2
    assert "dtype float32 is not batch-invariant here at 8 threads" in caplog.text


def test_a_default_served_as_it_is_is_settled_too(monkeypatch, restore_threads):
    monkeypatch.setattr(threads, "default_threads", lambda: 4)
    monkeypatch.setattr(dtype_choice, "exact_here", _exact_up_to(4))
    threads.set_threads(None)
    assert dtype_choice.resolve_dtype("auto") == "float32" and torch.get_num_threads() == 4
    assert not threads.threads_adjustable()


def test_an_interrupted_step_down_leaves_the_count_as_it_was(monkeypatch, restore_threads):
    monkeypatch.setattr(threads, "default_threads", lambda: 8)

    def probe(name, device="cpu"):
        if torch.get_num_threads() < 8:
            raise KeyboardInterrupt
        return False

    monkeypatch.setattr(dtype_choice, "exact_here", probe)
    threads.set_threads(None)
    with pytest.raises(KeyboardInterrupt):
        dtype_choice.resolve_dtype("float32")
    assert torch.get_num_threads() == 8 and threads.threads_in_use() == 8


def test_a_count_the_user_gave_is_refused_never_changed(monkeypatch, restore_threads):
    monkeypatch.setattr(dtype_choice, "exact_here", _exact_up_to(2))
    threads.set_threads(8)
    assert not threads.threads_adjustable()
    with pytest.raises(ConfigError, match="at 8 threads .*fewer --threads may pass"):
        dtype_choice.resolve_dtype("auto")
    assert torch.get_num_threads() == 8
    monkeypatch.setenv("EDGESPEC_THREADS", "8")  # the environment's count is the user's too
    threads.set_threads(None)
    with pytest.raises(ConfigError, match="dtype float32 is not batch-invariant .* 8 threads"):
        dtype_choice.resolve_dtype("float32")
    assert torch.get_num_threads() == 8


def test_a_count_set_in_torch_since_the_default_is_not_changed(monkeypatch, restore_threads):
    monkeypatch.setattr(threads, "default_threads", lambda: 4)
    monkeypatch.setattr(dtype_choice, "exact_here", _exact_up_to(2))
    threads.set_threads(None)
    torch.set_num_threads(8)  # a library user's own count
    assert not threads.threads_adjustable()
    with pytest.raises(ConfigError, match="at 8 threads"):
        dtype_choice.resolve_dtype("auto")
    assert torch.get_num_threads() == 8


def test_where_no_count_passes_the_default_is_kept_and_the_refusal_names_every_count(
        monkeypatch, restore_threads):
    monkeypatch.setattr(threads, "default_threads", lambda: 8)
    monkeypatch.setattr(dtype_choice, "exact_here", lambda name, device="cpu": False)
    threads.set_threads(None)
    with pytest.raises(ConfigError, match=r"at 8 threads \(nor at 4, 2, 1 threads\): ") as e:
        dtype_choice.resolve_dtype("auto")
    assert "fewer --threads" not in str(e.value)  # they were tried
    assert torch.get_num_threads() == 8 and threads.threads_in_use() == 8
    with pytest.raises(ConfigError, match=r"float32 .* at 8 threads \(nor at 4, 2, 1 threads\) "
                                          r"\(its probe failed\).*use --dtype auto$"):
        threads.set_threads(None)
        dtype_choice.resolve_dtype("float32")


def _flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@pytest.mark.slow
def test_a_laptops_avx2_products_get_a_default_they_are_exact_at():
    """The real probes under MKL's, oneDNN's and torch's AVX2 paths (a laptop's), from a
    default of 8 threads: the count served is one at which the chosen dtype is exact, lowered
    exactly when nothing was exact at 8, and the log says so."""
    if "avx2" not in _flags():
        pytest.skip("this CPU has no AVX2 path to take")
    code = (
        "import logging, sys, torch\n"
        "logging.basicConfig(level=logging.WARNING, stream=sys.stdout)\n"
        "from edgespec.runner import dtype_choice, threads\n"
        "threads.default_threads = lambda: 8\n"
        "threads.set_threads(None)\n"
        "chosen = dtype_choice.resolve_dtype('auto')\n"
        "served = torch.get_num_threads()\n"
        "assert dtype_choice.exact_here(chosen), (chosen, served)\n"
        "torch.set_num_threads(8)\n"
        "at8 = any(dtype_choice.exact_here(d) for d in ('float32', 'bfloat16'))\n"
        "print('served', chosen, served, 'exact at 8:', at8)\n")
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
           "ATEN_CPU_CAPABILITY": "avx2"}
    env.pop("EDGESPEC_THREADS", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("served "))
    _, chosen, served, *_, at8 = line.split()
    assert chosen == "float32"  # no packed bfloat16 linear on AVX2: never served inexactly
    assert (int(served) == 8) == (at8 == "True"), line
    if int(served) < 8:
        assert f"serving at {served} threads" in r.stdout, r.stdout


def test_only_a_drafter_that_runs_a_model_in_torch_imports_it(tiny_dir):
    """MaG, Cacheback and llama.cpp run no torch: their count is kept (llama.cpp reads it) and
    torch is left unimported; where torch is imported already, its count is set all the same;
    a model drafter, alone or in a cascade, gets torch and the count."""
    code = (
        "import sys\n"
        "from drafter_node.edge_drafter import runs_torch\n"
        "from edgespec.runner import threads\n"
        "for spec in ('mag', 'cacheback', 'mag+cacheback', 'llamacpp:default'):\n"
        "    assert not runs_torch(spec), spec\n"
        "assert threads.set_threads(2, torch_too=False) == 2 and threads.threads_in_use() == 2\n"
        "assert 'torch' not in sys.modules\n"
        f"for spec in ('model:{tiny_dir}', 'cascade:model:{tiny_dir},mag'):\n"
        "    assert runs_torch(spec), spec\n"
        "import torch\n"
        "threads.set_threads(1, torch_too=False)\n"
        "assert torch.get_num_threads() == 1\n"
        "threads.set_threads(2, torch_too=True)\n"
        "assert torch.get_num_threads() == 2\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "EDGESPEC_THREADS"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_a_mag_board_starts_without_importing_torch():
    """``edgespec drafter --drafter mag`` where torch is installed: up to its first attach (to
    a port nothing listens at) no module of torch is imported (Python's import log)."""
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "edgespec_cli", "drafter", "--cache",
         "127.0.0.1:9", "--device-id", "board-1", "--drafter", "mag+cacheback"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
        env={k: v for k, v in os.environ.items() if k != "EDGESPEC_THREADS"})
    imported = []
    watchdog = threading.Timer(120, proc.kill)  # a drafter that never says it attaches
    watchdog.start()
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "attaching to 127.0.0.1:9" in line:
                break
            if line.startswith("import time:"):
                imported.append(line.rsplit("|", 1)[-1].strip())
        else:
            raise AssertionError(f"the drafter exited ({proc.wait()}) before attaching")
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
    assert "numpy" in imported and "drafter_node.agent" in imported  # the log was read
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


def test_the_fleets_drafter_actor_imports_torch_only_for_a_model():
    """The Ray drafter actor's constructor (no Ray needed to call it): MaG leaves torch
    unimported; a model drafter on a board without torch says why in its ``error`` (as any
    drafter that cannot be built), where the actor's constructor must not raise."""
    code = (
        "import sys\n"
        "from edgespec_cli.deployment.drafter_actor import DrafterActor\n"
        "a = DrafterActor('127.0.0.1:9', 'board-1', 'mag+cacheback')\n"
        "assert a.error is None and 'torch' not in sys.modules, a.error\n"
        "a.stop()\n"
        "sys.modules['torch'] = None  # a board without torch\n"
        "b = DrafterActor('127.0.0.1:9', 'board-2', 'cascade:mag,model:/nowhere')\n"
        "assert b.error and b.agent is None, b.error\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={k: v for k, v in os.environ.items()
                                         if k != "EDGESPEC_THREADS"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
