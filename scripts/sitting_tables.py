"""The GPU sitting's tables (``scripts/gpu_sitting.py``): ``sitting.md`` from ``sitting.json``."""

from __future__ import annotations

import json

from sitting_goals import goal_rows


def _table(head: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join("-" if v is None else str(v) for v in r) + " |" for r in rows]
    return out + [""]


def format_tables(d: dict) -> str:
    lines = [f"# GPU sitting: {d['gpu']}, torch {d['torch']}, triton {d.get('triton')}, "
             f"{d['dtype']}", "",
             f"Command: `{d.get('command')}` (what it times per step is the runner's forward, "
             "as `edgespec bench-forward --shape SHAPE --device cuda` runs it alone).", ""]
    if d.get("mismatches"):
        lines += ["**Mismatches:** " + "; ".join(d["mismatches"]), ""]
    goals = goal_rows(d)
    # each goal judged where it was measured (a dry run's figures are the interpreter's)
    if not d.get("dry_run") and any(g.met is not None for g in goals):
        lines += ["Goals (issues 43 and 42), as this sitting measured them:", ""]
        lines += _table(["issue", "goal", "shape", "measured", "met"],
                        [[g.issue, g.goal, g.shape, g.measured,
                          "not measured" if g.met is None else "yes" if g.met else "**no**"]
                         for g in goals])
    if d.get("attention"):
        rows = []
        kernels = list(next(iter(d["attention"].values()))["probe"])
        for shape, e in d["attention"].items():
            for r in e["sizes"]:
                # older sittings: one context, one ratio (the second kernel's over the first)
                vs = r.get("vs_first") or {kernels[-1]: r.get("ratio")}
                rows.append([shape, r.get("context", "300"), f"{r['sessions']} x {r['tokens']}"]
                            + [r.get(f"{k}_ms") for k in kernels]
                            + [vs.get(k) for k in kernels[1:]]
                            + [f"{r.get('max_abs_diff', 0):.1e}", r.get("chunks_equal_split"),
                               " / ".join(str(v) for v in
                                          (r.get("tiles_ms_by_warps") or {}).values()),
                               " / ".join(str(v) for v in
                                          (r.get("tiles_bits_by_warps") or {}).values()),
                               ", ".join(f"{k}: {v}" for k, v in e["probe"].items())])
        lines += _table(["shape", "keys", "sessions x tokens"]
                        + [f"{k} attention ms" for k in kernels]
                        + [f"{k} / {kernels[0]}" for k in kernels[1:]]
                        + ["outputs apart", "chunks = split bits",
                           "tiles ms, 1 / 2 / 4 / 8 warps",
                           "tiles' default bits, 1 / 2 / 4 / 8 warps", "probe"], rows)
    if d.get("gemm"):  # the products' ms a step: cuBLAS tiles, then each Triton config
        first = next(iter(d["gemm"].values()))
        names = list(next(iter(first["step_ms"].values())))
        rows = [[shape, M] + [by.get(k) for k in names]
                for shape, e in d["gemm"].items() for M, by in e["step_ms"].items()]
        first_kernel = 2 if "plan" in names else 1  # tiles (and the runner's plan) first
        rows += [[shape, "row alone = in batch"] + ["-"] * first_kernel
                 + [e["invariant"].get(k) for k in names[first_kernel:]]
                 for shape, e in d["gemm"].items()]
        lines += _table(["shape", "rows"] + [f"{k} ms" for k in names], rows)
        bits = [[shape, e0["linear"], " ; ".join(" = ".join(g) for g in e0["same_bits"])]
                for shape, e in d["gemm"].items() for e0 in e["linears"] if "same_bits" in e0]
        if bits:  # kernels in one group could be chosen by row count with no row's bits moving
            lines += _table(["shape", "product", "kernels giving the same bits (576 rows)"],
                            bits)
    if d.get("decode"):  # graphed steps by attention kernel, at two context lengths
        keys = sorted({k for e in d["decode"].values() for r in e.values() for k in r
                       if k.endswith("_ms")}, key=lambda k: (k.split("@")[0] != "1x1", k))
        refused = any("refused" in r for e in d["decode"].values() for r in e.values())
        lines += _table(["shape", "attention"] + [k.removesuffix("_ms") + " ms" for k in keys]
                        + ["graphs failed"] + (["refused at start"] if refused else []),
                        [[shape, kernel] + [r.get(k) for k in keys] + [r.get("graphs_failed")]
                         + ([r.get("refused")] if refused else [])
                         for shape, e in d["decode"].items() for kernel, r in e.items()])
    if d.get("exactness"):  # the runner's step against the same model's on cuBLAS + SDPA
        lines += _table(["shape", "step", "cuBLAS + SDPA ms (graphed)", "runner ms",
                         "cost of exactness"],
                        [[shape, size, r.get("plain_ms"), r.get("runner_ms"),
                          f"{100 * r['cost_of_exactness']:.0f}%"
                          if r.get("cost_of_exactness") is not None else "-"]
                         for shape, e in d["exactness"].items() for size, r in e.items()])
    if d.get("graphs"):
        lines += _table(["shape", "runner built s", "start check s", "buckets captured",
                         "capture s", "graph memory MB", "failed"],
                        [[k, v.get("runner_build_s"), v.get("start_check_s"),
                          f"{v.get('captured')}/{v.get('buckets')}", v.get("capture_s"),
                          v.get("memory_mb"), v.get("failed")] for k, v in d["graphs"].items()])
    if d.get("forward"):
        lines += _table(["shape", "sessions x tokens", "graphed ms", "eager ms",
                         "graphed = eager bits", "row alone = in batch", "kernels (graph)",
                         "GPU busy us (graph)", "kernels (eager)"],
                        [[c["shape"], f"{c['sessions']} x {c['tokens']}", c.get("ms"),
                          c.get("eager_ms"), c.get("bits_equal"), c.get("alone_equal"),
                          c.get("graph_kernels"), c.get("graph_busy_us"), c.get("eager_kernels")]
                         for c in d["forward"]])
    if d.get("e2e"):
        split = ("prefill", "plan_take_propose", "forward_verify", "place_commit", "rest")
        lines += _table(["shape", "target-only tok/s", "ms a step",
                         "its ms: prefill / plan+take+propose / forward+verify / place+commit / "
                         "rest", "target-only, no step ahead, tok/s", "MaG + Cacheback tok/s",
                         "identical", "transformers compiled static tok/s"],
                        [[k, v.get("target_only_tok_s"), v.get("target_only_ms_step"),
                          " / ".join(str(v.get("target_only_ms_a_step", {}).get(x, "-"))
                                     for x in split),
                          v.get("target_only_no_ahead_tok_s", "-"),
                          v.get("mag_cacheback_tok_s"), v.get("identical"),
                          d.get("hf", {}).get(k, {}).get("static_compiled_tok_s")]
                         for k, v in d["e2e"].items()])
    if d.get("lossless"):
        lines += _table(["shape", "speculative identical to target-only", "steps replayed"],
                        [[k, f"{v['identical']} of {v['total']}", v.get("graph_replays")]
                         for k, v in d["lossless"].items()])
    if d.get("fleet"):
        rows = []
        for k, per in d["fleet"].items():
            for v in per.values():
                ms = v.get("mag", {}).get("ms_a_step", {})
                rows.append([k, v["sessions"], v["batched_s"], v.get("one_a_forward_s", "-"),
                             v.get("throughput_ratio", "-"),
                             v.get("target_only_batched_s", "-"),
                             v.get("target_only_decode_tokens_per_s", "-"),
                             v.get("target_only_no_ahead_decode_tokens_per_s", "-"),
                             v.get("target_only_decode_vs_step", "-"),
                             v.get("mag_over_target_only", "-"),
                             " / ".join(str(ms.get(x, "-")) for x in
                                        ("prefill", "plan_take_propose", "forward_verify",
                                         "place_commit", "rest")),
                             v["identical"]])
        lines += _table(["shape", "sessions", "MaG batched s", "one session a forward s",
                         "batched / one a forward", "target-only batched s",
                         "target-only decode tok/s (prefill left out)",
                         "the same, no step ahead",
                         "of sessions / (sessions x 1 step)", "MaG / target-only",
                         "MaG ms a step: prefill / plan+take+propose / forward+verify / "
                         "place+commit / rest (decide)", "identical"], rows)
    if d.get("tests"):
        lines += [f"CUDA tests: {d['tests'].get('summary', '')} (rc {d['tests']['rc']})", ""]
    if d.get("not_run"):
        lines += ["Not run (past the deadline): " + ", ".join(d["not_run"]), ""]
    if d.get("errors"):
        lines += ["Errors: " + json.dumps(d["errors"]), ""]
    return "\n".join(lines) + "\n"
