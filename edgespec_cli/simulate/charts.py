"""Charts of ``edgespec simulate``'s report (``--plot DIR``), drawn with matplotlib from the run
records or the report's JSON (``edgespec_cli.simulate.report``).

Every point and bar is labelled with its value, every series with the samples behind it
(requests, ITL values, drafted tokens), and a caption under each chart gives the run's settings
as far as the report has them (model, dtype, profiles, device counts, drafters, requests, ...).
Throughput and p99 inter-token latency are drawn against device count, one line per mode:
batching on, off, and the server alone (``--baseline server-only``).
"""

from __future__ import annotations

import os
import statistics

from edgespec_cli.simulate.records import SERVER_ONLY, RunRecord, mode_name
from edgespec_cli.simulate.report import summarize_run
from edgespec_cli.simulate.report_text import fmt

PLOT_NAMES = ("throughput_vs_devices.png", "itl_p99_vs_devices.png", "batching_on_vs_off.png",
              "acceptance_per_device.png")
MODE_COLORS = {"on": "tab:blue", "off": "tab:orange", SERVER_ONLY: "tab:green"}


def as_summaries(runs_or_report: list[RunRecord] | dict) -> list[dict]:
    if isinstance(runs_or_report, dict):
        return runs_or_report["runs"]
    return [summarize_run(r) for r in runs_or_report]


def series(summaries: list[dict], mode: str, value) -> tuple[list[int], list[float]]:
    """A mode's values over device counts: a count run more than once (--repeat) at the
    median of its runs."""
    by_count: dict[int, list[float]] = {}
    for s in summaries:
        if s["batching"] == mode and value(s) is not None:
            by_count.setdefault(s["devices"], []).append(value(s))
    xs = sorted(by_count)
    return xs, [statistics.median(by_count[n]) for n in xs]


def modes(summaries: list[dict]) -> list[str]:
    present = {s["batching"] for s in summaries}
    known = ("on", "off", SERVER_ONLY)
    return [m for m in known if m in present] + sorted(present - set(known))


def series_count(summaries: list[dict], mode: str, value, count) -> int:
    """The samples behind a series: ``count(s)`` summed over its runs that have a value."""
    return sum(count(s) or 0 for s in summaries if s["batching"] == mode and value(s) is not None)


def value_label(value: float) -> str:
    return f"{value:.3g}"


def line_plot(plt, summaries: list[dict], value, ylabel: str, title: str, count,
              count_name: str):
    """One line per batching mode over device counts, each point labelled with its value and
    each series with its sample count (``count(summary)``, in ``count_name``)."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for mode in modes(summaries):
        xs, ys = series(summaries, mode, value)
        n = series_count(summaries, mode, value, count)
        ax.plot(xs, ys, marker="o", color=MODE_COLORS.get(mode),
                label=f"{mode_name(mode)} (n={n} {count_name})")
        for x, y in zip(xs, ys):
            ax.annotate(value_label(y), (x, y), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=7)
    ax.set_xticks(sorted({s["devices"] for s in summaries}))
    ax.set_ylim(bottom=0)
    ax.margins(y=0.15)  # room for the labels above the highest point
    ax.set_xlabel("devices")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if summaries:
        ax.legend()
    return fig


def on_off_bars(plt, summaries: list[dict]):
    device_counts = sorted({s["devices"] for s in summaries})
    fig, ax = plt.subplots(figsize=(6, 4.5))
    width = 0.4
    throughput = lambda s: s["system_tokens_per_s"]  # noqa: E731
    for i, mode in enumerate(("on", "off")):
        xs, ys = series(summaries, mode, throughput)
        n = series_count(summaries, mode, throughput, lambda s: s["completed"])
        pos = [device_counts.index(x) + (i - 0.5) * width for x in xs]
        bars = ax.bar(pos, ys, width, label=f"batching {mode} (n={n} requests)",
                      color=MODE_COLORS[mode])
        ax.bar_label(bars, labels=[value_label(y) for y in ys], fontsize=7, padding=2)
    ax.set_xticks(range(len(device_counts)), [str(n) for n in device_counts])
    ax.margins(y=0.15)
    ax.set_xlabel("devices")
    ax.set_ylabel("system tokens/s")
    ax.set_title("batched vs one session per forward")
    ax.legend()
    return fig


def acceptance_bars(plt, summaries: list[dict]):
    """Per device of the largest run (batching on if any): its acceptance rate, labelled with
    the rate and the drafted tokens it is taken over."""
    on = [s for s in summaries if s["batching"] == "on"] or summaries
    run = max(on, key=lambda s: s["devices"], default=None)
    devices = run["per_device"] if run else []
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(devices)), 4.5))
    bars = ax.bar(range(len(devices)), [d["acceptance_rate"] or 0.0 for d in devices])
    ax.bar_label(bars, labels=[f"{fmt(d['acceptance_rate'], digits=2)}\nn={d['drafted']}"
                               for d in devices], fontsize=7, padding=2)
    ax.set_xticks(range(len(devices)), [d["device_id"] for d in devices], rotation=45,
                  ha="right")
    ax.set_ylim(0, 1.2)  # the labels of a rate near 1 stay inside
    ax.set_ylabel("acceptance rate (n = drafted tokens)")
    ax.set_title(f"acceptance per device ({run['batching']}, {run['devices']} devices)"
                 if run else "acceptance per device (no runs)")
    return fig


CAPTION_KEYS = ("model", "dtype", "profile", "devices", "batching", "prompts", "requests",
                "duration", "rate", "max_new_tokens", "max_batch_tokens", "tree_width",
                "threads", "seed")
CAPTION_WIDTH = 110  # characters a caption line holds at its font size


def caption(runs_or_report: list[RunRecord] | dict, summaries: list[dict]) -> str:
    """The run's settings, as far as the report or the runs tell them, in one or more lines."""
    parts = []
    report = runs_or_report if isinstance(runs_or_report, dict) else {}
    config = report.get("config") or {}
    parts += [f"{k.replace('_', ' ')} {config[k]}" for k in CAPTION_KEYS
              if config.get(k) is not None]
    drafters = sorted({(name, e["drafter"]) for name, e in (report.get("emulated") or {}).items()
                       if isinstance(e, dict) and e.get("drafter")})
    if drafters:
        parts.append("drafters " + ", ".join(f"{name}: {d}" for name, d in drafters))
    slots = sorted({s["max_sessions"] for s in summaries if s.get("max_sessions")})
    if slots:
        parts.append("KV slots " + "/".join(map(str, slots)))
    parts.append(f"{len(summaries)} run(s), {sum(s['requests'] for s in summaries)} requests, "
                 f"{sum(s['errors'] for s in summaries)} errors")
    return wrap_parts(parts, CAPTION_WIDTH)


def wrap_parts(parts: list[str], width: int) -> str:
    """``parts`` joined by "; " into lines of about ``width`` characters, breaking between
    parts only (a part longer than a line gets a line of its own)."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += "; " + part
        else:
            lines.append(part)
    return "\n".join(lines)


def add_caption(fig, text: str) -> None:
    """``text`` under the axes, the layout shrunk to make room for it."""
    lines = text.count("\n") + 1
    height = fig.get_figheight()
    bottom = (0.12 + 0.14 * lines) / height  # inches per caption line at 7 pt, plus margin
    fig.text(0.01, 0.01, text, fontsize=7, ha="left", va="bottom", color="dimgray")
    fig.tight_layout(rect=(0, bottom, 1, 1))


def figures(runs_or_report: list[RunRecord] | dict) -> dict:
    """The charts by file name (PLOT_NAMES), drawn and captioned but not saved; the caller
    closes them (``save`` does)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = as_summaries(runs_or_report)
    modes = {s["batching"] for s in summaries}
    figs = dict(zip(PLOT_NAMES, [
        line_plot(plt, summaries, lambda s: s["system_tokens_per_s"], "system tokens/s",
                  "system throughput", lambda s: s["completed"], "requests"),
        line_plot(plt, summaries, lambda s: None if s["itl_s"]["p99"] is None
                  else s["itl_s"]["p99"] * 1000, "ITL p99 (ms)", "p99 inter-token latency",
                  lambda s: s.get("samples", {}).get("itl"), "ITL samples"),
        on_off_bars(plt, summaries) if {"on", "off"} <= modes else None,
        acceptance_bars(plt, summaries),
    ]))
    figs = {name: fig for name, fig in figs.items() if fig is not None}  # on/off: both ran
    text = caption(runs_or_report, summaries)
    for fig in figs.values():
        add_caption(fig, text)
    return figs


def save(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path)
    plt.close(fig)


def write_plots(runs_or_report: list[RunRecord] | dict, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, fig in figures(runs_or_report).items():
        paths.append(os.path.join(out_dir, name))
        save(fig, paths[-1])
    return paths
