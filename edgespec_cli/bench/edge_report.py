"""What ``edgespec bench-edge`` reports: each board's figures and the server's from both sides'
``/metrics`` (scraped before and after a run), a fleet setting's two runs compared (server-only
against edge drafting), and the printed table and the chart."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from ..deployment.cpu_share import BOUND_SHARE, busy_share
from ..simulate.report import (SHORT_RUN_S, SHORT_RUN_WHY, commit_to_draft,
                               inter_token_latencies, nearest_rank, ratio)
from ..simulate.report_text import commit_to_draft_line, fmt


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics endpoint: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def delta(after: dict, before: dict, name: str, /, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def refused_chunks(after: dict, before: dict) -> dict[str, float]:
    """The draft chunks the cache refused between two scrapes, by gRPC status code name."""
    out: dict[str, float] = {}
    for (name, labels), value in after.items():
        tags = dict(labels)
        if name == "edgespec:cache_chunks_total" and tags.get("result") == "refused":
            got = value - before.get((name, labels), 0.0)
            if got:
                out[tags.get("code", "")] = got
    return out


def plot_report(report: dict, path: str) -> str:
    """Two panels: tokens/s and ITL p99 per setting, server-only against edge drafting, each
    bar labelled with its value; the settings and the drafter in the caption."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleets = report["fleets"]
    names = [f"{f['sessions']} session{'s' * (f['sessions'] > 1)}\n{f['boards']} "
             f"board{'s' * (f['boards'] > 1)}" for f in fleets]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, key, label in ((axes[0], "tokens_per_s", "system tokens/s"),
                           (axes[1], "itl_p99_ms", "ITL p99 (ms)")):
        for i, (side, color) in enumerate((("server_only", "tab:green"), ("edge", "tab:blue"))):
            ys = [f[side][key] or 0.0 for f in fleets]
            bars = ax.bar([x + (i - 0.5) * 0.4 for x in range(len(fleets))], ys, 0.4,
                          color=color, label="server only" if side == "server_only"
                          else f"edge drafting ({report['config']['drafter']})")
            ax.bar_label(bars, labels=[f"{y:.3g}" for y in ys], fontsize=7, padding=2)
        ax.set_xticks(range(len(fleets)), names, fontsize=8)
        ax.set_ylabel(label)
        ax.margins(y=0.15)
        ax.legend(fontsize=7)
    c = report["config"]
    fig.text(0.01, 0.01, f"{c['split']}; model {c['model']}; {c['questions']} Spec-Bench "
             f"questions, {c['max_new_tokens']} new tokens; same requests both ways",
             fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def board_figures(dev: str, before: dict, after: dict, b_before: dict, b_after: dict,
                  cpu_s: float | None, wall: float) -> dict:
    steps = delta(after, before, "edgespec:drafter_session_steps_total", device=dev)
    ready = delta(after, before, "edgespec:drafter_ready_drafts_total", device=dev)
    verified = delta(after, before, "edgespec:drafter_verified_drafts_total", device=dev)
    empty = {a: delta(after, before, "edgespec:drafter_empty_drafts_total", device=dev, after=a)
             for a in ("opening", "fix", "again", "other")}
    waited = delta(after, before, "edgespec:drafter_waited_seconds_total", device=dev)
    accepted = delta(after, before, "edgespec:device_accepted_tokens_total", device=dev)
    fill = {"tokens": delta(after, before, "edgespec:fill_draft_tokens_total", device=dev),
            "accepted": delta(after, before, "edgespec:fill_accepted_tokens_total", device=dev)}
    board: dict = {k: delta(b_after, b_before, f"edgespec:drafter_{k}_total")
                   for k in ("chunks_sent", "draft_tokens", "chunks_drafted", "tokens_drafted",
                             "chunks_resent", "tokens_kept", "tokens_discarded",
                             "fixes_received")}
    board["chunks_dropped"] = {r: delta(b_after, b_before, "edgespec:drafter_chunks_dropped_total",
                                        reason=r) for r in ("disagreed", "closed", "failed")}
    board["commit_to_draft"] = _commit_to_draft(b_before, b_after)
    return {"device": dev, "session_steps": steps,
            "ready_share": ready / steps if steps else None,
            "verified_share": verified / steps if steps else None,
            "empty_drafts": empty,  # session steps asked, given none, by what came before
            "fill": fill,  # the verifier's own drafts for those (--fill-drafts)
            "waited_s": waited, "accepted_tokens": accepted, "cpu_s": cpu_s, **board,
            "wasted_tokens": max(0.0, board["draft_tokens"] - accepted)}


def _commit_to_draft(b_before: dict, b_after: dict) -> dict | None:
    """A board's time from a commit to the session's next usable draft, from its /metrics
    (``drafter_node/metrics.py``): simulate's ``commit_to_draft`` figures, and the mean round
    trip of a chunk to the cache; None when the board saw no commit."""
    def d(name: str, **labels) -> float:
        return delta(b_after, b_before, f"edgespec:drafter_{name}", **labels)

    out = commit_to_draft({  # the drafting loop's counts (``LoopCounts``), as the board sent them
        "commits_seen": d("commits_seen_total"), "commits_ahead": d("commits_ahead_total"),
        "commits_served": d("commits_served_total"),
        **{f"{stage}_s": d("commit_to_draft_seconds_total", stage=label)
           for stage, label in (("served", "total"), ("queued", "queued"),
                                ("drafting", "drafting"))}})
    if out is not None:
        acks = d("link_rtt_seconds_count")
        out["link_rtt_ms"] = 1000 * d("link_rtt_seconds_sum") / acks if acks else None
    return out


def _trimmed(counts: list[float]) -> list[int]:
    """Counts by position, without the trailing zeros."""
    out = [int(c) for c in counts]
    while out and not out[-1]:
        out.pop()
    return out


def compare_runs(sessions: int, boards: int, alone: dict, edge: dict, split) -> dict:
    def figures(run: dict) -> dict:
        recs = run["records"]
        tokens = sum(len(r.tokens) for r in recs)
        itl = [x for r in recs for x in inter_token_latencies(r)]
        return {"tokens": tokens, "wall_s": run["wall_s"],
                "tokens_per_s": tokens / run["wall_s"] if run["wall_s"] else None,
                "itl_p50_ms": _ms(nearest_rank(itl, 50)), "itl_p99_ms": _ms(nearest_rank(itl, 99)),
                "server_cpu_ms_per_token": None if not tokens or run["server_cpu_s"] is None
                else 1000 * run["server_cpu_s"] / tokens,
                "tokens_per_forward": tokens / run["forwards"] if run["forwards"] else None,
                # the boards' own drafts (a --fill-drafts fill's left out): their acceptance
                "drafted": sum(r.board_drafted for r in recs),
                "accepted": sum(r.board_accepted for r in recs),
                "steps": run["forwards"], "step_ms": run["step_ms"],
                "chunks_refused": run["chunks_refused"],
                "drafted_per_pos": _trimmed(run["drafted_per_pos"]),
                "accepted_per_pos": _trimmed(run["accepted_per_pos"])}

    a, e = figures(alone), figures(edge)
    board_cpu = [b["cpu_s"] for b in edge["boards"]]
    busy = None if None in board_cpu else busy_share(sum(board_cpu), edge["wall_s"],
                                                       len(split.boards))
    return {"sessions": sessions, "boards": boards, "server_only": a, "edge": e,
            "throughput_ratio": ratio(e["tokens_per_s"], a["tokens_per_s"]),
            "server_cpu_per_token_ratio": ratio(e["server_cpu_ms_per_token"],
                                                 a["server_cpu_ms_per_token"]),
            "boards_busy": busy,
            "bound_by_boards": busy is not None and busy >= BOUND_SHARE,
            "per_board": edge["boards"],
            "identical": [r.tokens for r in alone["records"]] ==
            [r.tokens for r in edge["records"]]}


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000 * x


def format_table(report: dict) -> str:
    lines = [f"{'fleet':<7} {'alone tok/s':>11} {'edge tok/s':>10} {'ratio':>6} "
             f"{'ITL p99 ms':>14} {'server ms/tok':>14} {'tok/fwd':>9} {'same':>5}"]
    for f in report["fleets"]:
        a, e = f["server_only"], f["edge"]
        lines.append(
            f"{f['sessions']}x{f['boards']:<5} {fmt(a['tokens_per_s']):>11} "
            f"{fmt(e['tokens_per_s']):>10} {fmt(f['throughput_ratio'], digits=2):>6} "
            f"{fmt(a['itl_p99_ms'], digits=0):>6}/{fmt(e['itl_p99_ms'], digits=0):<7} "
            f"{fmt(a['server_cpu_ms_per_token']):>6}/{fmt(e['server_cpu_ms_per_token']):<7} "
            f"{fmt(a['tokens_per_forward'], digits=2):>4}/"
            f"{fmt(e['tokens_per_forward'], digits=2):<4} "
            f"{f['identical']!s:>5}")
    lines.append("(ITL, server CPU and tokens a forward: server-only / edge drafting)")
    short = [f"{f['sessions']}x{f['boards']}" for f in report["fleets"]
             if min(f["server_only"]["wall_s"], f["edge"]["wall_s"]) < SHORT_RUN_S]
    if short:
        lines.append(f"note: {', '.join(short)} had a run of under {SHORT_RUN_S:.0f} s: "
                     f"{SHORT_RUN_WHY}; more --per-category or --max-new-tokens for steadier "
                     f"figures")
    for f in report["fleets"]:
        for name, side in (("server-only", f["server_only"]), ("edge", f["edge"])):
            ms = side["step_ms"]
            refused = side.get("chunks_refused") or {}
            lines.append(f"  {f['sessions']}x{f['boards']} {name:<11} ms a step: wait "
                         f"{fmt(ms['wait'])}, forward {fmt(ms['forward'])}, commit "
                         f"{fmt(ms['commit'])} ({side['steps']:.0f} steps)"
                         + ("; chunks the cache refused: " + ", ".join(
                             f"{n:.0f} {code}" for code, n in sorted(refused.items()))
                            if refused else ""))
    for f in report["fleets"]:
        for b in f["per_board"]:
            lines.append(
                f"  {f['sessions']}x{f['boards']} {b['device']}: of {b['session_steps']:.0f} "
                f"session steps, the whole draft in when taken in "
                f"{fmt(b['ready_share'], 100, 0)}%, "
                f"a draft verified (waited for, or in part) in "
                f"{fmt(b['verified_share'], 100, 0)}"
                f"%; chunks sent "
                f"{b['chunks_sent']:.0f} (resent {b['chunks_resent']:.0f}), tokens kept "
                f"across fixes {b['tokens_kept']:.0f}, discarded {b['tokens_discarded']:.0f}; "
                f"draft tokens sent {b['draft_tokens']:.0f}, accepted "
                f"{b.get('accepted_tokens', 0):.0f}, wasted {b.get('wasted_tokens', 0):.0f}; "
                f"steps waited for it {b.get('waited_s', 0):.1f} s")
            e = b.get("empty_drafts")
            if e and sum(e.values()):
                lines.append(f"    asked for a draft and given none: {sum(e.values()):.0f} "
                             f"session steps: at the session's opening {e['opening']:.0f}, "
                             f"after a fix {e['fix']:.0f}, again (the step before had none) "
                             f"{e.get('again', 0):.0f}, otherwise {e['other']:.0f}")
            fill = b.get("fill")
            if fill and fill["tokens"]:
                lines.append(f"    the verifier's own drafts for its empty ones (--fill-drafts): "
                             f"{fill['tokens']:.0f} tokens, {fill['accepted']:.0f} accepted")
            c = b.get("commit_to_draft")
            if c:
                lines.append(f"    {commit_to_draft_line(c)}, then the chunk's round trip to "
                             f"the cache {fmt(c['link_rtt_ms'])} ms")
        if f["bound_by_boards"]:
            lines.append(f"  {f['sessions']}x{f['boards']}: BOUND BY the boards' cores "
                         f"({fmt(f['boards_busy'], 100, 0)}% busy)")
    return "\n".join(lines)
