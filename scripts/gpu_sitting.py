"""A GPU sitting: every goal of the GPU verifier measured and checked in one run.

Run by ``scripts/gpu_sitting.sh`` (which installs the wheels it is given first). On random-weight
models of the SmolLM2-135M, SmolLM2-1.7B and Llama-3.1-8B shapes (built on the GPU from their
configs: no download), in bfloat16, with the runner's defaults on CUDA (the fused Triton kernels,
CUDA graphs captured at start), stages in this order:

0. ``attention``: the fused attention kernels (tiles, rows, split, chunks) against each other
   at each shape's head layout over 300 and 4,096 keys (``sitting_attention``): probe, medians
   of calls replayed from a CUDA graph, whether chunks gives split's bits, how far apart;
   ``gemm``: the products, cuBLAS tiles against each Triton GEMM configuration (with and
   without split-K), per shape, rows alone = in batch (``sitting_gemm``), replayed the same way;
a. ``graphs``: graphed against eager forward in one process, per shape, at 1 x 1, 8 x 5, 64 x 1
   and 64 x 9 (sessions x tokens) over 300-token contexts: CUDA-event medians of 20, the bits
   equal, capture seconds and memory, and the kernels and GPU-busy time of one profiled replay;
   ``decode``: a graphed runner of each of the tiles, split, chunks and split-decode
   attention at 1 x 1 over 300 and 4,096 keys and at 64 x 9 (one its start probe refuses: a
   row saying why); ``exactness``: the same model's step on cuBLAS and SDPA, graphed
   (not batch-invariant), against the runner's at 1 x 1 and 64 x 9 (``sitting_exactness``);
b. ``e2e``: one stream of 128 tokens, target-only and MaG + Cacheback with graphs, outputs
   identical, ms a step; ``lossless``: 8 sessions batched, MaG and MaG + Cacheback, greedy and
   keyed sampling, 32 tokens, against each prompt decoded alone;
c. ``hf``: transformers' compiled static-cache ``generate`` (warm-up as long as the timed run),
   8b first, within the time budget;
d. ``fleet``: 16, 32 and 64 concurrent sessions, MaG drafts batched against the same sessions
   target-only batched and (16, 32) one session a forward, outputs identical, throughput
   ratios, each batched step's time split (prefill, plan + take + propose, forward +
   verification, place + commit, the rest);
e. ``tests``: the CUDA tests, under a timeout past which they are interrupted, their
   failures and counts kept (``sitting_tests``; ``--tests-first``: before stage 0, their
   Triton kernels then compiled into the cache the stages read; ``--tests-workers N``:
   pytest-xdist).

Stage a runs for every shape, then b for every shape, then d, so that a sitting cut short by
``--deadline-s`` (no stage starts after it) keeps the kernels' goals at every shape.

Stages b, c and d are in ``sitting_serving``; the timing and profiling the stages share in
``sitting_common``.

It writes ``sitting.json`` and ``sitting.md`` (and the tests' whole output, ``tests.log``) into
``--out`` after every stage, ``sitting.md`` opening with the GPU issues' goals, each met, missed
or not measured (``sitting_goals``; the one-stream goal against ``hf-reference.json`` where
``hf`` is skipped), so a sitting cut short keeps what it measured, and exits non-zero on
any mismatch, failed capture or failed test.
``--dry-run`` runs every stage on the CPU over one layer of each shape under Triton's interpreter
(the plumbing, not the numbers), the models in float32: bfloat16's products are not
batch-invariant on every CPU (on an AMX Xeon the runner's start check refuses them)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
if "--dry-run" in sys.argv:  # Triton's interpreter, as the tests run it on a CPU
    sys.path.insert(0, str(ROOT / "tests"))
    import triton_on_cpu  # noqa: F401

import torch  # noqa: E402

from edgespec.models.shapes import SHAPES, random_model  # noqa: E402
from edgespec.runner.target_runner import TargetRunner  # noqa: E402
from sitting_attention import stage_attention  # noqa: E402
from sitting_common import (  # noqa: E402
    CONTEXT, LONG_CONTEXT, alone_equal, chain_rows, event_median_ms, free_device_memory,
    graphed_median_ms, profile_kernels, runner_for, say)
from sitting_steps import stage_breakdown, stage_decode, stage_plain  # noqa: E402
from sitting_gemm import ROWS, stage_gemm  # noqa: E402
from sitting_goals import hf_reference  # noqa: E402
from sitting_serving import stage_e2e, stage_fleet, stage_hf  # noqa: E402
from sitting_tables import format_tables  # noqa: E402
from sitting_tests import INTERRUPT_GRACE_S, stage_tests  # noqa: E402

FORWARD_SHAPES = ((1, 1), (8, 5), (64, 1), (64, 9))


class Sitting:
    """The results so far, written out after every stage."""

    def __init__(self, out: Path, device: str, dry: bool, budget_s: float):
        self.out, self.device, self.dry, self.budget_s = out, device, dry, budget_s
        self.deadline_s: float | None = None  # no stage starts after it (--deadline-s)
        self.t0 = time.perf_counter()
        self.dtype = "float32" if dry else "bfloat16"  # the models' (module docstring)
        name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)"
        try:
            import triton
            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        self.data: dict = {"gpu": name, "torch": torch.__version__, "triton": triton_version,
                           "dtype": self.dtype, "dry_run": dry, "stages_s": {}, "graphs": {},
                           "forward": [], "e2e": {}, "lossless": {}, "hf": {}, "fleet": {},
                           "attention": {}, "gemm": {}, "tests": None, "mismatches": [],
                           "command": "scripts/gpu_sitting.sh " + " ".join(sys.argv[1:])}
        out.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def stage(self, name: str, fn) -> None:
        if self.deadline_s is not None and self.elapsed() > self.deadline_s:
            self.data.setdefault("not_run", []).append(name)
            say(f"== {name}: not run (past the --deadline-s of {self.deadline_s:.0f} s)")
            self.save()
            return
        say(f"== {name} (at {self.elapsed():.0f} s)")
        t = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # a stage that breaks is recorded; the next one still runs
            self.data.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            say(f"   {name} failed: {exc!r}")
            import traceback
            traceback.print_exc()
        self.data["stages_s"][name] = round(time.perf_counter() - t, 1)
        free_device_memory(self.device)  # runners hold each other in cycles: collect them
        self.save()

    def mismatch(self, what: str) -> None:
        self.data["mismatches"].append(what)
        say(f"   MISMATCH: {what}")

    def save(self) -> None:
        (self.out / "sitting.json").write_text(json.dumps(self.data, indent=2) + "\n")
        (self.out / "sitting.md").write_text(format_tables(self.data))


def stage_graphs(s: Sitting, shape: str, model) -> None:
    """(a) graphed against eager, the bits equal."""
    sizes = FORWARD_SHAPES if not s.dry else ((1, 1), (2, 5))
    context = CONTEXT if not s.dry else 20
    top = max(b for b, _ in sizes)
    max_len = context + 32
    t = time.perf_counter()
    graphed = runner_for(s, model, top, max_len, graphs=True)
    build_s = time.perf_counter() - t
    eager = runner_for(s, model, top, max_len, graphs=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, graphed.vocab_size, (context,), generator=g).tolist()
               for _ in range(top)]

    def prefill(runner):
        for slot, ids in enumerate(prompts):
            runner.new_slot()
            runner.prefill(slot, ids)

    prefill(graphed)
    prefill(eager)
    state = graphed.graphs.state()
    s.data["graphs"][shape] = {"runner_build_s": round(build_s, 2),
                               "attention": graphed.attention,
                               "start_check_s": graphed.start_check_s,
                               "capture_s": state.capture_s, "captured": state.captured,
                               "buckets": state.buckets, "memory_mb": state.memory_mb,
                               "failed": state.failed}
    if state.failed:
        s.mismatch(f"{shape}: a capture failed: {state.failed}")
    say(f"   {shape}: runner built in {build_s:.1f} s, {state.captured}/{state.buckets} "
        f"buckets captured in {state.capture_s:.1f} s, {state.memory_mb:.0f} MB")
    repeat = 20 if not s.dry else 1
    time_against_eager(s, shape, graphed, eager, sizes, repeat)
    del graphed, eager
    free_device_memory(s.device)


def time_against_eager(s: Sitting, shape: str, graphed: TargetRunner, eager: TargetRunner,
                       sizes, repeat: int) -> None:
    """(a)'s rows: each size graphed and eager, bits, the row alone, kernels."""
    for B, T in sizes:
        rows = chain_rows(graphed, B, T)
        same = torch.equal(graphed.score_rows(rows).logits, eager.score_rows(rows).logits)
        if not same:
            s.mismatch(f"{shape} {B}x{T}: graphed logits differ from eager")
        alone = alone_equal(graphed, rows, T)
        if not alone:
            s.mismatch(f"{shape} {B}x{T}: slot 0's row differs from the same row alone")
        row = {"shape": shape, "sessions": B, "tokens": T, "bits_equal": same,
               "alone_equal": alone,
               "ms": round(event_median_ms(lambda: graphed.score_rows(rows), s.device,
                                           repeat), 3),
               "eager_ms": round(event_median_ms(lambda: eager.score_rows(rows), s.device,
                                                 repeat), 3)}
        row.update({f"graph_{k}": v for k, v in
                    profile_kernels(lambda: graphed.score_rows(rows), s.device).items()})
        row.update({f"eager_{k}": v for k, v in
                    profile_kernels(lambda: eager.score_rows(rows), s.device).items()})
        s.data["forward"].append(row)
        say(f"   {shape} {B} x {T}: graphed {row['ms']:.2f} ms, eager {row['eager_ms']:.2f} ms, "
            f"bits equal {same}, kernels {row.get('graph_kernels')} busy "
            f"{row.get('graph_busy_us')} us")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "measured" / "gpu")
    p.add_argument("--dry-run", action="store_true",
                   help="every stage on the CPU over one layer of each shape (the plumbing)")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--budget-s", type=float, default=330,
                   help="seconds after which transformers' compiled generate is skipped")
    p.add_argument("--tests-timeout-s", type=float, default=240,
                   help="seconds after which the CUDA tests are interrupted (their failures and "
                        "counts so far kept)")
    p.add_argument("--skip", default="",
                   help="stages to leave out: attention,gemm,graphs,e2e,hf,fleet,tests")
    p.add_argument("--breakdown", default="",
                   help="shapes whose graphed step's kernels are broken down by name first")
    p.add_argument("--tests-first", action="store_true",
                   help="run the CUDA tests before every other stage (their Triton kernels "
                        "compiled once, into the cache the stages then read)")
    p.add_argument("--tests-workers", type=int, default=0,
                   help="pytest-xdist workers for the CUDA tests (0: one process)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="no stage starts after this many seconds (recorded as not run), and "
                        "the tests' timeout shrinks to what is left before --end-s")
    p.add_argument("--end-s", type=float, default=None,
                   help="seconds by which the sitting must have ended (the tests' timeout "
                        "is cut to fit)")
    args = p.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_sitting: no CUDA device here (use --dry-run on a CPU)", file=sys.stderr)
        return 2
    torch.set_num_threads(min(8, os.cpu_count() or 1))  # host side only; said in the JSON
    s = Sitting(args.out, "cpu" if args.dry_run else "cuda", args.dry_run, args.budget_s)
    s.data["host_threads"] = torch.get_num_threads()
    s.deadline_s = args.deadline_s
    say(f"sitting on {s.data['gpu']}: torch {torch.__version__}, triton {s.data['triton']}")
    skip = set(args.skip.split(","))
    if "hf" in skip:  # the one-stream goal against the last sitting that compiled generate
        s.data["hf_reference"] = hf_reference()
    shapes = args.shapes.split(",")
    models = {}

    def model_of(shape):
        if shape not in models:
            models.clear()
            free_device_memory(s.device)
            models[shape] = random_model(shape, s.device, s.dtype,
                                         layers=1 if s.dry else None)
        return models[shape]

    if "tests" not in skip and args.tests_first:
        s.stage("tests", lambda: stage_tests(s, args.tests_timeout_s, args.tests_workers))
    if "attention" not in skip:
        sizes = FORWARD_SHAPES if not s.dry else ((1, 1), (2, 5))
        s.stage("attention", lambda: stage_attention(
            s, shapes, sizes, (CONTEXT, LONG_CONTEXT) if not s.dry else (70, 300),
            lambda fn: graphed_median_ms(fn, s.device, 20 if not s.dry else 1)))
    if "gemm" not in skip:
        s.stage("gemm", lambda: stage_gemm(
            s, shapes, ROWS if not s.dry else (1, 5),
            lambda fn: graphed_median_ms(fn, s.device, 10 if not s.dry else 1)))
    for shape in [x for x in args.breakdown.split(",") if x]:
        s.stage(f"breakdown {shape}", lambda sh=shape: stage_breakdown(s, sh, model_of(sh)))
    # the kernels' goals at every shape first, then the serving stages: a sitting cut short by
    # --deadline-s keeps the first for every shape
    for group in ((("graphs", stage_graphs), ("decode", stage_decode),
                   ("exactness", stage_plain)),
                  (("e2e", stage_e2e),), (("fleet", stage_fleet),)):
        for shape in shapes:
            for name, fn in group:
                if name not in skip:
                    s.stage(f"{name} {shape}", lambda fn=fn, sh=shape: fn(s, sh, model_of(sh)))
    def tests():
        models.clear()
        free_device_memory(s.device)
        timeout = args.tests_timeout_s
        if args.end_s is not None:
            # with room for the summary after an interrupt
            timeout = min(timeout, args.end_s - s.elapsed() - INTERRUPT_GRACE_S)
        if timeout < 30:
            s.data.setdefault("not_run", []).append("tests")
            say(f"== tests: not run ({timeout:.0f} s left before --end-s)")
            return
        s.deadline_s = None  # the tests run past the deadline, within --end-s
        s.stage("tests", lambda: stage_tests(s, timeout, args.tests_workers))

    if "hf" not in skip:
        for shape in sorted(shapes, key=lambda x: x != "8b"):  # 8b first
            s.stage(f"hf {shape}", lambda sh=shape: stage_hf(s, sh, model_of(sh)))
    if "tests" not in skip and not args.tests_first:
        tests()
    s.data["total_s"] = round(s.elapsed(), 1)
    s.save()
    say(format_tables(s.data))
    failed = s.data.get("tests") and s.data["tests"]["rc"] not in (0, None)
    return 1 if failed or s.data["mismatches"] or s.data.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
