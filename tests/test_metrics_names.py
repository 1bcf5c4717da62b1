"""The metrics of the three roles against the dashboard and the scrape config that read them:
every metric name the Grafana dashboard's PromQL names is exposed by one of the metrics classes,
names do not collide and labels stay bounded; what the verifier's and a board's metrics count
and how ``edgespec status`` renders them. What crosses a real link: ``test_link_metrics``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from cache_service.metrics import CacheMetrics
from drafter_node.metrics import DrafterMetrics
from edgespec.engine.lateness import DrafterLink
from verifier_node.metrics import VerifierMetrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "edgespec.json"
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus.yml"
NAME = re.compile(r"edgespec:[a-zA-Z0-9_:]+")  # a metric name (e2e has digits)


def value(registry, name, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def dashboard_queries(dash: dict) -> list[str]:
    """Every PromQL text of the dashboard: panel targets (rows' nested panels included) and
    templating queries."""
    out = []

    def panels(ps):
        for p in ps:
            out.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            panels(p.get("panels", []))

    panels(dash["panels"])
    for v in dash["templating"]["list"]:
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if v.get("type") == "query" and q:
            out.append(q)
    return out


def exposed_sample_names() -> set[str]:
    """Sample names of the three roles' metrics in one registry, each labelled metric touched
    once so that its series exist."""
    registry = CollectorRegistry()
    objs = [VerifierMetrics(registry), CacheMetrics(registry), DrafterMetrics(registry)]
    objs[0].bind_links(lambda: {"x": DrafterLink(late=True, missed=3)})  # read at scrape time
    for obj in objs:
        for m in vars(obj).values():
            if isinstance(m, MetricWrapperBase) and m._labelnames:
                m.labels(*["x"] * len(m._labelnames))
    text = generate_latest(registry).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_every_metric_the_dashboard_reads_is_exposed():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 36 and dash["uid"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert "label_values(edgespec:device_draft_tokens_total, device)" in \
        json.dumps(variables["device"]["query"])
    queries = dashboard_queries(dash)
    assert len(queries) > 20
    exposed = exposed_sample_names()
    used = {name for q in queries for name in NAME.findall(q)}
    assert all(NAME.search(q) for q in queries), "a query reads no edgespec metric"
    missing = sorted(used - exposed)
    assert not missing, f"the dashboard reads metrics nobody exposes: {missing}"
    # every panel reads its data from the dashboard's data source variable
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
    # the panels the operators asked for are there
    for name in ("edgespec:generation_tokens_total", "edgespec:device_accepted_tokens_total",
                 "edgespec:device_drafts_total", "edgespec:time_to_first_token_seconds_bucket",
                 "edgespec:inter_token_latency_seconds_bucket",
                 "edgespec:e2e_request_latency_seconds_bucket",
                 "edgespec:batch_size_sessions_bucket", "edgespec:batch_size_tokens_bucket",
                 "edgespec:step_seconds_bucket", "edgespec:num_requests_running",
                 "edgespec:num_requests_waiting", "edgespec:kv_slots_free",
                 "edgespec:drafters_attached", "edgespec:drafter_link_rtt_seconds_bucket",
                 "edgespec:drafter_chunks_sent_total"):
        assert name in used, name


def test_scrape_config_has_the_three_roles():
    cfg = yaml.safe_load(SCRAPE_CONFIG.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"edgespec-verifier", "edgespec-cache", "edgespec-drafters"}
    for job in jobs.values():
        assert job["metrics_path"] == "/metrics"
        assert all(re.fullmatch(r"[\w.-]+:\d+", t)
                   for sc in job["static_configs"] for t in sc["targets"])


def test_metric_names_do_not_collide_and_labels_stay_bounded():
    registry = CollectorRegistry()  # registering all three in one registry raises on a clash
    VerifierMetrics(registry), CacheMetrics(registry), DrafterMetrics(registry)
    m = CacheMetrics(CollectorRegistry())
    m.chunk_refused(grpc.StatusCode.FAILED_PRECONDITION)
    m.chunk_refused("not a code")
    codes = {s.labels["code"] for fam in m.chunks.collect() for s in fam.samples}
    assert codes <= {c.name for c in grpc.StatusCode} | {"UNKNOWN"}
    d = DrafterMetrics(CollectorRegistry())
    d.ack_received("s", 1, 12345)  # a code no gRPC status has
    from drafter_node.metrics import REFUSAL_CODES  # the series there from the start, at 0

    assert {s.labels["code"] for fam in d.refused.collect() for s in fam.samples} == \
        {"UNKNOWN", *REFUSAL_CODES}
    from cache_service.metrics import MAX_DEVICE_LABELS

    for i in range(MAX_DEVICE_LABELS + 50):  # drafters attaching under ever new ids
        m.attach(f"board-{i}")
    devices = {s.labels["device"] for fam in m.attaches.collect() for s in fam.samples}
    assert len(devices) == MAX_DEVICE_LABELS + 1 and "other" in devices


def test_link_rtt_matches_acks_to_chunks_by_session_and_start():
    reg = CollectorRegistry()
    d = DrafterMetrics(reg)
    timed = lambda: value(reg, "edgespec:drafter_link_rtt_seconds_count")  # noqa: E731
    d.chunk_sent("s1", 3, 2)
    d.chunk_sent("s1", 3, 0)  # an idle chunk at the same position: timed on its own
    d.chunk_sent("s2", 3, 4)
    d.ack_received("s9", 3, 0)  # not ours
    d.ack_received("s1", 3, 0)
    d.ack_received("s1", 3, 0)
    d.ack_received("s1", 3, 0)  # one more than sent
    assert timed() == 2
    d.link_lost()
    d.ack_received("s2", 3, 0)  # in flight when the link dropped: not timed
    assert timed() == 2
    assert value(reg, "edgespec:drafter_chunks_sent_total") == 3
    assert value(reg, "edgespec:drafter_draft_tokens_total") == 6


def test_cuda_graph_state_is_exposed_and_rendered():
    """The runner's CUDA graphs on /metrics (only where there are graphs) and in
    ``edgespec status``: captured, or failed and served eagerly."""
    from edgespec.runner.step_graphs import GraphState
    from edgespec_cli.status import render

    state: list = [None]
    m = VerifierMetrics(CollectorRegistry())
    m.bind_graphs(lambda: state[0])
    assert "edgespec:cuda_graphs_captured" not in generate_latest(m.registry).decode()
    state[0] = GraphState(buckets=56, captured=0, capture_s=0.4, failed="bucket (64, 16): OOM",
                          replays=0, memory_mb=0.0)
    text = generate_latest(m.registry).decode()
    assert "edgespec:cuda_graph_buckets 56.0" in text
    assert "edgespec:cuda_graphs_failed 1.0" in text
    state[0] = GraphState(56, 56, 2.5, None, 7, 32.0)
    text = generate_latest(m.registry).decode()
    assert "edgespec:cuda_graphs_captured 56.0" in text
    assert "edgespec:cuda_graphs_failed 0.0" in text
    assert "edgespec:cuda_graph_replays_total 7.0" in text
    base = {"model": "m", "version": "v", "healthy": True, "active_sessions": 0,
            "queued_sessions": 0, "free_kv_slots": 1, "kv_slots": 1,
            "tokens_per_s_last_minute": 0.0, "drafters": []}
    ok = render(dict(base, runner={"device": "cuda", "kernels": "triton", "graph_buckets": 56,
                                   "graphs_captured": 56, "graphs_capture_s": 2.5,
                                   "graph_replays": "7"}))
    assert "runner: triton kernels on cuda, CUDA graphs 56/56 captured in 2.5 s, 7 steps" in ok
    failed = render(dict(base, runner={"device": "cuda", "kernels": "triton",
                                       "graph_buckets": 56, "graphs_failed": "OOM"}))
    assert "CUDA graphs FAILED (steps run eagerly): OOM" in failed
    # the attention kernel the start probe left (the rows one where the tiles vary)
    rows = render(dict(base, runner={"device": "cuda", "kernels": "triton", "attention": "rows"}))
    assert "runner: triton kernels (rows attention) on cuda, no CUDA graphs" in rows


def test_the_servers_cpu_seconds_are_exposed_and_grow_with_work():
    reg = CollectorRegistry()
    VerifierMetrics(reg)
    before = value(reg, "edgespec:server_cpu_seconds_total")
    assert before > 0
    x = 0
    for i in range(3_000_000):  # about a CPU second's tenth of work
        x += i
    assert value(reg, "edgespec:server_cpu_seconds_total") > before


def test_the_servers_cost_since_start_is_counted_and_rendered():
    """``edgespec status``'s cost line: CPU ms a committed token, tokens a forward, draft
    tokens verified and wasted, from the verifier's step and token counts."""
    from types import SimpleNamespace

    from edgespec_cli.status import render

    m = VerifierMetrics(CollectorRegistry())
    for drafted, accepted in ((4, 3), (4, 0)):
        m.step(SimpleNamespace(sessions=2, take_s=0.0, forward_s=0.01, commit_s=0.0,
                               tokens=2 + drafted, drafts=1, drafted=drafted,
                               accepted=accepted, accepted_per_pos=[], drafted_per_pos=[],
                               rested=False, ran_ahead=False))
    m.tokens(4, None, 0.1)
    m.tokens(2, 0.05, 0.2)
    cost = m.server_cost()
    assert cost["cpu_s"] > 0
    assert {k: v for k, v in cost.items() if k != "cpu_s"} == {
        "committed_tokens": 6, "forwards": 2, "draft_tokens": 8, "accepted_tokens": 3}
    base = {"model": "m", "version": "v", "healthy": True, "active_sessions": 0,
            "queued_sessions": 0, "free_kv_slots": 1, "kv_slots": 1,
            "tokens_per_s_last_minute": 0.0, "drafters": []}
    text = render(dict(base, cost={"cpu_s": 0.3, "committed_tokens": "6", "forwards": "2",
                                   "draft_tokens": "8", "accepted_tokens": "3"}))
    assert ("server cost since start: 50.0 CPU ms a committed token, 3.00 tokens a forward "
            "(6 tokens in 2 forwards); draft tokens verified 8, wasted 5 (62%)") in text
    assert "server cost" not in render(dict(base, cost={"committed_tokens": "0"}))


def test_each_boards_share_of_the_steps_waits_is_exposed():
    m = VerifierMetrics(CollectorRegistry())
    m.bind_links(lambda: {"board-1": DrafterLink(waited_s=1.5, session_steps=4, ready_drafts=3,
                                                 verified_drafts=2, empty_opening=1,
                                                 empty_after_fix=5, empty_again=3,
                                                 empty_other=7)})
    assert value(m.registry, "edgespec:drafter_waited_seconds_total", device="board-1") == 1.5
    assert value(m.registry, "edgespec:drafter_verified_drafts_total", device="board-1") == 2
    assert [value(m.registry, "edgespec:drafter_empty_drafts_total", device="board-1", after=a)
            for a in ("opening", "fix", "again", "other")] == [1, 5, 3, 7]


def test_acceptance_by_position_is_counted_out_of_the_drafts_that_reached_it():
    """Three sessions' verdicts in one step: drafts of 3, 2 and 0 tokens, 2, 0 and 0 of them
    accepted: positions 0 and 1 were held by two drafts, position 2 by one; accepted were
    position 0 and 1 of the first draft."""
    from edgespec.engine.step_report import step_report

    report = step_report([2, 0, 0], [3, 2, 0], sessions=3, tokens=8, take_s=0.0,
                         forward_s=0.0, commit_s=0.0)
    assert report.drafted_per_pos == (2, 2, 1) and report.accepted_per_pos == (1, 1)
    m = VerifierMetrics(CollectorRegistry())
    m.step(report)
    drafted = [value(m.registry, "edgespec:spec_decode_num_drafted_tokens_per_pos_total",
                     position=str(i)) for i in range(4)]
    accepted = [value(m.registry, "edgespec:spec_decode_num_accepted_tokens_per_pos_total",
                      position=str(i)) for i in range(4)]
    assert (drafted, accepted) == ([2, 2, 1, 0], [1, 1, 0, 0])
    # a tree counts by depth: a chain of 3 with a 2-token branch at 1 holds positions 0-2
    from edgespec.engine.proposals import StepDraft
    from edgespec.protocol.contract import Branch

    tree = StepDraft(None, 0, 5, (7, 8, 9), (Branch(1, (4, 5)),))  # type: ignore[arg-type]
    assert (tree.drafted, tree.depth) == (5, 3)
    report = step_report([3], [tree.drafted], sessions=1, tokens=6, take_s=0.0, forward_s=0.0,
                         commit_s=0.0, depths=[tree.depth])
    assert report.drafted_per_pos == (1, 1, 1) and report.accepted_per_pos == (1, 1, 1)
    import random

    rng = random.Random(2)
    for _ in range(200):  # any step's rows: position i counts the lengths past it
        drafted = [rng.randint(0, 12) for _ in range(rng.randint(0, 40))]
        report = step_report([rng.randint(0, d) for d in drafted], drafted, len(drafted), 0,
                             0.0, 0.0, 0.0)
        assert report.drafted_per_pos == tuple(
            sum(1 for d in drafted if d > i) for i in range(max(drafted, default=0)))


def test_a_board_past_the_device_labels_keeps_its_own_figures_in_status():
    """Past the first MAX_DEVICES boards the device series are summed under "other" (bounded
    labels), but the Status RPC's per-board acceptance still reads each board's own counts, and
    the steps' per-board link series sum the rest under "other" rather than drop them."""
    from prometheus_client import generate_latest

    from edgespec.engine.lateness import Lateness
    from edgespec.protocol.request_stats import Stats
    from verifier_node.metric_collectors import MAX_DEVICES, LinkCollector

    m = VerifierMetrics(CollectorRegistry())
    stats = Stats(num_drafts=2, draft_tokens=8, accepted_tokens=5, drafter_drafts=2,
                  drafter_tokens=8, drafter_accepted=5)
    for i in range(MAX_DEVICES):
        m.finished(f"board-{i}", stats, "length", 1.0)
    m.finished("board-new", stats, "length", 1.0)
    m.finished("board-new", stats, "length", 1.0)
    assert m.device_draft_counts("board-new") == (4, 16, 10)  # its own, not 0
    assert m.device_draft_counts("board-0") == (2, 8, 5)
    text = generate_latest(m.registry).decode()
    assert 'edgespec:device_accepted_tokens_total{device="other"} 10.0' in text
    assert 'device="board-new"' not in text

    book = Lateness(misses_to_late=1)
    for i in range(MAX_DEVICES + 3):
        book.record(f"board-{i}", ready=i < MAX_DEVICES + 1, waited=True, sessions=(1, 1, 1))
    reg = CollectorRegistry()
    reg.register(LinkCollector(book.snapshot, m.device_labels))  # the same labels' rule
    text = generate_latest(reg).decode()
    assert 'edgespec:drafter_session_steps_total{device="other"} 3.0' in text
    assert 'edgespec:drafter_late{device="other"} 2.0' in text  # two of the three missed
    assert f'edgespec:drafter_session_steps_total{{device="board-{MAX_DEVICES - 1}"}} 1.0' \
        in text


def test_a_boards_series_are_all_its_own_or_all_other_and_other_never_falls(monkeypatch):
    """One labelling rule for the finished sessions' and the steps' series; a board summed
    under "other" that the steps' table later forgets keeps its counts there (a counter that
    fell would read as a reset)."""
    from prometheus_client import generate_latest

    import edgespec.engine.lateness as lateness
    from edgespec.engine.lateness import Lateness
    from edgespec.protocol.request_stats import Stats
    from verifier_node.metric_collectors import DeviceLabels, LinkCollector

    monkeypatch.setattr(lateness, "MAX_TRACKED", 4)  # the steps' table forgets the oldest
    m = VerifierMetrics(CollectorRegistry())
    m.device_labels = labels = DeviceLabels(cap=2)
    stats = Stats(num_drafts=1, draft_tokens=2, accepted_tokens=1, drafter_drafts=1,
                  drafter_tokens=2, drafter_accepted=1)
    m.finished("b", stats, "length", 1.0)  # "b" finishes a session first: labelled
    book = Lateness()
    reg = CollectorRegistry()
    reg.register(LinkCollector(book.snapshot, labels))

    def steps(device: str) -> float | None:
        for fam in reg.collect():
            for sample in fam.samples:
                if sample.name == "edgespec:drafter_session_steps_total" and \
                        sample.labels["device"] == device:
                    return sample.value
        return None

    for device in ("a", "b", "c", "d"):
        book.record(device, ready=True, waited=True, sessions=(10, 10, 10))
    # "b" labelled by its session, "a" the first the steps show; "c" and "d" summed
    assert (steps("a"), steps("b"), steps("c"), steps("d"), steps("other")) == \
        (10.0, 10.0, None, None, 20.0)
    for device in ("e", "f", "g"):  # the table forgets "a", "b", then "c" (one of "other")
        book.record(device, ready=True, waited=True, sessions=(1, 1, 1))
    assert steps("a") is None and steps("b") is None
    assert steps("other") == 23.0  # "c"'s 10 kept, "d"'s 10, and 1 each of "e", "f", "g"
    text = generate_latest(m.registry).decode()
    assert 'edgespec:device_accepted_tokens_total{device="b"} 1.0' in text


def test_rested_steps_are_counted_in_metrics_and_the_step_totals():
    from dataclasses import replace

    from edgespec.engine.step_report import step_report

    report = step_report([0, 0], [0, 0], sessions=2, tokens=2, take_s=0.0, forward_s=0.01,
                         commit_s=0.0)
    m = VerifierMetrics(CollectorRegistry())
    m.step(report)  # a step that drafted (or had nothing to draft): not rested
    m.step(replace(report, rested=True))
    m.step(replace(report, rested=True, ran_ahead=True))
    assert value(m.registry, "edgespec:rested_steps_total") == 2
    assert value(m.registry, "edgespec:steps_run_ahead_total") == 1
    assert m.step_totals["rested"] == 2 and m.step_totals["steps"] == 3


def test_steps_of_one_token_a_row_are_counted_by_rows():
    from edgespec.engine.step_report import step_report

    m = VerifierMetrics(CollectorRegistry())
    plain = step_report([0, 0], [0, 0], sessions=2, tokens=2, take_s=0.0, forward_s=0.01,
                        commit_s=0.0)
    for _ in range(3):
        m.step(plain)
    # a step that verified a draft is not one; nor is one that only delivered an earlier
    # step's verdicts (no forward ran)
    m.step(step_report([1], [3], sessions=1, tokens=4, take_s=0.0, forward_s=0.5, commit_s=0.0))
    m.step(step_report([0], [0], sessions=1, tokens=1, take_s=0.0, forward_s=0.0, commit_s=0.1))
    m.step(step_report([0], [0], sessions=1, tokens=1, take_s=0.0, forward_s=0.2, commit_s=0.0))
    assert m.plain_by_rows == {2: [3, pytest.approx(0.03)], 1: [1, 0.2]}


def test_a_boards_acceptance_is_shown_once_one_of_its_sessions_ended():
    """``edgespec status``'s acceptance columns: counted as a board's sessions end, so a
    board none of whose sessions has ended shows no figure ("-"), not an acceptance of 0."""
    from edgespec_cli.status import render

    base = {"model": "m", "version": "v", "healthy": True, "active_sessions": 1,
            "queued_sessions": 0, "free_kv_slots": 1, "kv_slots": 2,
            "tokens_per_s_last_minute": 0.0}
    board = {"device_id": "b1", "draft_model": "mag", "attached": True, "sessions": 1,
             "max_sessions": 4, "acceptance_rate": 0.0, "mean_acceptance_length": 1.0,
             "last_seen_s": 0.0}
    fresh = render(dict(base, drafters=[board])).splitlines()[-1].split()
    assert fresh[:6] == ["b1", "mag", "yes", "1/4", "-", "-"]
    ended = dict(board, acceptance_rate=0.5, mean_acceptance_length=2.5, finished_drafts="3")
    assert render(dict(base, drafters=[ended])).splitlines()[-1].split()[4:6] == ["0.50",
                                                                                 "2.50"]
    # an older server (or a router pooling older replicas) says no finished_drafts: its
    # figures are read as they are
    older = dict(board, acceptance_rate=0.5, mean_acceptance_length=2.5, finished_drafts=0)
    assert render(dict(base, drafters=[older])).splitlines()[-1].split()[4:6] == ["0.50",
                                                                                 "2.50"]


def test_each_board_of_a_session_handed_over_is_credited_with_its_own_drafts():
    """A finished session's board figures split over the boards it had: each earlier one its
    share as the hand-over found it (a boardless start counts for no board), the last the
    rest."""
    from edgespec.protocol.request_stats import Stats

    reg = CollectorRegistry()
    m = VerifierMetrics(reg)
    stats = Stats(num_drafts=6, drafter_drafts=5, drafter_tokens=20, drafter_accepted=12,
                  fill_tokens=3, fill_accepted=1)
    m.finished("b2", stats, "length", 1.0, [("", (0, 0, 0, 0, 0)), ("b1", (2, 8, 5, 1, 0))])
    assert m.device_draft_counts("b1") == (2, 8, 5)
    assert m.device_draft_counts("b2") == (3, 12, 7)
    assert value(reg, "edgespec:fill_draft_tokens_total", device="b1") == 1
    assert value(reg, "edgespec:fill_draft_tokens_total", device="b2") == 2
    m.finished("b3", stats, "length", 1.0)  # never handed over: all its own
    assert m.device_draft_counts("b3") == (5, 20, 12)
