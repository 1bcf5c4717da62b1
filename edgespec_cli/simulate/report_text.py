"""``edgespec simulate``'s printed report: each run's block, the CPU split, the ratios against
batching off and against the server alone, capacity; from the figures ``report`` computes."""

from __future__ import annotations

import json

from edgespec_cli.deployment.cpu_share import BOUND_SHARE
from edgespec_cli.simulate.records import SERVER_ONLY, mode_name
from edgespec_cli.simulate.report import SHORT_RUN_WHY


def commit_to_draft_line(c: dict) -> str:
    """``commit_to_draft``'s figures, as the reports print them."""
    return (f"commit -> usable draft: drafted ahead of {fmt(100 * c['ahead_share'], digits=0)}% "
            f"of {c['commits']:.0f} commits; the others in {fmt(c['total_ms'], digits=1)} ms "
            f"(queued {fmt(c['queued_ms'], digits=1)}, drafting "
            f"{fmt(c['drafting_ms'], digits=1)})")


def step_line(split: dict | None) -> str:
    if not split:
        return "-"
    plain = split.get("plain")
    return (f"wait {split['wait']:.1f}  forward {split['forward']:.1f}  "
            f"commit {split['commit']:.1f}  ({split['steps']} steps"
            + (f", {split['rested']} rested" if split.get("rested") else "") + ")"
            + (f"; one token a row: {plain['steps']} steps, forward "
               f"{plain['forward_ms_a_row']:.1f} a row ({plain['rows_mean']:.1f} rows)"
               if plain else ""))


def _capacity_ratio(report: dict, key: str, against: str, who: str) -> str:
    """A capacity ratio as the table says it, or why there is none (``who``, the mode compared
    with, met the SLO at no device count tried)."""
    value = report[key]
    if value is None:
        return f"on/{against}: none ({who} met the SLO at no device count tried)"
    return f"on/{against} {fmt(value, digits=2)}x"


def fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def run_block(s: dict) -> list[str]:
    ms = 1000.0
    hist = " ".join(f"{k}:{v}" for k, v in s["batch_sizes"]["histogram"].items()) or "-"
    lines = [
        f"== {mode_name(s['batching'])}, {s['devices']} device(s)"
        + (f", round {s['round']} of {s['rounds']}" if s.get("rounds", 1) > 1 else "")
        + f": {s['requests']} requests, "
        f"{s['tokens']} tokens, {s['errors']} errors, {fmt(s['wall_s'], digits=2)} s",
        f"  system tokens/s  {fmt(s['system_tokens_per_s'], digits=2)}",
        f"  TTFT ms          p50 {fmt(s['ttft_s']['p50'], ms)}  p99 {fmt(s['ttft_s']['p99'], ms)}",
        f"  ITL ms           p50 {fmt(s['itl_s']['p50'], ms)}  p99 {fmt(s['itl_s']['p99'], ms)}",
        f"  batch sizes      {hist}  (mean {fmt(s['batch_sizes']['mean'], digits=2)})",
        *(f"  link fault       {f['fault']} on {f['links']} of "
          f"{'every device' if f['device'] is None else 'device ' + str(f['device'])} at "
          f"{f['at_s']:.1f} s" + (f", healed at {f['healed_at_s']:.1f} s"
                                  if f.get('healed_at_s') is not None else "")
          for f in s.get("link_faults", [])),
        f"  step ms          {step_line(s.get('step_ms'))}",
        f"  server cost      {fmt(s.get('server_cpu_s_per_token'), ms)} CPU ms a token, "
        f"{fmt(s.get('tokens_per_forward'), digits=2)} tokens a forward"
        + (f", draft tokens sent {s['draft_tokens_sent']}, wasted {s['draft_tokens_wasted']}"
           if s.get("draft_tokens_sent") is not None else ""),
        *cpu_lines(s.get("cpu")),
        # b.accept: the board's own draft tokens accepted / verified; tok/step: its sessions'
        # tokens a verification step, every draft's (the verifier's fill drafts too)
        f"  {'device':<16} {'profile':<12} {'share/s':>8} {'decode/s':>9} {'b.accept':>8} "
        f"{'tok/step':>8} {'sent':>6} {'wasted':>6} {'errors':>6}",
    ]
    for d in s["per_device"]:
        lines.append(
            f"  {d['device_id']:<16} {d['profile']:<12} "
            f"{fmt(d['share_tokens_per_s'], digits=2):>8} "
            f"{fmt(d['decode_tokens_per_s'], digits=2):>9} "
            f"{fmt(d['acceptance_rate'], digits=3):>8} "
            f"{fmt(d['mean_acceptance_length'], digits=2):>8} "
            f"{_count(d.get('draft_tokens_sent')):>6} {_count(d.get('draft_tokens_wasted')):>6} "
            f"{d['errors']:>6}")
    for d in s["per_device"]:
        c = d.get("commit_to_draft")
        if c:
            lines.append(f"  {d['device_id']}: {commit_to_draft_line(c)}")
        if d.get("drafts_slower_than_published"):
            lines.append(f"  {d['device_id']}: {d['drafts_slower_than_published']} drafts were "
                         f"slower here than the profile's published speed: that board was "
                         f"emulated slower than it is")
    return lines


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def cpu_lines(cpu: dict | None) -> list[str]:
    """Each side's cores and how busy they were, and which side bound the run."""
    if not cpu:
        return []

    def side(c: dict) -> str:
        cores = "shared cores" if c["cpus"] is None else f"{c['cpus']} core(s)"
        return f"{fmt(c['cpu_s'], digits=1)} CPU s on {cores}" + (
            f", {fmt(c['busy'], 100, 0)}% busy" if c["busy"] is not None else "")

    server = cpu["server"]
    parts = ""
    if server.get("verifier_cpu_s") is not None and server.get("cache_cpu_s") is not None:
        parts = (f" (verifier {fmt(server['verifier_cpu_s'], digits=1)}, cache and its Redis "
                 f"{fmt(server['cache_cpu_s'], digits=1)})")
    lines = [f"  cpu              server {side(server)}{parts}; boards {side(cpu['boards'])}"]
    if cpu.get("bound_by"):
        lines.append(f"  BOUND BY         {cpu['bound_by']} (busier than "
                     f"{BOUND_SHARE:.0%} of their time)")
    return lines


def ratio_lines(report: dict) -> list[str]:
    lines = []
    if "throughput_ratio" in report:
        by = ", ".join(f"{n} dev: {fmt(r, digits=2)}x"
                       for n, r in report["throughput_ratio_by_devices"].items())
        lines.append(f"throughput on/off: {fmt(report['throughput_ratio'], digits=2)}x ({by})")
    for n, r in (report.get("vs_server_only") or {}).items():
        bound = f"; bound by {r['bound_by']}" if r.get("bound_by") else ""
        lines.append(f"edge drafting / server-only, {n} dev: throughput "
                     f"{fmt(r['throughput'], digits=2)}x, ITL p50 {fmt(r['itl_p50'], digits=2)}x "
                     f"p99 {fmt(r['itl_p99'], digits=2)}x, server CPU a token "
                     f"{fmt(r['server_cpu_s_per_token'], digits=2)}x"
                     + (f", one-token steps' forward {fmt(r['plain_step'], digits=2)}x"
                        if r.get("plain_step") is not None else "") + bound
                     + (f" (medians of {len(r['throughput_by_round'])} rounds; throughput by "
                        "round " + ", ".join(f"{fmt(x, digits=2)}x"
                                             for x in r["throughput_by_round"]) + ")"
                        if r.get("throughput_by_round") else ""))
    if report.get("short_runs"):
        short = report["short_runs"]
        lines.append(f"note: at {', '.join(map(str, short['devices']))} device(s) a run took "
                     f"under {short['under_s']:.0f} s: {SHORT_RUN_WHY}; more --requests (or "
                     f"--duration) for steadier figures")
    if "capacity" in report:
        cap = report["capacity"]
        found = ", ".join(f"{m} {cap[m]}" for m in ("on", "off", SERVER_ONLY) if m in cap)
        ratios = [_capacity_ratio(report, "capacity_ratio", "off", "batching off")
                  if "capacity_ratio" in report else "",
                  _capacity_ratio(report, "capacity_ratio_vs_server_only", "server-only",
                                  "the server alone")
                  if "capacity_ratio_vs_server_only" in report else ""]
        lines.append(f"capacity at {cap['slo_tokens_per_s']} tokens/s per device: {found}"
                     + (f"; ratio {', '.join(r for r in ratios if r)}" if any(ratios) else ""))
    if "lossless" in report:
        lines.append(f"lossless: {json.dumps(report['lossless'], sort_keys=True)}")
    return lines


def format_table(report: dict) -> str:
    lines: list[str] = []
    for s in report["runs"]:
        lines.extend(run_block(s))
        lines.append("")
    lines.extend(ratio_lines(report))
    return "\n".join(lines).rstrip() + "\n"
