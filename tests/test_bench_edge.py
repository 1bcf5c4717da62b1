"""``edgespec bench-edge`` end to end on the tiny looping model: a real ``edgespec serve`` on the
server's core and a MaG ``edgespec drafter`` on the boards', the same requests with and without
the board; the report's figures, and outputs identical both ways. Plus its option parsing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from edgespec.config import ConfigError
from edgespec_cli.bench.edge_vs_server import parse_fleets


def test_fleet_settings_parse_and_bad_ones_are_refused():
    assert parse_fleets("1x1,4X2") == [(1, 1), (4, 2)]
    for bad in ["4", "0x1", "2x0", "axb", ""]:
        with pytest.raises(ConfigError):
            parse_fleets(bad)


def test_the_chunks_the_cache_refused_are_counted_by_code_between_two_scrapes():
    from edgespec_cli.bench.edge_report import refused_chunks

    def key(result: str, code: str) -> tuple:
        return "edgespec:cache_chunks_total", tuple(sorted({"result": result,
                                                             "code": code}.items()))

    before = {key("ok", "OK"): 5.0, key("refused", "FAILED_PRECONDITION"): 2.0}
    after = {key("ok", "OK"): 9.0, key("refused", "FAILED_PRECONDITION"): 5.0,
             key("refused", "NOT_FOUND"): 1.0, key("refused", "INVALID_ARGUMENT"): 0.0}
    assert refused_chunks(after, before) == {"FAILED_PRECONDITION": 3.0, "NOT_FOUND": 1.0}
    assert refused_chunks(before, before) == {}


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_edge_drafting_against_the_server_alone_as_processes(looping_dir, tmp_path):
    out = tmp_path / "bench-edge.json"
    r = subprocess.run(
        [sys.executable, "-m", "edgespec_cli", "bench-edge", "--model", str(looping_dir),
         "--dtype", "float32", "--fleets", "2x1", "--drafter", "mag", "--categories", "qa",
         "translation", "--max-new-tokens", "16", "--json", str(out), "--plot",
         str(tmp_path / "edge.png"),
         # a fixed draft length, waited for: that the board's drafts are verified does not
         # depend on how fast this machine runs the planner's first steps
         "--serve-arg=--no-adaptive", "--board-arg=--tree-width=2"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    [fleet] = report["fleets"]
    assert fleet["identical"] and (fleet["sessions"], fleet["boards"]) == (2, 1)
    alone, edge = fleet["server_only"], fleet["edge"]
    assert alone["tokens"] == edge["tokens"] > 0
    assert alone["drafted"] == 0 and edge["drafted"] > 0  # no board, then one
    for side in (alone, edge):
        assert side["tokens_per_s"] > 0 and side["server_cpu_ms_per_token"] > 0
        assert side["tokens_per_forward"] >= 1 and side["step_ms"]["forward"] > 0
    assert alone["chunks_refused"] == {}  # no board: no chunk
    assert all(n > 0 for n in edge["chunks_refused"].values())
    [board] = fleet["per_board"]
    assert board["device"] == "board-0" and board["session_steps"] > 0
    assert 0 <= board["verified_share"] <= 1 and board["chunks_sent"] > 0
    stages = board["commit_to_draft"]  # each commit drafted ahead of, or served by a chunk
    assert stages["commits"] > 0 and 0 <= stages["ahead_share"] <= 1
    assert stages["link_rtt_ms"] > 0 and "commit -> usable draft" in r.stdout
    assert "server on cpus" in report["config"]["split"]
    assert report["config"]["board_args"] == ["--tree-width=2"]  # and the board drafted trees
    board_log = (tmp_path / "bench-edge-2x1-board-0.log").read_text()  # the cache took:
    assert "trees of width 2" in board_log and "refuses tree chunks" not in board_log
    assert "INVALID_ARGUMENT" not in edge["chunks_refused"]
    assert "2x1" in r.stdout and "the whole draft in when taken in" in r.stdout
    n = report["config"]["questions"]  # progress on stderr: the fleet, each side, the requests
    for line in ("[1/1] fleet 2x1", "2x1: the server alone", "2x1: with 1 board(s) drafting",
                 f"{n}/{n} requests done", "[1/1] fleet 2x1 done"):
        assert line in r.stderr, r.stderr[-2000:]
    assert (tmp_path / "edge.png").read_bytes().startswith(b"\x89PNG")


def test_the_table_says_which_settings_ran_too_short_for_a_steady_ratio():
    from edgespec_cli.bench.edge_report import format_table
    from edgespec_cli.simulate.report import SHORT_RUN_S

    def side(wall_s: float) -> dict:
        return {"tokens_per_s": 10.0, "itl_p99_ms": 90.0, "server_cpu_ms_per_token": 50.0,
                "tokens_per_forward": 1.0, "wall_s": wall_s, "steps": 10,
                "step_ms": {"wait": 1.0, "forward": 50.0, "commit": 1.0}}

    def fleet(sessions: int, alone_s: float, edge_s: float) -> dict:
        return {"sessions": sessions, "boards": 1, "server_only": side(alone_s),
                "edge": side(edge_s), "throughput_ratio": 1.0, "identical": True,
                "per_board": [], "bound_by_boards": False}

    long = 2 * SHORT_RUN_S
    table = format_table({"fleets": [fleet(1, long, long), fleet(2, long, SHORT_RUN_S / 2),
                                     fleet(4, SHORT_RUN_S / 3, long)]})
    assert f"note: 2x1, 4x1 had a run of under {SHORT_RUN_S:.0f} s" in table
    assert "note:" not in format_table({"fleets": [fleet(1, long, long)]})
