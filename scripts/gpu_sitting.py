"""A GPU sitting: edgespec's verifier measured and checked on one NVIDIA GPU, in one command.

Run by ``scripts/gpu_sitting.sh`` (which installs the wheels it is given first). On random-weight
models of the SmolLM2-135M, SmolLM2-1.7B and Llama-3.1-8B shapes (``135m``, ``1.7b``, ``8b``,
built on the GPU from their configs: no download), in bfloat16 (``--dtype auto`` there), it

1. runs the CUDA tests (the invariance sweep, the verification maths and the end-to-end lossless
   module ``tests/test_cuda_lossless.py``) and records their summary;
2. measures the linear layer's choice: per layer shape and row count, whether plain cuBLAS calls
   and the runner's 128-row tiles give a row the same bits whatever the call's row count, and
   what each costs, eager and replayed from a CUDA graph;
3. counts speculative outputs identical to target-only ones per shape (MaG and MaG + Cacheback,
   8 sessions batched, greedy and keyed sampling, against each prompt decoded alone);
4. times the runner's forward (``bench-forward``'s synchronised timer) at 1, 8 and 64 sessions x
   1, 5 and 9 tokens over 300-token contexts, and the start check;
5. times end-to-end decoding of one stream: edgespec target-only, transformers' ``generate``
   eager, and with its static cache (compiled with CUDA graphs by transformers).

It writes ``sitting.json`` and ``sitting.md`` (a table) into ``--out`` after every stage, so a
sitting cut short keeps what it measured. ``--dry-run`` runs every stage on the CPU over one layer
of each shape with fewer tokens: the plumbing, not the numbers."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgespec.config import EngineConfig, SamplingParams  # noqa: E402
from edgespec.drafters import build_drafter  # noqa: E402
from edgespec.engine.spec_engine import Request, SpecEngine  # noqa: E402
from edgespec.models.shapes import SHAPES, random_model  # noqa: E402
from edgespec.runner.dtype_probe import first_varying_count, probe_input  # noqa: E402
from edgespec.runner.linear import Linear  # noqa: E402
from edgespec.runner.target_runner import TargetRunner  # noqa: E402
from edgespec_cli.bench.forward_cost import _prepared_runner, _time_forward, synchronize  # noqa: E402,E501

CUDA_TESTS = ["tests/test_batch_invariance.py", "tests/test_verification.py",
              "tests/test_cuda_lossless.py", "tests/test_step_graphs.py"]
CUDA_SELECT = "cuda or host_keyed_choice"  # the CUDA cases, and the test that loops devices


class Sitting:
    """The results so far, written out after every stage."""

    def __init__(self, out: Path, device: str, dry: bool):
        self.out, self.device, self.dry = out, device, dry
        self.t0 = time.perf_counter()
        name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)"
        self.data: dict = {"gpu": name, "torch": torch.__version__, "dtype": "bfloat16",
                           "dry_run": dry, "stages_s": {}, "lossless": {}, "forward": [],
                           "e2e": {}, "linear": [], "start_check_s": {}, "tests": None,
                           "command": "scripts/gpu_sitting.sh " + " ".join(sys.argv[1:])}
        out.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def stage(self, name: str, fn) -> None:
        say(f"== {name} (at {self.elapsed():.0f} s)")
        t = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # a stage that breaks is recorded; the next one still runs
            self.data.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            say(f"   {name} failed: {exc!r}")
        self.data["stages_s"][name] = round(time.perf_counter() - t, 1)
        self.save()

    def save(self) -> None:
        (self.out / "sitting.json").write_text(json.dumps(self.data, indent=2) + "\n")
        (self.out / "sitting.md").write_text(format_tables(self.data))


def say(msg: str) -> None:
    print(msg, flush=True)


def run_cuda_tests(s: Sitting) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p]))
    if s.dry:
        env.update(EDGESPEC_LOSSLESS_DEVICE="cpu", EDGESPEC_LOSSLESS_LAYERS="1")
        select = ["-k", "test_cuda_lossless and 1.7b-bfloat16 and greedy"]
    else:
        select = ["-k", CUDA_SELECT]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS, *select]
    say("   " + " ".join(cmd))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    tail = (done.stdout + done.stderr).strip().splitlines()
    say("\n".join("   " + line for line in tail[-25:]))
    summary = next((line for line in reversed(tail) if re.search(r"\d+ (passed|failed)", line)),
                   "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    s.data["tests"] = {"rc": done.returncode, "summary": summary, **counts,
                       "failures": [line for line in tail if line.startswith("FAILED")][:20]}


LINEAR_SHAPES = [(576, 960), (1536, 576), (2048, 6144), (2048, 2048), (8192, 2048),
                 (4096, 6144), (4096, 4096), (14336, 4096), (4096, 28672)]


def measure_linears(s: Sitting) -> None:
    """Invariance (plain against tiled) and cost per call, eager and graph-replayed."""
    shapes = LINEAR_SHAPES[:3] if s.dry else LINEAR_SHAPES
    counts = list(range(1, 300)) if not s.dry else [1, 2, 3, 7, 130]
    for dtype in ("bfloat16", "float32"):
        for k, n in shapes:
            g = torch.Generator().manual_seed(k * n)
            w = (torch.randn(n, k, generator=g) * 0.02).to(s.device, getattr(torch, dtype))
            row = {"dtype": dtype, "in": k, "out": n}
            for kind, tiled in (("plain", False), ("tiled", True)):
                lin = Linear(w, pack=False, tiled=tiled)
                x = probe_input(max(counts[-1] + 1, 512), k, w)
                row[f"{kind}_first_varying_rows"] = first_varying_count(lin, x, counts)
                if dtype == "bfloat16":
                    row[f"{kind}_us"] = {r: _call_cost(lin, x[:r], s) for r in
                                         ((1, 8, 64, 128, 129, 256, 512) if not s.dry else (1, 8))}
            s.data["linear"].append(row)
            say(f"   {dtype} {k}->{n}: plain varies at {row['plain_first_varying_rows']}, "
                f"tiled at {row['tiled_first_varying_rows']}")


def _call_cost(lin, x, s: Sitting) -> dict[str, float]:
    """Microseconds a call: eager (CUDA events around 20 calls) and replayed from a CUDA graph."""
    if s.device != "cuda":
        t = time.perf_counter()
        lin(x)
        return {"eager": round(1e6 * (time.perf_counter() - t), 1)}
    for _ in range(3):
        lin(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        lin(x)
    end.record()
    torch.cuda.synchronize()
    eager = 1000 * start.elapsed_time(end) / 20
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        lin(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lin(x)
    graph.replay()
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return {"eager": round(eager, 1), "graph": round(1000 * start.elapsed_time(end) / 20, 1)}


def lossless(s: Sitting, shape: str, model) -> None:
    """Speculative outputs identical to target-only, MaG and MaG + Cacheback, 8 sessions."""
    n_prompts, new = (8, 32) if not s.dry else (2, 6)
    runner = TargetRunner(model, n_slots=n_prompts, max_len=160)
    rng = random.Random(shape)
    prompts = [[1] + [rng.randrange(3, runner.vocab_size) for _ in range(rng.randint(8, 60))]
               for _ in range(n_prompts)]
    cfg = EngineConfig(max_sessions=n_prompts, max_context=160)
    identical = total = g_identical = 0
    for sampled in (False, True):
        params = [SamplingParams(temperature=0.8, seed=i) if sampled else SamplingParams()
                  for i in range(n_prompts)]
        with SpecEngine(runner, None, cfg, stop_ids={2}) as engine:
            refs = [engine.generate(Request(p, new, q)).token_ids
                    for p, q in zip(prompts, params)]
        for spec in ("mag", "mag+cacheback"):
            with SpecEngine(runner, build_drafter(spec), cfg, stop_ids={2}) as engine:
                got = engine.generate_many([Request(p, new, q) for p, q in zip(prompts, params)])
            identical += sum(r.token_ids == ref for r, ref in zip(got, refs))
            total += len(refs)
        graphed = TargetRunner(model, n_slots=n_prompts, max_len=160, graphs=True)
        with SpecEngine(graphed, build_drafter("mag"), cfg, stop_ids={2}) as engine:
            got = engine.generate_many([Request(p, new, q) for p, q in zip(prompts, params)])
        g_identical += sum(r.token_ids == ref for r, ref in zip(got, refs))
        del graphed
    s.data["lossless"][shape] = {"identical": identical, "total": total, "tokens": new,
                                 "cuda_graphs_identical": g_identical,
                                 "cuda_graphs_total": 2 * n_prompts}
    say(f"   {shape}: {identical} of {total} speculative outputs identical to target-only; "
        f"with CUDA graphs {g_identical} of {2 * n_prompts}")


def forward_costs(s: Sitting, shape: str, model) -> None:
    batches, tokens = ((1, 8, 64), (1, 5, 9)) if not s.dry else ((1, 2), (1, 5))
    context = 300 if not s.dry else 20
    t = time.perf_counter()
    runner = _prepared_runner(model, max(batches), context, context + max(tokens) + 1)
    s.data["start_check_s"][shape] = round(time.perf_counter() - t, 2)  # with the prefill
    t = time.perf_counter()
    runner._check_invariance(runner.col_tile)
    synchronize(runner.device)
    s.data["start_check_s"][shape] = round(time.perf_counter() - t, 3)
    for B in batches:
        for T in tokens:
            ms = 1000 * _time_forward(runner, B, T, 5 if not s.dry else 1)
            s.data["forward"].append({"shape": shape, "sessions": B, "tokens": T,
                                      "ms": round(ms, 2)})
            say(f"   {shape} {B} x {T}: {ms:.2f} ms")


def end_to_end(s: Sitting, shape: str, model) -> None:
    new = 128 if not s.dry else 4
    rng = random.Random(f"e2e-{shape}")
    prompt = [1] + [rng.randrange(3, model.config.vocab_size) for _ in range(40)]
    runner = TargetRunner(model, n_slots=1, max_len=256)
    with SpecEngine(runner, None, EngineConfig(max_sessions=1, max_context=256),
                    stop_ids=set()) as engine:
        engine.generate(Request(prompt, 8))  # warm-up
        synchronize(runner.device)
        t = time.perf_counter()
        res = engine.generate(Request(prompt, new))
        ours = len(res.token_ids) / (time.perf_counter() - t)
    del runner
    row = {"target_only_tok_s": round(ours, 1)}
    graphed = TargetRunner(model, n_slots=1, max_len=256, graphs=True)
    with SpecEngine(graphed, None, EngineConfig(max_sessions=1, max_context=256),
                    stop_ids=set()) as engine:
        t = time.perf_counter()
        engine.generate(Request(prompt, new))  # captures the buckets it meets
        synchronize(graphed.device)
        row["cuda_graphs_warmup_s"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        res = engine.generate(Request(prompt, new))
        row["target_only_cuda_graphs_tok_s"] = round(
            len(res.token_ids) / (time.perf_counter() - t), 1)
    del graphed
    s.data["e2e"][shape] = row
    ids = torch.tensor([prompt], device=s.device)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    row["hf_generate_tok_s"] = round(_hf_rate(model, ids, new, kw, s), 1)
    s.save()
    if s.elapsed() > s.budget_s:
        row["hf_static_tok_s"] = None
        row["hf_static_note"] = "skipped: the sitting's time budget was spent"
        return
    t = time.perf_counter()
    _hf_rate(model, ids, 8, dict(kw, max_new_tokens=8, min_new_tokens=8,
                                 cache_implementation="static"), s)  # compiles (tens of s)
    row["hf_static_warmup_s"] = round(time.perf_counter() - t, 1)
    row["hf_static_tok_s"] = round(_hf_rate(model, ids, new, dict(
        kw, cache_implementation="static"), s), 1)
    say(f"   {shape}: {row}")


def _hf_rate(model, ids, new: int, kw: dict, s: Sitting) -> float:
    with torch.inference_mode():
        model.generate(ids, **dict(kw, max_new_tokens=min(new, 4), min_new_tokens=min(new, 4)))
        synchronize(s.device)
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        synchronize(s.device)
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t)


def format_tables(d: dict) -> str:
    lines = [f"# GPU sitting: {d['gpu']}, torch {d['torch']}, {d['dtype']}", ""]
    if d.get("tests"):
        lines += [f"CUDA tests: {d['tests'].get('summary', '')} (rc {d['tests']['rc']})", ""]
    if d["lossless"]:
        lines += ["| shape | speculative identical to target-only |", "|---|---|"]
        lines += [f"| {k} | {v['identical']} of {v['total']} |" for k, v in d["lossless"].items()]
        lines.append("")
    if d["forward"]:
        lines += ["| shape | sessions x tokens | ms a forward |", "|---|---|---|"]
        lines += [f"| {c['shape']} | {c['sessions']} x {c['tokens']} | {c['ms']:.2f} |"
                  for c in d["forward"]]
        lines.append("")
    if d["e2e"]:
        lines += ["| shape | edgespec target-only tok/s | transformers generate | "
                  "transformers static cache (compiled) |", "|---|---|---|---|"]
        for k, v in d["e2e"].items():
            lines.append(f"| {k} | {v.get('target_only_tok_s')} | {v.get('hf_generate_tok_s')} | "
                         f"{v.get('hf_static_tok_s')} |")
        lines.append("")
    if d["linear"]:
        lines += ["| dtype | in -> out | plain: first varying row count | tiled | "
                  "us/call 1 / 128 / 512 rows plain eager, tiled eager, tiled graph |",
                  "|---|---|---|---|---|"]
        for r in d["linear"]:
            cost = ""
            if "plain_us" in r:
                def us(kind, key):
                    return "/".join(str(r[f"{kind}_us"].get(n, {}).get(key, "-"))
                                    for n in (1, 128, 512))
                cost = f"{us('plain', 'eager')}, {us('tiled', 'eager')}, {us('tiled', 'graph')}"
            lines.append(f"| {r['dtype']} | {r['in']} -> {r['out']} | "
                         f"{r['plain_first_varying_rows']} | {r['tiled_first_varying_rows']} | "
                         f"{cost} |")
    if d.get("errors"):
        lines += ["", "Errors: " + json.dumps(d["errors"])]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "measured" / "gpu")
    p.add_argument("--dry-run", action="store_true",
                   help="every stage on the CPU over one layer of each shape (the plumbing)")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--budget-s", type=float, default=330,
                   help="seconds after which transformers' compiled static cache is skipped")
    p.add_argument("--skip", default="", help="stages to leave out: tests,linear,lossless,"
                                              "forward,e2e")
    args = p.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_sitting: no CUDA device here (use --dry-run on a CPU)", file=sys.stderr)
        return 2
    torch.set_num_threads(min(8, os.cpu_count() or 1))  # host side only; said in the JSON
    s = Sitting(args.out, "cpu" if args.dry_run else "cuda", args.dry_run)
    s.budget_s = args.budget_s
    s.data["host_threads"] = torch.get_num_threads()
    skip = set(args.skip.split(","))
    if "tests" not in skip:
        s.stage("tests", lambda: run_cuda_tests(s))
    if "linear" not in skip:
        s.stage("linear", lambda: measure_linears(s))
    for shape in args.shapes.split(","):
        say(f"== building a random-weight {shape} (bfloat16)")
        model = random_model(shape, s.device, "bfloat16", layers=1 if s.dry else None)
        for name, fn in (("lossless", lossless), ("forward", forward_costs),
                         ("e2e", end_to_end)):
            if name not in skip:
                s.stage(f"{name} {shape}", lambda fn=fn, sh=shape, m=model: fn(s, sh, m))
        del model
        if s.device == "cuda":
            torch.cuda.empty_cache()
    s.data["total_s"] = round(s.elapsed(), 1)
    s.save()
    say(format_tables(s.data))
    failed = s.data.get("tests") and s.data["tests"]["rc"] not in (0, None)
    lost = any(v["identical"] != v["total"] for v in s.data["lossless"].values())
    return 1 if failed or lost or s.data.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
