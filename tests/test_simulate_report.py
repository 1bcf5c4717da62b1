"""The simulation report on synthetic run records with hand-computed figures (no models, no
servers): percentiles, latencies, per-run and per-device figures, the report's ratios, its table,
JSON and charts. The server's and the boards' sides and the server-only baseline:
``test_simulate_server_only``."""

import json

import pytest

from edgespec_cli.simulate.records import RunRecord
from edgespec_cli.simulate.charts import figures, write_plots
from edgespec_cli.simulate.report import (add_capacity, build_report, busy_time,
                                          inter_token_latencies, nearest_rank, summarize_run,
                                          write_json)
from edgespec_cli.simulate.report_text import format_table

from simulate_records import EMULATED, REAL, report_for, req, run, sweep

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_nearest_rank_percentiles():
    assert nearest_rank([], 50) is None
    assert nearest_rank([3.0], 99) == 3.0
    assert nearest_rank([4.0, 1.0, 3.0, 2.0], 50) == 2.0
    assert nearest_rank(list(range(1, 101)), 99) == 99
    assert nearest_rank(list(range(1, 11)), 99) == 10


def test_itl_spreads_a_piece_gap_over_its_tokens():
    r = req("d", "p", 0.0, [1.0, 1.5, 1.5, 2.5, 2.5, 2.5, 2.5])
    assert inter_token_latencies(r) == pytest.approx([0.25, 0.25, 0.25, 0.25, 0.25, 0.25])
    assert inter_token_latencies(req("d", "p", 0.0, [1.0, 1.0, 1.0])) == []


def test_busy_time_is_the_union_of_request_intervals():
    reqs = [req("d", "p", 0.0, [2.0]), req("d", "p", 1.0, [3.0]), req("d", "p", 5.0, [6.0])]
    assert busy_time(reqs) == pytest.approx(4.0)


def test_summarize_run_system_figures():
    s = summarize_run(run())
    assert (s["batching"], s["devices"], s["max_sessions"]) == ("on", 2, 8)
    assert (s["requests"], s["completed"], s["errors"], s["tokens"]) == (4, 3, 1, 11)
    assert s["wall_s"] == pytest.approx(10.0)
    assert s["system_tokens_per_s"] == pytest.approx(1.1)
    assert s["ttft_s"] == pytest.approx({"p50": 1.0, "p99": 2.0})
    assert s["itl_s"] == pytest.approx({"p50": 0.25, "p99": 2.0})
    assert s["acceptance"]["drafted"] == 25 and s["acceptance"]["accepted"] == 15
    assert s["acceptance"]["rate"] == pytest.approx(0.6)
    assert s["acceptance"]["mean_acceptance_length"] == pytest.approx(25 / 11)
    assert s["batch_sizes"]["histogram"] == {"1": 4, "2": 3, "4": 1}
    assert s["batch_sizes"]["forwards"] == 8
    assert s["batch_sizes"]["mean"] == pytest.approx(1.75)


def test_summarize_run_per_device_figures():
    a, b = summarize_run(run())["per_device"]
    assert (a["device_id"], a["profile"], a["requests"], a["errors"], a["tokens"]) == \
        ("dev-a", "pi5", 2, 0, 9)
    assert a["share_tokens_per_s"] == pytest.approx(0.9)
    assert a["busy_s"] == pytest.approx(4.0)
    assert a["decode_tokens_per_s"] == pytest.approx(2.25)
    assert a["acceptance_rate"] == pytest.approx(0.7)
    assert a["mean_acceptance_length"] == pytest.approx(23 / 9)
    assert (b["device_id"], b["profile"], b["requests"], b["errors"], b["tokens"]) == \
        ("dev-b", "orin", 2, 1, 2)
    assert b["share_tokens_per_s"] == pytest.approx(0.2)
    assert b["decode_tokens_per_s"] == pytest.approx(0.5)
    assert (b["drafted"], b["accepted"]) == (5, 1)
    assert b["acceptance_rate"] == pytest.approx(0.2)
    assert b["mean_acceptance_length"] == pytest.approx(1.0)


def error_only_run():
    return run(requests=[req("dev-x", "pi5", 0.0, [], drafted=0, error="refused"),
                         req("dev-y", "orin", 1.0, [], error="timeout")], batch_sizes={})


def test_error_only_and_empty_runs_give_none():
    s = summarize_run(error_only_run())
    assert (s["tokens"], s["errors"], s["completed"]) == (0, 2, 0)
    assert s["system_tokens_per_s"] == 0.0
    assert s["ttft_s"] == {"p50": None, "p99": None}
    assert s["itl_s"] == {"p50": None, "p99": None}
    assert s["acceptance"]["rate"] is None
    assert s["acceptance"]["mean_acceptance_length"] is None
    assert s["batch_sizes"] == {"histogram": {}, "forwards": 0, "mean": None}
    for d in s["per_device"]:
        assert d["decode_tokens_per_s"] is None and d["acceptance_rate"] is None
    empty = summarize_run(RunRecord("off", 0, 5.0, 5.0, [], {}))
    assert empty["system_tokens_per_s"] is None and empty["per_device"] == []
    report = report_for([error_only_run(), RunRecord("off", 2, 5.0, 5.0, [], {})])
    assert report["throughput_ratio"] is None
    assert "dev-x" in format_table(report)


def test_build_report_shape_and_throughput_ratio():
    lossless = {"checked": 4, "identical": 4, "ok": True}
    report = report_for(sweep(), lossless=lossless)
    assert report["config"] == {"model": "tiny", "prompts": 4}
    assert report["real"] == REAL and report["emulated"] == EMULATED
    assert report["percentile_method"] == "nearest-rank"
    assert [(s["batching"], s["devices"]) for s in report["runs"]] == \
        [("on", 1), ("off", 1), ("on", 2), ("off", 2), ("on", 4)]
    assert report["throughput_ratio"] == pytest.approx(2.0)
    assert report["throughput_ratio_by_devices"] == pytest.approx({"1": 3.0, "2": 2.0})
    assert report["lossless"] == lossless


def test_report_without_both_modes_has_no_ratio():
    report = report_for([run("on", 2)])
    assert "throughput_ratio" not in report and "throughput_ratio_by_devices" not in report
    assert "lossless" not in report


def test_add_capacity_sets_ratio():
    probes = [{"devices": 8, "batching": "on", "min_tokens_per_s": 5.5, "ok": True}]
    report = add_capacity(report_for(sweep()), {"on": 8, "off": 2}, 5.0, probes)
    assert report["capacity"] == {"slo_tokens_per_s": 5.0, "on": 8, "off": 2, "probes": probes}
    assert report["capacity_ratio"] == pytest.approx(4.0)
    assert "capacity_ratio_vs_server_only" not in report
    assert add_capacity(report_for(sweep()), {"on": 3, "off": 0}, 5.0,
                        [])["capacity_ratio"] is None
    report = add_capacity(report_for(sweep()), {"on": 6, "server-only": 2}, 5.0, [])
    assert report["capacity_ratio_vs_server_only"] == pytest.approx(3.0)
    assert "ratio on/server-only 3.00x" in format_table(report)
    assert "capacity_ratio" not in report
    assert "on/server-only 3.00x" in format_table(report)
    # the server alone met the SLO at no count: said so, not printed as "-x"
    report = add_capacity(report_for(sweep()), {"on": 1, "server-only": 0}, 5.0, [])
    assert report["capacity_ratio_vs_server_only"] is None
    table = format_table(report)
    assert "on/server-only: none (the server alone met the SLO" in table and "-x" not in table


def test_format_table_lists_every_device_and_ratios():
    report = add_capacity(report_for(sweep(), lossless={"checked": 2, "identical": 2,
                                                         "ok": True}), {"on": 8, "off": 2},
                          5.0, [])
    table = format_table(report)
    for s in report["runs"]:
        for d in s["per_device"]:
            assert d["device_id"] in table
    assert "1000.0" in table  # TTFT p50 of 1 s, in ms
    assert "throughput on/off: 2.00x" in table
    assert "ratio on/off 4.00x" in table
    assert "lossless" in table


def test_write_json_round_trips(tmp_path):
    report = add_capacity(report_for(sweep(), lossless={"checked": 1, "identical": 1,
                                                         "ok": True}), {"on": 8, "off": 2},
                          5.0, [])
    path = write_json(report, str(tmp_path / "out" / "report.json"))
    with open(path) as f:
        assert json.load(f) == report


def assert_pngs(paths, out_dir, on_off: bool = True):
    """The charts written: the on/off bars only where both modes ran."""
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == sorted(
        ["throughput_vs_devices.png", "itl_p99_vs_devices.png", "acceptance_per_device.png"]
        + (["batching_on_vs_off.png"] if on_off else []))
    for p in paths:
        assert p.startswith(str(out_dir))
        with open(p, "rb") as f:
            data = f.read()
        assert len(data) > len(PNG_MAGIC) and data.startswith(PNG_MAGIC)


def test_write_plots_from_runs_and_from_report(tmp_path):
    assert_pngs(write_plots(sweep(), str(tmp_path / "a")), tmp_path / "a")
    assert_pngs(write_plots(report_for(sweep()), str(tmp_path / "b")), tmp_path / "b")


def test_write_plots_single_device_count_and_error_only(tmp_path):
    assert_pngs(write_plots([run("on", 2), run("off", 2, ended=20.0)], str(tmp_path / "one")),
                tmp_path / "one")
    assert_pngs(write_plots([error_only_run()], str(tmp_path / "err")), tmp_path / "err",
                on_off=False)
    assert_pngs(write_plots([], str(tmp_path / "none")), tmp_path / "none", on_off=False)
    # one mode and the server-only baseline: no bars of a mode that never ran
    assert_pngs(write_plots([run("on", 2), run("server-only", 2)], str(tmp_path / "base")),
                tmp_path / "base", on_off=False)


def chart_texts(fig) -> dict:
    """What a chart says: its caption, its axes' value labels, its legend entries."""
    ax = fig.axes[0]
    legend = ax.get_legend()
    return {"caption": [t.get_text() for t in fig.texts],
            "labels": [t.get_text() for t in ax.texts],
            "legend": [t.get_text() for t in legend.get_texts()] if legend else []}


def test_summarize_run_counts_latency_samples():
    assert summarize_run(run())["samples"] == {"ttft": 3, "itl": 8}
    assert summarize_run(error_only_run())["samples"] == {"ttft": 0, "itl": 0}


def test_charts_carry_values_sample_counts_and_the_run_settings():
    import matplotlib.pyplot as plt

    report = build_report(sweep(), lossless=None, real=REAL, config={
        "model": "tiny", "dtype": "float32", "devices": "1,2,4", "prompts": 4, "json": "x"},
        emulated={"pi5": {"drafter": "mag", "link": "20 ms"}})
    figs = figures(report)
    try:
        texts = {name: chart_texts(fig) for name, fig in figs.items()}
    finally:
        for fig in figs.values():
            plt.close(fig)
    for name, t in texts.items():
        (caption,) = t["caption"]
        for setting in ("model tiny", "dtype float32", "devices 1,2,4", "prompts 4",
                        "drafters pi5: mag", "KV slots 8", "5 run(s), 20 requests, 5 errors"):
            assert setting in caption, (name, caption)
        assert "json" not in caption
    # on: 11 tokens in 5 s at 1 device, 11 in 10 s at 2 and 4; off: 11/15 and 11/20
    throughput = texts["throughput_vs_devices.png"]
    assert throughput["labels"] == ["2.2", "1.1", "1.1", "0.733", "0.55"]
    assert throughput["legend"] == ["batching on (n=9 requests)", "batching off (n=6 requests)"]
    assert texts["itl_p99_vs_devices.png"]["legend"] == [
        "batching on (n=24 ITL samples)", "batching off (n=16 ITL samples)"]
    bars = texts["batching_on_vs_off.png"]
    assert sorted(bars["labels"]) == sorted(["2.2", "1.1", "1.1", "0.733", "0.55"])
    assert bars["legend"] == ["batching on (n=9 requests)", "batching off (n=6 requests)"]
    assert texts["acceptance_per_device.png"]["labels"] == ["0.70\nn=20", "0.20\nn=5"]


def test_charts_from_runs_alone_still_have_a_caption():
    import matplotlib.pyplot as plt

    figs = figures([run("on", 2)])
    try:
        captions = [chart_texts(fig)["caption"] for fig in figs.values()]
    finally:
        for fig in figs.values():
            plt.close(fig)
    assert all(c == ["KV slots 8; 1 run(s), 4 requests, 1 errors"] for c in captions), captions
