"""``edgespec simulate --project-on``: a fleet on a GPU server projected from a sitting's step
costs and drafters measured here, hand-computed on synthetic inputs (no GPU, no fleet)."""

from __future__ import annotations

import json

import pytest
from cli_inprocess import run_cli

from edgespec.config import ConfigError
from edgespec_cli.simulate.projection import (DrafterTrace, build_projection, capacity,
                                              expected_tokens, parse_acceptance, project,
                                              step_costs, step_ms, traces_from_bench_edge)

SITTING = {"gpu": "TEST GPU", "dtype": "bfloat16", "forward": [
    {"shape": "8b", "sessions": 1, "tokens": 1, "ms": 6.0},
    {"shape": "8b", "sessions": 64, "tokens": 1, "ms": 10.0},
    {"shape": "8b", "sessions": 64, "tokens": 9, "ms": 50.0},
    {"shape": "135m", "sessions": 1, "tokens": 1, "ms": 1.0}]}


def test_step_cost_is_linear_in_rows_between_and_beyond_the_sittings_points():
    points = step_costs(SITTING, "8b")
    assert points == [(1, 6.0), (64, 10.0), (576, 50.0)]
    assert step_ms(points, 1) == 6.0 and step_ms(points, 64) == 10.0
    assert step_ms(points, 320) == pytest.approx(30.0)  # half way from 64 to 576
    assert step_ms(points, 1088) == pytest.approx(90.0)  # the last slope beyond
    with pytest.raises(ConfigError, match="135m"):
        step_costs(SITTING, "135m")  # one point is not a line
    with pytest.raises(ConfigError):
        step_costs(SITTING, "70b")


def test_expected_tokens_of_a_draft():
    half = DrafterTrace("d", 0.5, None)  # no acceptance by position: alpha^m
    assert expected_tokens(half, 0) == 1.0
    assert expected_tokens(half, 2) == pytest.approx(1.75)
    assert expected_tokens(half, 1.5) == pytest.approx(1.5 + 0.5 * 0.25)


def test_projection_picks_the_draft_length_that_pays_and_the_boards_speed_bounds_it():
    points = step_costs(SITTING, "8b")
    free = project(points, DrafterTrace("d", 0.9, None), 1)
    # one board, rows 1 + k cost ~6 ms each: long drafts pay
    assert free["draft_tokens"] >= 8 and free["throughput_ratio"] > 4
    assert free["server_only_tokens_per_s"] == pytest.approx(1000 / 6.0)
    slow = project(points, DrafterTrace("d", 0.9, 100.0), 1)  # 0.6 draft tokens a 6 ms step
    assert slow["tokens_per_session_step"] <= expected_tokens(DrafterTrace("d", 0.9, 100.0),
                                                              100.0 * slow["step_ms"] / 1000)
    assert 1 < slow["throughput_ratio"] < free["throughput_ratio"]
    wide = project(points, DrafterTrace("d", 0.3, None), 64)  # poor drafts at a wide step
    assert wide["draft_tokens"] == 0 and wide["throughput_ratio"] == pytest.approx(1.0)
    assert capacity(points, None, 100.0, 64) == 64  # 64 rows: 10 ms, 100 tok/s a session
    assert capacity(points, DrafterTrace("d", 0.9, None), 100.0, 64) == 64


def test_acceptance_comes_from_bench_edge_reports_or_by_hand(tmp_path):
    path = tmp_path / "be.json"
    path.write_text(json.dumps({"config": {"drafter": "llamacpp:default"}, "fleets": [
        {"edge": {"drafted": 100, "accepted": 90},
         "per_board": [{"draft_tokens": 200.0, "cpu_s": 10.0}]},
        {"edge": {"drafted": 100, "accepted": 70},
         "per_board": [{"draft_tokens": 100.0, "cpu_s": 10.0}]}]}))
    [t] = traces_from_bench_edge([str(path)])
    assert (t.name, t.alpha, t.tokens_per_s) == ("llamacpp:default", 0.8, 20.0)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a bench-edge report"):
        traces_from_bench_edge([str(tmp_path / "bad.json")])
    with pytest.raises(ConfigError, match="cannot read it .*write one with edgespec bench-edge"):
        traces_from_bench_edge([str(tmp_path / "none.json")])  # missing: not "not a report"
    assert parse_acceptance("mag=0.6, big=0.9@250") == [
        DrafterTrace("mag", 0.6, None, "given"), DrafterTrace("big", 0.9, 250.0, "given")]
    for bad in ["mag", "mag=1.0", "mag=x", "mag=0.5@0"]:
        with pytest.raises(ConfigError):
            parse_acceptance(bad)


def test_acceptance_by_position_comes_from_the_reports_drafts_by_position(tmp_path):
    """A drafter right in runs (all or nothing) is worth more at a wide draft than alpha^m
    says: P_m measured where MIN_TRIALS drafts reached m, then P_L x alpha^(m - L)."""
    from edgespec_cli.simulate.projection import MIN_TRIALS, prefix_acceptance

    path = tmp_path / "be.json"
    path.write_text(json.dumps({"config": {"drafter": "mag"}, "fleets": [
        {"edge": {"drafted": 60, "accepted": 30, "drafted_per_pos": [20, 20],
                  "accepted_per_pos": [10, 10]}, "per_board": []},
        {"edge": {"drafted": 60, "accepted": 30, "drafted_per_pos": [20, 20, 20, 20],
                  "accepted_per_pos": [10, 10, 10, 10]}, "per_board": []}]}))
    [t] = traces_from_bench_edge([str(path)])
    assert t.alpha == 0.5 and t.prefix_accept == (0.5, 0.5, 0.5, 0.5)  # 20 drafts reached 3, 4
    # past the last measured, the smaller of its last step (P_4 / P_3 = 1) and alpha
    assert t.accepted_through(6) == pytest.approx(0.5 * 0.5 ** 2)
    falling = DrafterTrace("f", 0.9, None, prefix_accept=(0.8, 0.4))
    assert falling.accepted_through(4) == pytest.approx(0.4 * 0.5 ** 2)
    assert expected_tokens(t, 4) == 3.0 > expected_tokens(DrafterTrace("d", 0.5, None), 4)
    assert prefix_acceptance([MIN_TRIALS, MIN_TRIALS - 1], [10, 9]) == (0.5,)  # too few at 2
    assert prefix_acceptance([40, 40], [10, 20]) == (0.25, 0.25)  # never likelier further on
    assert prefix_acceptance([40, 40, 30], [10]) == (0.25, 0.0, 0.0)  # cut at its last non-zero
    old = DrafterTrace("d", 0.5, None)  # a report from before the counts: alpha^m
    assert old.accepted_through(3) == 0.125
    p = build_projection(SITTING, "8b", [t], [1, 64], None, 64)
    assert p["drafters"][0]["prefix_accept"] == [0.5] * 4


def test_the_projection_report_states_it_is_one_and_its_assumptions():
    p = build_projection(SITTING, "8b", [DrafterTrace("mag", 0.6, None)], [1, 64], 50.0, 64)
    assert p["kind"] == "projection (not a measurement)" and p["assumptions"]
    [d] = p["drafters"]
    assert [r["boards"] for r in d["by_boards"]] == [1, 64]
    assert d["capacity"] == {"slo_tokens_per_s": 50.0, "edge": 64, "server_only": 64}


def test_simulate_project_on_prints_and_writes_the_projection(tmp_path):
    sitting = tmp_path / "sitting.json"
    sitting.write_text(json.dumps(SITTING))
    out = tmp_path / "projection.json"
    r = run_cli("simulate", "--project-on", str(sitting), "--shape", "8b", "--acceptance",
                "mag=0.6", "--devices", "1,64", "--slo", "50", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("PROJECTION (not a measurement) on TEST GPU")
    assert json.loads(out.read_text())["drafters"][0]["drafter"] == "mag"
    r = run_cli("simulate", "--project-on", str(sitting))
    assert r.returncode == 2 and "needs drafters" in r.stderr
    r = run_cli("simulate", "--acceptance", "mag=0.5")
    assert r.returncode == 2 and "--project-on" in r.stderr
