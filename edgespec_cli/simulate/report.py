"""Figures and JSON for ``edgespec simulate``, computed from the run records.

Definitions (all times in seconds in the JSON; the text table shows latencies in ms):

- A request *counts* when it has no ``error`` and at least one token; errored requests count no
  tokens, no latencies and no acceptance, only in ``errors``.
- ``system_tokens_per_s``: committed output tokens of all counting requests / (ended - started).
- Per device, ``share_tokens_per_s``: the device's tokens / the run's wall time (its share of
  the system throughput; the shares add up to it). ``decode_tokens_per_s``: the device's tokens /
  ``busy_s``, the time it had a request in flight (the union of [sent_at, done_at] over its
  counting requests, which is the sum of their durations when they do not overlap).
- TTFT: first token time - sent_at, one value per counting request.
- Inter-token latency (ITL): tokens with the same arrival time came in one piece. The first piece
  gives the TTFT and no ITL; a later piece of n tokens arriving g seconds after the previous piece
  gives n values of g/n, one per token.
- Percentiles are nearest-rank: the p-th percentile of n sorted values is the value at 1-based
  rank ceil(p/100 * n).
- Acceptance: accepted / drafted (summed over requests), and ``mean_acceptance_length`` averaged
  over requests weighted by their tokens; a run's counts every draft its steps verified, a
  device's (and its ``draft_tokens_wasted``) only its board's own, the verifier's draft head
  and fill drafts left out.
- ``samples``: how many values each latency percentile was taken over (TTFT: one per counting
  request; ITL: one per token after each request's first piece).
- Batch sizes: the verifier's histogram {sessions in a forward: forwards} (keys as strings, so the
  JSON round-trips), and its mean weighted by forwards.
- CPU (``cpu``): each side's cores and CPU seconds over the run (the server: verifier, cache and
  its Redis; the boards: every drafter), ``busy`` = CPU seconds / (wall time x cores), and
  ``bound_by``: the side whose cores were busier than ``BOUND_SHARE`` (the boards' first).
- Server cost: ``server_cpu_s_per_token`` (the server side's CPU seconds / committed tokens),
  ``tokens_per_forward`` (committed tokens / verification forwards); per device and in all,
  ``draft_tokens_sent`` (by its drafter) and ``draft_tokens_wasted`` (sent, never accepted).
- Per device, ``commit_to_draft``: the share of commits its board had drafted ahead of, and the
  mean milliseconds from a commit to the chunk that served the others (queued, drafting);
  ``drafts_slower_than_published``: for a profile with a published speed, the drafts this
  machine could not pace down to it (the board was emulated slower than it is).
- Against the baseline (``vs_server_only``, when a ``server-only`` run has the same device count
  as an edge-drafting run, batching on): throughput, ITL p50/p99, server CPU seconds per token
  and the one-token-a-row steps' forward at the same rows as edge drafting / server-only. With
  ``--repeat`` each run has its ``round``; runs are paired by round, each ratio is the median of
  the rounds' own, ``throughput_by_round`` lists the rounds' throughput ratios, and
  ``bound_by`` says in how many rounds a side bound the run where the rounds differ.
- ``short_runs``: the device counts with a ratio (on/off, or against the baseline) taken from
  a run of under ``SHORT_RUN_S`` seconds (such ratios moved by 0.1-0.2 between repeats of one
  setting on a shared machine); absent when none.

A figure that is undefined (no tokens, no drafts, zero wall time, no forwards) is None.

The printed report: ``edgespec_cli.simulate.report_text``; the charts drawn from these
figures: ``edgespec_cli.simulate.charts``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import Counter, defaultdict

from edgespec_cli.deployment.cpu_share import BOUND_SHARE, busy_share
from edgespec_cli.simulate.records import SERVER_ONLY, RequestRecord, RunRecord

PERCENTILE_METHOD = "nearest-rank"
# runs shorter than this give throughput ratios that moved by 0.1-0.2 between repeats of one
# setting on a shared 2-core machine (docs/measured/edge-vs-server): the report says so
SHORT_RUN_S = 30.0
SHORT_RUN_WHY = ("ratios from runs this short moved by 0.1-0.2 between repeats of one setting "
                 "on a shared machine")  # what a report says of them


def nearest_rank(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or not den:
        return None
    return num / den


def counts(req: RequestRecord) -> bool:
    return req.error is None and bool(req.tokens) and bool(req.token_times)


def ttft(req: RequestRecord) -> float:
    return req.token_times[0] - req.sent_at


def pieces(times: list[float]) -> list[tuple[float, int]]:
    """Consecutive equal arrival times grouped into (time, tokens in the piece)."""
    out: list[tuple[float, int]] = []
    for t in times:
        if out and out[-1][0] == t:
            out[-1] = (t, out[-1][1] + 1)
        else:
            out.append((t, 1))
    return out


def inter_token_latencies(req: RequestRecord) -> list[float]:
    groups = pieces(req.token_times)
    itls: list[float] = []
    for (prev_t, _), (t, n) in zip(groups, groups[1:]):
        itls.extend([(t - prev_t) / n] * n)
    return itls


def busy_time(reqs: list[RequestRecord]) -> float:
    """Length of the union of the requests' [sent_at, done_at] intervals (requests that
    received no token have none)."""
    total, end = 0.0, -math.inf
    for start, stop in sorted((r.sent_at, r.done_at) for r in reqs if r.done_at is not None):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def percentiles(values: list[float]) -> dict:
    return {"p50": nearest_rank(values, 50), "p99": nearest_rank(values, 99)}


def acceptance(reqs: list[RequestRecord], board: bool = False) -> dict:
    """Draft tokens verified and accepted over ``reqs``: every draft the steps verified, or
    (``board``) their boards' own, the verifier's head and fill drafts left out."""
    done = [r for r in reqs if counts(r)]
    drafted = sum(r.board_drafted if board else r.drafted for r in done)
    accepted = sum(r.board_accepted if board else r.accepted for r in done)
    tokens = sum(len(r.tokens) for r in done)
    weighted = sum(r.mean_acceptance_length * len(r.tokens) for r in done)
    return {"drafted": drafted, "accepted": accepted, "rate": ratio(accepted, drafted),
            "mean_acceptance_length": ratio(weighted, tokens)}


def batch_summary(batch_sizes: dict[int, int]) -> dict:
    hist = {str(size): n for size, n in sorted(batch_sizes.items(), key=lambda kv: int(kv[0]))}
    forwards = sum(batch_sizes.values())
    sessions = sum(int(size) * n for size, n in batch_sizes.items())
    return {"histogram": hist, "forwards": forwards, "mean": ratio(sessions, forwards)}


def summarize_device(device_id: str, reqs: list[RequestRecord], wall: float,
                     board: dict | None = None) -> dict:
    done = [r for r in reqs if counts(r)]
    tokens = sum(len(r.tokens) for r in done)
    busy = busy_time(done)
    acc = acceptance(reqs, board=True)  # the board's own drafts: its sent tokens' fate
    sent = board.get("tokens_sent") if board else None
    return {"device_id": device_id, "profile": reqs[0].profile, "requests": len(reqs),
            "draft_tokens_sent": sent,
            "draft_tokens_wasted": None if sent is None else max(0, sent - acc["accepted"]),
            "draft_tokens_kept_across_fixes": board.get("tokens_kept") if board else None,
            "commit_to_draft": commit_to_draft(board),
            # proposals this machine drafted slower than the profile's published speed (the
            # board was emulated slower than it is)
            "drafts_slower_than_published": board.get("slower_than_published") if board
            else None,
            "errors": sum(r.error is not None for r in reqs), "tokens": tokens,
            "share_tokens_per_s": ratio(tokens, wall), "busy_s": busy,
            "decode_tokens_per_s": ratio(tokens, busy),
            "drafted": acc["drafted"], "accepted": acc["accepted"],
            "acceptance_rate": acc["rate"],
            "mean_acceptance_length": acc["mean_acceptance_length"]}


def commit_to_draft(board: dict | None) -> dict | None:
    """A board's time from a commit to the session's next usable draft, from its drafting
    loop's counts (``LoopCounts``): the share of commits it had drafted ahead of, and the mean
    milliseconds to the chunk that served the others, in all, queued and drafting."""
    if not board or not board.get("commits_seen"):
        return None
    served = board.get("commits_served", 0)

    def ms(key: str) -> float | None:
        return 1000 * board.get(key, 0.0) / served if served else None

    return {"commits": board["commits_seen"],
            "ahead_share": board.get("commits_ahead", 0) / board["commits_seen"],
            "served": served, "total_ms": ms("served_s"), "queued_ms": ms("queued_s"),
            "drafting_ms": ms("drafting_s")}


def step_split(totals: dict) -> dict | None:
    """Mean milliseconds per verifier step waiting for drafts, in the forward, committing; the
    steps, and those whose drafters rested (drafting measured slower than resting); and the
    steps of one token a row (``plain``: rested, nothing drafted, or the server alone's): how
    many, their mean rows, their forward's milliseconds a row and by rows, what compares a
    fleet's plain steps with the server alone's like for like (``plain_step_ratio``)."""
    steps = totals.get("steps", 0) if totals else 0
    if not steps:
        return None
    out = {"steps": steps, "rested": totals.get("rested", 0),
           **{k.replace("_s", ""): 1000 * totals[k] / steps
              for k in ("wait_s", "forward_s", "commit_s")}}
    by_rows = {int(n): v for n, v in (totals.get("plain_by_rows") or {}).items() if v[0]}
    if by_rows:
        plain = sum(v[0] for v in by_rows.values())
        rows = sum(n * v[0] for n, v in by_rows.items())
        out["plain"] = {"steps": plain, "rows_mean": rows / plain,
                        "forward_ms_a_row": 1000 * sum(v[1] for v in by_rows.values()) / rows,
                        "forward_ms_by_rows": {str(n): 1000 * v[1] / v[0]
                                               for n, v in sorted(by_rows.items())},
                        "steps_by_rows": {str(n): v[0] for n, v in sorted(by_rows.items())}}
    return out


def plain_step_ratio(edge: dict | None, base: dict | None) -> float | None:
    """A fleet's one-token-a-row steps' forward time over the server alone's at the same rows:
    the fleet's steps counted at each batch size both ran, each priced both ways."""
    e, b = ((s or {}).get("plain") or {} for s in (edge, base))
    both = set(e.get("forward_ms_by_rows", {})) & set(b.get("forward_ms_by_rows", {}))
    if not both:
        return None
    steps = e["steps_by_rows"]
    return ratio(sum(steps[n] * e["forward_ms_by_rows"][n] for n in both),
                 sum(steps[n] * b["forward_ms_by_rows"][n] for n in both))


def cpu_summary(cpu: dict, wall: float) -> dict | None:
    """Each side's cores, CPU seconds and busy share, and the side that bound the run."""
    if not cpu:
        return None
    out: dict = {"split": cpu.get("split")}
    for side in ("server", "boards"):
        c = cpu.get(side) or {}
        out[side] = {"cpus": c.get("cpus"), "cpu_s": c.get("cpu_s"),
                     "busy": busy_share(c.get("cpu_s"), wall, c.get("cpus") or 0)}
    for part in ("verifier_cpu_s", "cache_cpu_s"):  # the server's cores, by who used them
        out["server"][part] = (cpu.get("server") or {}).get(part)
    out["bound_by"] = next((f"the {who} cores" for side, who in
                            (("boards", "boards'"), ("server", "server's"))
                            if (out[side]["busy"] or 0) >= BOUND_SHARE), None)
    return out


def summarize_run(run: RunRecord) -> dict:
    wall = max(run.ended - run.started, 0.0)
    done = [r for r in run.requests if counts(r)]
    tokens = sum(len(r.tokens) for r in done)
    ttfts = [ttft(r) for r in done]
    itls = [x for r in done for x in inter_token_latencies(r)]
    by_device: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in run.requests:
        by_device[r.device_id].append(r)
    cpu = cpu_summary(run.cpu, wall)
    per_device = [summarize_device(d, reqs, wall, run.boards.get(d))
                  for d, reqs in sorted(by_device.items())]
    sent = [d["draft_tokens_sent"] for d in per_device if d["draft_tokens_sent"] is not None]
    batches = batch_summary(run.batch_sizes)
    return {
        "batching": run.batching, "devices": run.devices, "max_sessions": run.max_sessions,
        "round": run.round, "rounds": run.rounds,
        "wall_s": wall, "requests": len(run.requests), "completed": len(done),
        "errors": sum(r.error is not None for r in run.requests), "tokens": tokens,
        "error_samples": sorted({r.error for r in run.requests if r.error})[:5],
        "system_tokens_per_s": ratio(tokens, wall),
        "ttft_s": percentiles(ttfts),
        "itl_s": percentiles(itls),
        "samples": {"ttft": len(ttfts), "itl": len(itls)},
        "acceptance": acceptance(run.requests),
        "batch_sizes": batches,
        "step_ms": step_split(run.step_totals),
        "link_faults": list(run.link_faults),
        "cpu": cpu,
        "server_cpu_s_per_token": ratio(cpu["server"]["cpu_s"], tokens) if cpu else None,
        "tokens_per_forward": ratio(tokens, batches["forwards"]),
        "draft_tokens_sent": sum(sent) if sent else None,
        "draft_tokens_wasted": sum(d["draft_tokens_wasted"] for d in per_device
                                   if d["draft_tokens_wasted"] is not None) if sent else None,
        "per_device": per_device,
    }


def paired_runs(summaries: list[dict], mode: str, against: str) -> dict[int, list[tuple]]:
    """Per device count, its runs of ``mode`` and ``against`` paired by round (--repeat)."""
    def runs_of(m: str) -> dict[tuple[int, int], dict]:
        out: dict[tuple[int, int], dict] = {}
        for s in summaries:
            if s["batching"] == m:
                out.setdefault((s["devices"], s.get("round", 1)), s)
        return out

    a, b = runs_of(mode), runs_of(against)
    pairs: dict[int, list[tuple]] = defaultdict(list)
    for key in sorted(set(a) & set(b)):
        pairs[key[0]].append((a[key], b[key]))
    return dict(pairs)


def median_of(values) -> float | None:
    """The median of the values that are not None (None if none is)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def throughput_ratios(summaries: list[dict]) -> dict[int, float | None]:
    """on/off system throughput per device count run in both modes (the median of the
    rounds' own ratios with --repeat)."""
    return {n: median_of(ratio(e["system_tokens_per_s"], b["system_tokens_per_s"])
                         for e, b in pairs)
            for n, pairs in sorted(paired_runs(summaries, "on", "off").items())}


def baseline_ratios(summaries: list[dict]) -> dict[int, dict[str, object]]:
    """Per device count run both with boards (batching on) and server-only: edge drafting's
    figures over the baseline's; with --repeat, each the median of the rounds' own ratios, and
    the rounds' throughput ratios in ``throughput_by_round``."""
    out = {}
    for n, pairs in sorted(paired_runs(summaries, "on", SERVER_ONLY).items()):
        rounds = [{"throughput": ratio(e["system_tokens_per_s"], b["system_tokens_per_s"]),
                   "itl_p50": ratio(e["itl_s"]["p50"], b["itl_s"]["p50"]),
                   "itl_p99": ratio(e["itl_s"]["p99"], b["itl_s"]["p99"]),
                   "server_cpu_s_per_token": ratio(e["server_cpu_s_per_token"],
                                                   b["server_cpu_s_per_token"]),
                   "plain_step": plain_step_ratio(e.get("step_ms"), b.get("step_ms"))}
                  for e, b in pairs]
        figures: dict[str, object] = {k: median_of(r[k] for r in rounds) for k in rounds[0]}
        figures["bound_by"] = bound_in_rounds([(e.get("cpu") or {}).get("bound_by")
                                               for e, _ in pairs])
        if len(rounds) > 1:
            figures["throughput_by_round"] = [r["throughput"] for r in rounds]
        out[n] = figures
    return out


def bound_in_rounds(bounds: list[str | None]) -> str | None:
    """What bound the edge runs of a device count's rounds: the side, when every round says
    the same (None: none did); else each side with the rounds it bound, "X in k of N rounds"."""
    if len(set(bounds)) == 1:
        return bounds[0]
    counted = Counter(b for b in bounds if b)
    return "; ".join(f"{b} in {k} of {len(bounds)} rounds" for b, k in sorted(counted.items()))


def build_report(runs: list[RunRecord], *, lossless: dict | None, emulated: dict,
                 real: list[str], config: dict) -> dict:
    """The JSON document. ``throughput_ratio`` (at the largest device count run in both modes)
    and ``throughput_ratio_by_devices`` are present only when such a pair exists; ``lossless``
    only when given."""
    summaries = [summarize_run(r) for r in runs]
    report: dict = {"config": config, "percentile_method": PERCENTILE_METHOD,
                    "real": list(real), "emulated": emulated, "runs": summaries}
    ratios = throughput_ratios(summaries)
    if ratios:
        report["throughput_ratio"] = ratios[max(ratios)]
        report["throughput_ratio_by_devices"] = {str(n): r for n, r in ratios.items()}
    vs_base = baseline_ratios(summaries)
    if vs_base:
        report["vs_server_only"] = {str(n): r for n, r in vs_base.items()}
    compared = set(ratios) | set(vs_base)
    short = sorted({s["devices"] for s in summaries
                    if s["devices"] in compared and (s["wall_s"] or 0.0) < SHORT_RUN_S})
    if short:
        report["short_runs"] = {"under_s": SHORT_RUN_S, "devices": short}
    if lossless is not None:
        report["lossless"] = lossless
    return report


def add_capacity(report: dict, capacity: dict[str, int], slo: float,
                 probes: list[dict]) -> dict:
    """Capacity: the most devices each mode (``capacity``: mode -> devices) serves with every
    device at or above ``slo`` tokens/s; ``probes`` are the orchestrator's trials, kept as
    given. ``capacity_ratio``: on / off; ``capacity_ratio_vs_server_only``: on / server-only
    (each when both were searched)."""
    report["capacity"] = {"slo_tokens_per_s": slo, **capacity, "probes": probes}
    if "on" in capacity and "off" in capacity:
        report["capacity_ratio"] = ratio(capacity["on"], capacity["off"])
    if "on" in capacity and SERVER_ONLY in capacity:
        report["capacity_ratio_vs_server_only"] = ratio(capacity["on"], capacity[SERVER_ONLY])
    return report


def write_json(report: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    return path
