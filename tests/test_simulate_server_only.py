"""The simulation report's sides on synthetic run records with hand-computed figures (no
models, no servers): the server's and the boards' cores and which bound a run, the server's cost
a token, the drafts each board sent and wasted, edge drafting against the server serving alone
per device count, repeated rounds paired and their medians, short runs said to be noisy."""

import pytest

from edgespec_cli.simulate.records import RequestRecord
from edgespec_cli.simulate.report import SHORT_RUN_S, summarize_run
from edgespec_cli.simulate.report_text import format_table

from simulate_records import report_for, req, run, sweep


# -- the server's and the boards' cores, the server's cost, the server-only baseline ---------------
def split_run(batching="on", ended=10.0, server_s=9.5, boards_s=2.0, boards=None,
              cache_s=1.5):
    r = run(batching, 2, ended=ended)
    r.cpu = {"split": "server on cpus 0, boards on cpus 1",
             "server": {"cpus": 1, "cpu_s": server_s, "verifier_cpu_s": server_s - cache_s,
                        "cache_cpu_s": cache_s},
             "boards": {"cpus": 1, "cpu_s": boards_s}}
    r.boards = boards if boards is not None else {
        "dev-a": {"tokens_sent": 20, "tokens_kept": 3}, "dev-b": {"tokens_sent": 9}}
    return r


def test_each_sides_cpu_use_and_the_side_that_bound_the_run():
    s = summarize_run(split_run())
    assert s["cpu"]["server"] == {"cpus": 1, "cpu_s": 9.5, "busy": pytest.approx(0.95),
                                  "verifier_cpu_s": 8.0, "cache_cpu_s": 1.5}
    assert "server 9.5 CPU s on 1 core(s), 95% busy (verifier 8.0, cache and its Redis 1.5)" \
        in format_table(report_for([split_run()]))
    # a record without the server's parts (an older run's): None, and no parts printed
    older = split_run()
    older.cpu["server"] = {"cpus": 1, "cpu_s": 9.5}
    summary = summarize_run(older)["cpu"]["server"]
    assert summary["verifier_cpu_s"] is None and summary["cache_cpu_s"] is None
    assert "(verifier" not in format_table(report_for([older]))
    assert s["cpu"]["boards"]["busy"] == pytest.approx(0.2)
    assert s["cpu"]["bound_by"] == "the server's cores"
    assert summarize_run(split_run(boards_s=9.8))["cpu"]["bound_by"] == "the boards' cores"
    assert summarize_run(split_run(server_s=5.0))["cpu"]["bound_by"] is None
    table = format_table(report_for([split_run(boards_s=9.8)]))
    assert "BOUND BY         the boards' cores" in table and "98% busy" in table
    assert summarize_run(run())["cpu"] is None  # a run without the split


def test_server_cost_and_draft_tokens_sent_and_wasted():
    s = summarize_run(split_run())
    assert s["server_cpu_s_per_token"] == pytest.approx(9.5 / 11)  # 11 committed tokens
    assert s["tokens_per_forward"] == pytest.approx(11 / 8)  # 8 forwards
    a, b = s["per_device"]
    assert (a["draft_tokens_sent"], a["draft_tokens_wasted"]) == (20, 20 - 14)  # accepted 6+8
    assert a["draft_tokens_kept_across_fixes"] == 3
    assert (b["draft_tokens_sent"], b["draft_tokens_wasted"]) == (9, 9 - 1)  # failed: no count
    assert (s["draft_tokens_sent"], s["draft_tokens_wasted"]) == (29, 14)
    none = summarize_run(split_run(boards={}))
    assert none["draft_tokens_sent"] is None and none["per_device"][0]["draft_tokens_sent"] is None


def test_each_boards_commit_to_draft_stages_and_drafts_slower_than_published():
    boards = {"dev-a": {"tokens_sent": 20, "commits_seen": 10, "commits_ahead": 4,
                        "commits_served": 5, "served_s": 0.5, "queued_s": 0.2,
                        "drafting_s": 0.25, "slower_than_published": 3},
              "dev-b": {"tokens_sent": 9}}
    s = summarize_run(split_run(boards=boards))
    a, b = s["per_device"]
    assert a["commit_to_draft"] == {"commits": 10, "ahead_share": 0.4, "served": 5,
                                    "total_ms": pytest.approx(100), "queued_ms": pytest.approx(40),
                                    "drafting_ms": pytest.approx(50)}
    assert a["drafts_slower_than_published"] == 3
    assert b["commit_to_draft"] is None and b["drafts_slower_than_published"] is None
    table = format_table(report_for([split_run(boards=boards)]))
    assert "dev-a: commit -> usable draft: drafted ahead of 40% of 10 commits" in table
    assert "in 100.0 ms (queued 40.0, drafting 50.0)" in table
    assert "dev-a: 3 drafts were slower here than the profile's published speed" in table


def test_edge_drafting_against_server_only_per_device_count():
    report = report_for([split_run("on", ended=10.0, server_s=4.0),
                         split_run("server-only", ended=20.0, server_s=16.0, boards={})])
    r = report["vs_server_only"]["2"]
    assert r["throughput"] == pytest.approx(2.0)  # the same 11 tokens in half the time
    assert r["server_cpu_s_per_token"] == pytest.approx(0.25)
    assert r["itl_p50"] == pytest.approx(1.0) and r["bound_by"] is None
    assert "edge drafting / server-only, 2 dev: throughput 2.00x" in format_table(report)
    assert "vs_server_only" not in report_for(sweep())


def test_repeated_rounds_are_paired_by_round_and_their_ratios_medians():
    import random
    from dataclasses import replace

    from edgespec_cli.simulate.charts import series

    # three rounds, the same tokens each: edge drafting 10, 20, 5 s against the server alone
    # 20, 12.5, 8 s: by round 2.0x, 0.625x, 1.6x, median 1.6x (the medians' ratio would be
    # 12.5 / 10 = 1.25x; rounds paired by position after a shuffle would be wrong too)
    edge = [replace(split_run("on", ended=t, server_s=4.0), round=k, rounds=3)
            for k, t in ((1, 10.0), (2, 20.0), (3, 5.0))]
    base = [replace(split_run("server-only", ended=t, server_s=t, boards={}), round=k, rounds=3)
            for k, t in ((1, 20.0), (2, 12.5), (3, 8.0))]
    runs = edge + base
    random.Random(3).shuffle(runs)
    report = report_for(runs)
    r = report["vs_server_only"]["2"]
    assert r["throughput_by_round"] == pytest.approx([2.0, 0.625, 1.6])  # each its own round
    assert r["throughput"] == pytest.approx(1.6)
    # server CPU a token: 4 s against 20, 12.5, 8 s for the same tokens
    assert r["server_cpu_s_per_token"] == pytest.approx(4 / 12.5)
    table = format_table(report)
    assert "== batching on, 2 device(s), round 2 of 3: " in table
    assert "(medians of 3 rounds; throughput by round 2.00x, 0.62x, 1.60x)" in table
    # a chart's point is the median of a count's rounds
    xs, ys = series(report["runs"], "server-only", lambda s: s["wall_s"])
    assert xs == [2] and ys == pytest.approx([12.5])
    # a round that has one mode only is not paired; one round: no rounds listed
    assert "vs_server_only" not in report_for(edge[:1] + base[1:])
    single = report_for([edge[0], base[0]])["vs_server_only"]["2"]
    assert "throughput_by_round" not in single and single["throughput"] == pytest.approx(2.0)
    assert "round 1 of" not in format_table(report_for([split_run("on")]))


def test_what_bound_the_rounds_is_said_round_by_round_where_they_differ():
    from edgespec_cli.simulate.report import bound_in_rounds

    assert bound_in_rounds(["the server's cores"] * 3) == "the server's cores"
    assert bound_in_rounds([None, None]) is None
    assert bound_in_rounds(["the boards' cores", None, "the server's cores",
                            "the boards' cores"]) == \
        "the boards' cores in 2 of 4 rounds; the server's cores in 1 of 4 rounds"


def test_rounds_run_each_count_in_turn_every_other_round_reversed():
    from edgespec_cli.simulate.cli import run_order

    assert run_order([1, 4], ["on", "server-only"], 3) == [
        ("on", 1, 1), ("server-only", 1, 1), ("server-only", 1, 2), ("on", 1, 2),
        ("on", 1, 3), ("server-only", 1, 3),
        ("on", 4, 1), ("server-only", 4, 1), ("server-only", 4, 2), ("on", 4, 2),
        ("on", 4, 3), ("server-only", 4, 3)]
    assert run_order([2], ["on"], 1) == [("on", 2, 1)]


def test_the_lossless_sample_holds_every_request_a_link_fault_overlapped():
    """Each device's first finished request, and every finished one sent before a fault healed
    and ended after it began (a fault never healed lasts to the run's end): the requests a
    fault could have changed are all checked against target-only decoding."""
    from edgespec_cli.simulate.check import sample

    reqs = [req("dev-a", "pi5", 0.0, [1.0, 2.0]),  # first of dev-a
            req("dev-a", "pi5", 3.0, [4.0, 5.0]),  # before the fault: not sampled
            req("dev-a", "pi5", 5.5, [6.5, 8.0]),  # during the fault (6-7 s)
            req("dev-b", "orin", 5.0, [5.5, 9.0]),  # first of dev-b, and during it
            req("dev-b", "orin", 7.5, [8.0, 8.5]),  # after it healed, before the next
            req("dev-b", "orin", 8.6, [9.5]),  # the second fault, never healed
            req("dev-b", "orin", 6.5, [], error="timeout")]  # failed: nothing to check
    r = run(requests=reqs, ended=10.0)
    r.link_faults = [{"fault": "blackhole", "links": "all", "device": None, "at_s": 6.0,
                      "healed_at_s": 7.0},
                     {"fault": "reset", "links": "all", "device": 1, "at_s": 9.2,
                      "healed_at_s": None}]
    assert [(x.device_id, x.sent_at) for x in sample(r)] == [
        ("dev-a", 0.0), ("dev-b", 5.0), ("dev-a", 5.5), ("dev-b", 8.6)]
    r.link_faults = []
    assert [(x.device_id, x.sent_at) for x in sample(r)] == [("dev-a", 0.0), ("dev-b", 5.0)]


def test_a_devices_acceptance_is_its_boards_own_the_verifiers_drafts_left_out():
    """With the verifier's draft head (or fill) drafting too, the totals a session reports mix
    them in: a device's drafted, accepted, rate and wasted are its board's own share (the wire's
    drafter_* counts); a verifier too old to send them, with neither a head nor a fill, has
    totals that are the board's."""
    from edgespec_cli.simulate.records import board_share
    from edgespec_cli.simulate.report import summarize_device

    class Piece:
        token_ids = [5, 6]
        stats = {"drafted": 100, "accepted": 60, "head_tokens": 60, "head_accepted": 50,
                 "drafter_drafts": 8, "drafter_tokens": 40, "drafter_accepted": 10,
                 "mean_acceptance_length": 2.0}

    r = RequestRecord(device_id="dev-a", profile="pi5", category="qa", prompt_ids=[1],
                      sent_at=0.0)
    r.read([Piece()])
    assert (r.drafted, r.accepted, r.board_drafted, r.board_accepted) == (100, 60, 40, 10)
    d = summarize_device("dev-a", [r], 10.0, {"tokens_sent": 40})
    assert (d["drafted"], d["accepted"], d["acceptance_rate"]) == (40, 10, 0.25)
    assert d["draft_tokens_wasted"] == 30
    assert board_share({"drafted": 9, "accepted": 4}) == (9, 4)  # an older verifier's
    assert board_share({"drafted": 9, "accepted": 4, "fill_tokens": 9}) == (0, 0)  # all fill


def test_ratios_from_short_runs_are_said_to_be_noisy():
    # sweep(): every run ends at 10 s or so, under SHORT_RUN_S: each compared count is named
    report = report_for(sweep())
    assert report["short_runs"] == {"under_s": SHORT_RUN_S, "devices": [1, 2]}  # not 4: no pair
    assert "note: at 1, 2 device(s) a run took under 30 s" in format_table(report)
    long_runs = [run("on", 2, ended=SHORT_RUN_S + 1), run("off", 2, ended=2 * SHORT_RUN_S)]
    report = report_for(long_runs)
    assert "short_runs" not in report and "note:" not in format_table(report)
    # a lone short run compares nothing: nothing to say
    assert "short_runs" not in report_for([run("on", 2)])
    # against the server alone too
    report = report_for([run("on", 2), run("server-only", 2, ended=SHORT_RUN_S + 5)])
    assert report["short_runs"]["devices"] == [2]


def test_the_step_line_says_how_many_steps_rested():
    from edgespec_cli.simulate.report import step_split
    from edgespec_cli.simulate.report_text import step_line

    totals = {"steps": 10, "wait_s": 0.1, "forward_s": 1.0, "commit_s": 0.05, "rested": 4}
    split = step_split(totals)
    assert split is not None and split["rested"] == 4 and split["forward"] == pytest.approx(100)
    assert step_line(split).endswith("(10 steps, 4 rested)")
    # none rested, or an older server that did not count them: the line says nothing of it
    for old in ({**totals, "rested": 0}, {k: v for k, v in totals.items() if k != "rested"}):
        line = step_line(step_split(old))
        assert line.endswith("(10 steps)") and "rested" not in line


def test_the_step_line_gives_one_token_steps_forward_a_row():
    from edgespec_cli.simulate.report import step_split
    from edgespec_cli.simulate.report_text import step_line

    totals = {"steps": 10, "wait_s": 0.1, "forward_s": 1.0, "commit_s": 0.05, "rested": 4,
              "plain_by_rows": {"4": [4, 0.32], "1": [1, 0.08], "2": [0, 0.0]}}
    split = step_split(totals)
    assert split is not None
    assert split["plain"] == {"steps": 5, "rows_mean": pytest.approx(3.4),
                              "forward_ms_a_row": pytest.approx(400 / 17),
                              "forward_ms_by_rows": {"1": pytest.approx(80.0),
                                                     "4": pytest.approx(80.0)},
                              "steps_by_rows": {"1": 1, "4": 4}}
    assert step_line(split).endswith("; one token a row: 5 steps, forward 23.5 a row (3.4 rows)")
    # an older server's totals, or no such step: no such part
    assert "plain" not in step_split({**totals, "plain_by_rows": {}})
    assert "plain" not in step_split({k: v for k, v in totals.items() if k != "plain_by_rows"})


def test_one_token_steps_are_compared_with_the_server_alones_at_the_same_rows():
    from edgespec_cli.simulate.report import plain_step_ratio, step_split

    base = {"steps": 6, "wait_s": 0.0, "forward_s": 0.6, "commit_s": 0.0,
            "plain_by_rows": {"1": [2, 0.1], "4": [4, 0.4]}}  # 50 ms at 1 row, 100 at 4
    edge = {"steps": 9, "wait_s": 0.0, "forward_s": 1.0, "commit_s": 0.0,
            # 60 ms at 1 row, 120 at 4; 3 rows: no server-alone step to compare with
            "plain_by_rows": {"1": [1, 0.06], "4": [3, 0.36], "3": [5, 0.1]}}
    # priced at the edge's own counts: (60 + 3 x 120) / (50 + 3 x 100)
    assert plain_step_ratio(step_split(edge), step_split(base)) == pytest.approx(420 / 350)
    assert plain_step_ratio(step_split(edge), step_split({**base, "plain_by_rows": {}})) is None
    assert plain_step_ratio(step_split(edge), None) is None
