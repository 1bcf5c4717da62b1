"""``edgespec bench``'s figures: per category and method aggregates, speed-ups against every
baseline measured in the same run, the summary for the best lossless drafter, and the tables."""

from __future__ import annotations

import json
from collections import defaultdict

CATEGORIES = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
# baselines every method is compared with, where the run measured them
# (target_only_float32: float32 target-only, run when edgespec serves another dtype)
BASELINES = ["target_only", "target_only_float32", "hf_generate", "hf_prompt_lookup",
             "hf_assisted", "llamacpp_target_only", "llamacpp_prompt_lookup"]
SUMMARY_BASELINES = ["target_only", "target_only_float32", "hf_generate", "hf_prompt_lookup",
                     "hf_assisted", "llamacpp_target_only", "llamacpp_prompt_lookup"]
LOOSE_PREFIX = "edgespec-loose:"
TREE_TAG = "@tree"  # edgespec:SPEC@treeN: the drafter SPEC drafting token trees of width N


def is_drafter(method: str) -> bool:
    return method.startswith("edgespec:") and method != "edgespec:none"


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def aggregate(rows: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    agg = {"tokens": tokens, "seconds": round(seconds, 3),
           "tokens_per_s": round(_rate(tokens, seconds), 3),
           "identical_to_target_only": all(r["identical_to_target_only"] for r in rows)}
    if rows and "stats" in rows[0]:
        st = [r["stats"] for r in rows]
        drafts = sum(s["num_drafts"] for s in st)
        drafted = sum(s["drafted"] for s in st)
        accepted = sum(s["accepted"] for s in st)
        steps = sum(s["steps"] for s in st)
        forward = sum(s["forward_s"] for s in st)
        decode = sum(r["decode_seconds"] for r in rows)
        agg.update(mean_acceptance_length=round(1 + accepted / drafts, 3) if drafts else 1.0,
                   acceptance_rate=round(accepted / drafted, 3) if drafted else 0.0,
                   tokens_per_forward=round(tokens / steps, 3) if steps else 0.0,
                   tokens_per_step=round(tokens / steps, 3) if steps else 0.0,  # the old name
                   forward_ms_per_token=round(1000 * forward / tokens, 3) if tokens else 0.0,
                   decode_tokens_per_s=round(_rate(tokens, decode), 3),
                   lossless=not any(s.get("lossless") is False for s in st))
    if rows and "token_match_rate" in rows[0]:
        agg["token_match_rate"] = round(sum(r["token_match_rate"] for r in rows) / len(rows), 4)
    scored = [r for r in rows if r.get("task_score") is not None]
    if scored:
        agg["task_score"] = round(sum(r["task_score"] for r in scored) / len(scored), 4)
    return agg


def summarize(records: list[dict], methods: list[str]) -> dict:
    by = defaultdict(list)
    for r in records:
        by[(r["category"], r["method"])].append(r)
        by[("all", r["method"])].append(r)
    cats = sorted({r["category"] for r in records}, key=CATEGORIES.index) + ["all"]
    table = {c: {m: aggregate(by[(c, m)]) for m in methods} for c in cats}
    for c in cats:
        for m in methods:
            row = table[c][m]
            layers = {r["exit_layer"] for r in by[(c, m)] if "exit_layer" in r}
            if len(layers) == 1:  # an early-exit drafter: layers:L, imitation:DIR
                row["exit_layer"] = layers.pop()
            for base in BASELINES:
                if base in table[c] and table[c][base]["tokens_per_s"]:
                    row[f"speedup_vs_{base}"] = round(
                        row["tokens_per_s"] / table[c][base]["tokens_per_s"], 3)
    lossless = [m for m in methods if is_drafter(m)
                and all(r["identical_to_target_only"] for r in by[("all", m)])]
    # keyed by drafter spec; the loose run as "loose:SPEC"
    drafters = {(m[len("edgespec:"):] if is_drafter(m) else "loose:" + m[len(LOOSE_PREFIX):]):
                _figures(table, cats, m)
                for m in methods if is_drafter(m) or m.startswith(LOOSE_PREFIX)}
    best = max(lossless, key=lambda m: table["all"][m]["tokens_per_s"], default=None)
    summary: dict[str, object] = {"method": best,
               # every lossless drafter's output was identical to target-only on every prompt
               "lossless": all(r["identical_to_target_only"] for r in records
                               if is_drafter(r["method"]))}
    if best:
        figures = _figures(table, cats, best)
        figures.pop("lossless")
        summary.update(figures)
    summary["drafters"] = drafters
    return {"summary": summary, "categories": table}


def _figures(table: dict, cats: list[str], method: str) -> dict:
    row = table["all"][method]
    out = {f"speedup_vs_{b}": row[f"speedup_vs_{b}"] for b in SUMMARY_BASELINES
           if f"speedup_vs_{b}" in row}
    out["per_category_speedup_vs_target_only"] = {
        c: table[c][method].get("speedup_vs_target_only") for c in cats if c != "all"}
    out["mean_acceptance_length"] = row.get("mean_acceptance_length")
    out["lossless"] = row["identical_to_target_only"] and row.get("lossless", True)
    if "exit_layer" in row:
        out["exit_layer"] = row["exit_layer"]
    for key in ("token_match_rate", "task_score"):
        if key in row:
            out[key] = row[key]
    return out


COLUMNS = [("tok/s", "tokens_per_s", "{:7.1f}"), ("x target", "speedup_vs_target_only", "{:8.2f}"),
           ("x f32", "speedup_vs_target_only_float32", "{:6.2f}"),
           ("x hf gen", "speedup_vs_hf_generate", "{:8.2f}"),
           ("x hf pld", "speedup_vs_hf_prompt_lookup", "{:8.2f}"),
           ("x ll pld", "speedup_vs_llamacpp_prompt_lookup", "{:8.2f}"),
           ("MAL", "mean_acceptance_length", "{:5.2f}"),
           ("tok/fwd", "tokens_per_forward", "{:7.2f}"),
           ("fwd ms/tok", "forward_ms_per_token", "{:10.1f}"),
           ("match", "token_match_rate", "{:5.2f}"), ("score", "task_score", "{:5.2f}"),
           ("same", "identical_to_target_only", "{!s:>5}")]


def print_tables(report: dict, methods: list[str]) -> None:
    width = max(22, *(len(m) + 1 for m in methods))
    for cat, rows in report["categories"].items():
        print(f"\n== {cat} ==")
        print(f"{'method':<{width}}" + " ".join(f"{h:>{len(fmt.format(0))}}"
                                                for h, _, fmt in COLUMNS))
        for m in methods:
            row = rows[m]
            cells = []
            for _, key, fmt in COLUMNS:
                w = len(fmt.format(0))
                cells.append(fmt.format(row[key]) if key in row else "-".rjust(w))
            print(f"{m:<{width}}" + " ".join(cells))
    warm = report.get("fleet_warm")
    if warm:
        print("\n== Cacheback, fleet table cold (device A) then warm (device B), same prompts ==")
        print(f"{'category':<16}{'cold MAL':>9}{'warm MAL':>9}{'cold tok/s':>11}"
              f"{'warm tok/s':>11}{'same':>6}")
        for cat, row in warm["categories"].items():
            identical = (row['cold']['identical_to_target_only']
                         and row['warm']['identical_to_target_only'])
            print(f"{cat:<16}{row['cold']['mean_acceptance_length']:9.2f}"
                  f"{row['warm']['mean_acceptance_length']:9.2f}"
                  f"{row['cold']['tokens_per_s']:11.1f}{row['warm']['tokens_per_s']:11.1f}"
                  f"{identical!s:>6}")
    levels = report.get("cascade_levels")
    if levels:
        print("\n== cascade levels (lower member's proposals checked by the upper) ==")
        for method, pairs in levels.items():
            for p in pairs:
                print(f"{method}: {p['lower']} -> {p['upper']}: proposed {p['proposed']}, "
                      f"accepted {p['accepted']} ({p['rate']:.2f}), filled {p['filled']}")
    summary = {k: v for k, v in report["summary"].items() if k != "drafters"}
    print("\nsummary:", json.dumps(summary))
