"""The GPU sitting's CUDA tests (``stage_tests``): the test files and the selection that run
the project's CUDA tests (those a CPU suite skips, "no CUDA device here") with the host at 8
threads, interrupted as Ctrl-C would past their timeout, so that the failures and the counts of
what ran are kept; ``tests.log`` holds every failure's traceback and captured log.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from sitting_common import say

ROOT = Path(__file__).resolve().parents[1]
CUDA_TESTS = ["tests/test_fused_kernels.py", "tests/test_fused_attention.py",
              "tests/test_step_graphs.py", "tests/test_fused_runner.py",
              "tests/test_batch_invariance.py", "tests/test_invariance_probes.py",
              "tests/test_verification.py", "tests/test_verification_syncs.py",
              "tests/test_cuda_lossless.py", "tests/test_gemm_plan.py",
              "tests/test_shared_prefill.py"]
CUDA_SELECT = "cuda or host_keyed_choice or fused or slot_attention or rms_norm or silu or rope"
INTERRUPT_GRACE_S = 20  # the tests' summary after their timeout's Ctrl-C


def stage_tests(s, timeout_s: float, workers: int = 0) -> None:
    # 8 host threads: the CPU-side fixtures' dtype probe is proven at 1-8 (at 16 this
    # machine's CPU attention varied, seen in the first sitting of issue 36)
    env = dict(os.environ, OMP_NUM_THREADS="8", PYTHONPATH=os.pathsep.join(
        [p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p]))
    if s.dry:
        env.update(EDGESPEC_LOSSLESS_DEVICE="cpu", EDGESPEC_LOSSLESS_LAYERS="1")
        select = ["tests/test_fused_kernels.py", "tests/test_fused_attention.py"]
    else:
        select = [*CUDA_TESTS, "-k", CUDA_SELECT]
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *select]
    if workers > 0:
        cmd[3:3] = ["-n", str(workers)]
    say("   " + " ".join(cmd))
    # a process group of its own: pytest and its xdist workers, signalled together
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        # interrupted as Ctrl-C would: pytest stops its workers and still prints the failures
        # and the counts of what ran (a kill left no summary to read)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            text, _ = proc.communicate(timeout=INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the workers too: none holds the pipe open
            try:
                text, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                text = "(no output: the tests did not end when killed)"
        text, rc = f"{text}\ntimed out after {timeout_s:.0f} s", 124
    (s.out / "tests.log").write_text(text)  # every failure's traceback and captured log
    tail = text.strip().splitlines()
    say("\n".join("   " + line for line in tail[-25:]))
    summary = next((line for line in reversed(tail) if re.search(r"\d+ (passed|failed)", line)),
                   "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    failures = [line for line in tail if line.startswith(("FAILED", "ERROR"))][:20]
    say("\n".join("   " + line for line in failures))
    s.data["tests"] = {"rc": rc, "summary": summary, **counts, "failures": failures}
