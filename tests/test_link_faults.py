"""Links that fail quietly, broken without killing a process: a TCP relay (``FaultyLink``)
between a drafter and the server, or an SDK client and the server, that blackholes, abandons,
resets, refuses or slows the link. gRPC keepalive (``edgespec.wire.keepalive``, set here to a
1 s ping with 1 s to answer) must notice each, the drafter must attach again, the SDK must
resume its call on a new connection, and every output must equal target-only decoding.

Without keepalive an abandoned connection is never noticed (the board waited on one for good):
the abandon tests fail then. No timing assertions: waits have generous bounds (``WAIT_S``)."""

from __future__ import annotations

import logging

import threading
import time

import pytest
from conftest import hf_greedy

import edgespec
from drafter_node.agent import DrafterAgent
from edgespec.config import EngineConfig
from edgespec.drafters import build_drafter
from edgespec_cli.deployment.link_faults import FaultyLink
from edgespec_cli.server import EdgespecServer, ServerOptions

pytestmark = pytest.mark.slow  # servers and threads: not the fast tier

WAIT_S = 60  # how long a test waits for what must happen (never a timing assertion)
PROMPT = [1, 20, 21, 22, 20, 21]  # the tiny model answers it with 35 tokens
N = 40


def eventually(cond, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture()
def fast_keepalive(monkeypatch):
    monkeypatch.setenv("EDGESPEC_KEEPALIVE_S", "1")
    monkeypatch.setenv("EDGESPEC_KEEPALIVE_TIMEOUT_S", "1")


def _server(tiny_dir, **engine):
    return EdgespecServer(ServerOptions(
        listen="127.0.0.1:0", model=str(tiny_dir), max_drafters=4, drain_timeout_s=5,
        dtype="float32",  # the reference is transformers' float32 greedy decoding
        engine=EngineConfig(max_sessions=4, max_context=256, **engine))).start()


@pytest.fixture()
def server(tiny_dir, fast_keepalive):
    srv = _server(tiny_dir)
    yield srv
    srv.stop(drain_timeout_s=0)


@pytest.fixture()
def waiting_server(tiny_dir, fast_keepalive):
    """Each step waits for the board's drafts: whether any are verified does not depend on
    how a loaded machine times the board against the steps."""
    srv = _server(tiny_dir, adaptive=False, draft_wait_ms=5000)
    yield srv
    srv.stop(drain_timeout_s=0)


@pytest.fixture(scope="module")
def reference(tiny):
    ref = hf_greedy(tiny.model, PROMPT, N)
    assert len(ref) >= 30  # long enough for faults to land mid-stream
    return ref


class Board:
    """A MaG drafter agent in this process whose link to the server goes through a relay."""

    def __init__(self, server: EdgespecServer, device_id: str):
        self.link = FaultyLink(f"127.0.0.1:{server.port}").start()
        self.agent = DrafterAgent(self.link.address, device_id, build_drafter("mag"),
                                  backoff_max_s=1.0)
        self.thread = threading.Thread(target=self.agent.run, daemon=True)
        self.thread.start()
        self.server, self.device_id = server, device_id

    def attached(self) -> bool:
        return (self.agent.connected.is_set()
                and self.server.store.devices.is_alive(self.device_id))

    def close(self) -> None:
        self.agent.stop()
        self.thread.join(WAIT_S)
        self.link.stop()
        assert not self.thread.is_alive()


def generate(address: str, **kw) -> edgespec.GenerateResult:
    with edgespec.Client(address, timeout=WAIT_S) as client:
        return client.generate(prompt_ids=PROMPT, max_new_tokens=N, temperature=0, **kw)


@pytest.mark.parametrize("fault", ["abandon", "blackhole", "reset", "refuse"])
def test_a_board_attaches_again_after_its_link_fails_quietly(waiting_server, reference, fault):
    server = waiting_server
    board = Board(server, "board-1")
    try:
        eventually(board.attached, "the first attach")
        attaches = board.agent.attaches
        board.link.apply(fault)
        if fault in ("blackhole", "refuse"):
            # the server's keepalive gives up on the silent board; the board's on the server
            eventually(lambda: not server.store.devices.is_alive("board-1"),
                       "the cache marking the silent board detached")
            board.link.heal()
        eventually(lambda: board.agent.attaches > attaches and board.attached(),
                   f"the board attaching again after {fault}")
        out = generate(f"127.0.0.1:{server.port}", device_id="board-1")
        assert out.token_ids == reference
        assert out.stats.get("num_drafts", 0) > 0  # drafted for again, not only decoded alone
    finally:
        board.close()


def test_a_slow_board_link_costs_no_output(server, reference):
    board = Board(server, "board-slow")
    try:
        eventually(board.attached, "the first attach")
        board.link.slow(0.05)
        out = generate(f"127.0.0.1:{server.port}", device_id="board-slow")
        assert out.token_ids == reference
        board.link.heal()
    finally:
        board.close()


@pytest.mark.parametrize("fault", ["abandon", "blackhole", "reset", "refuse", "slow"])
def test_an_sdk_stream_survives_its_link_failing(server, reference, fault, monkeypatch):
    """A client's link failing mid-stream: an abandoned or blackholed connection is noticed by
    keepalive, a reset or refused one at once, and the SDK resumes the session on a new
    connection (a blackhole or a refusal healed 4 s later), token for token; a slow link only
    slows it. Once the session has output, its steps wait for the fault: the rest of the
    answer cannot reach the first connection before the fault does, however the machine
    schedules the two."""
    engine, applied = server.scheduler.engine, threading.Event()
    score_rows = engine.target.score_rows

    def held(*a, **k):
        if not applied.is_set() and any(act.output for act in engine.active):
            applied.wait(WAIT_S)
        return score_rows(*a, **k)

    monkeypatch.setattr(engine.target, "score_rows", held)
    with FaultyLink(f"127.0.0.1:{server.port}") as link:
        got: list[int] = []
        with edgespec.Client(link.address, timeout=WAIT_S) as client:
            stream = client.stream(prompt_ids=PROMPT, max_new_tokens=N, temperature=0)
            try:
                for piece in stream:
                    got.extend(piece.token_ids)
                    if got and not applied.is_set():
                        assert len(got) < N and link.connections == 1
                        link.apply(fault, delay_s=0.02)
                        applied.set()
                        if fault in ("blackhole", "refuse", "slow"):
                            threading.Timer(4.0, link.heal).start()
            finally:
                applied.set()  # a failure here leaves no step held
        assert got == reference
        if fault != "slow":
            assert link.connections >= 2  # resumed on a new connection


def test_a_unary_generate_survives_an_abandoned_connection(server, reference):
    with FaultyLink(f"127.0.0.1:{server.port}") as link:
        with edgespec.Client(link.address, timeout=WAIT_S) as client:
            assert client.generate(prompt_ids=PROMPT, max_new_tokens=4).token_ids
            link.abandon()  # the idle connection is forgotten before the next call
            out = client.generate(prompt_ids=PROMPT, max_new_tokens=N, temperature=0)
        assert out.token_ids == reference and link.connections >= 2


def test_a_silent_board_is_not_waited_for_and_its_session_stays_lossless(server, reference):
    """A board that attached and then says nothing (its stream open: the cache still counts it
    alive) gets a pinned session: after MISSES_TO_LATE steps the verifier stops waiting for it,
    the session decodes on without drafts, its output is target-only's, and status and
    /metrics name the board as late."""
    import queue

    import grpc

    from edgespec.engine.lateness import MISSES_TO_LATE
    from edgespec.v1 import edgespec_pb2 as pb
    from edgespec.v1 import edgespec_pb2_grpc as pb_grpc

    address = f"127.0.0.1:{server.port}"
    with grpc.insecure_channel(address) as ch:
        outbox: queue.Queue = queue.Queue()
        outbox.put(pb.DrafterMessage(register=pb.Register(device_id="silent", max_sessions=4)))
        attach = pb_grpc.DraftCacheStub(ch).Attach(iter(outbox.get, None), timeout=WAIT_S * 2)
        assert next(attach).HasField("registered")
        try:
            out = generate(address, device_id="silent")
            assert out.token_ids == reference
            with edgespec.Client(address, timeout=WAIT_S) as client:
                silent = next(d for d in client.status()["drafters"]
                              if d["device_id"] == "silent")
            assert silent["late"] is True, str(silent)
            assert int(silent["drafts_missed"]) >= MISSES_TO_LATE
            assert int(silent["steps_unwaited"]) >= 1
            registry = server.registry
            assert registry.get_sample_value("edgespec:drafter_late", {"device": "silent"}) == 1
            assert registry.get_sample_value("edgespec:drafter_unwaited_steps_total",
                                             {"device": "silent"}) >= 1
        finally:
            outbox.put(None)
            attach.cancel()


@pytest.fixture()
def heartbeat_only(monkeypatch, tiny_dir):
    """A server whose keepalive pings are off in effect (an hour), so that only the Attach
    stream's application heartbeat (0.3 s) can notice a silent link: what a proxy between the
    board and the cache that answers pings itself leaves."""
    monkeypatch.setenv("EDGESPEC_KEEPALIVE_S", "3600")
    monkeypatch.setenv("EDGESPEC_KEEPALIVE_TIMEOUT_S", "3600")
    monkeypatch.setenv("EDGESPEC_HEARTBEAT_S", "0.3")
    # each step waits for the board's drafts (whether any are verified does not depend on how
    # a loaded machine times the board against the steps)
    srv = _server(tiny_dir, adaptive=False, draft_wait_ms=5000)
    yield srv
    srv.stop(drain_timeout_s=0)


def test_the_attach_heartbeat_notices_a_silent_link_without_keepalive(heartbeat_only, reference,
                                                                     caplog):
    caplog.set_level(logging.WARNING, logger="edgespec.drafter")
    server = heartbeat_only
    board = Board(server, "board-hb")
    try:
        eventually(board.attached, "the first attach")
        attaches = board.agent.attaches
        board.link.blackhole()
        eventually(lambda: not server.store.devices.is_alive("board-hb"),
                   "the cache detaching the board it hears nothing from")
        board.link.heal()
        eventually(lambda: board.agent.attaches > attaches and board.attached(),
                   "the board attaching again after its heartbeat went unanswered")
        # the board says why it lost the link (its own watch's silence, or the cache's reason
        # where the healed link brought that first), never the CANCELLED its own cancel raised
        lost = [r.getMessage() for r in caplog.records if "lost (" in r.getMessage()]
        assert lost and all("heard nothing from" in m for m in lost), lost
        out = generate(f"127.0.0.1:{server.port}", device_id="board-hb")
        assert out.token_ids == reference and out.stats.get("num_drafts", 0) > 0
    finally:
        board.close()


@pytest.mark.parametrize("text,want", [
    ("blackhole@20+10", [("blackhole", 20.0, 10.0, "drafters", None)]),
    ("abandon@40:clients/0, slow@5.5+2:all", [("abandon", 40.0, 0.0, "clients", 0),
                                             ("slow", 5.5, 2.0, "all", None)]),
    ("", [])])
def test_partition_schedules_parse(text, want):
    from edgespec_cli.deployment.link_faults import parse_fault_schedule

    got = [(f.fault, f.at_s, f.for_s, f.links, f.device) for f in parse_fault_schedule(text)]
    assert got == want


@pytest.mark.parametrize("text,message", [
    ("flood@1", "not one of"), ("blackhole@1", "needs \\+DURATION"), ("reset", "not FAULT@"),
    ("reset@x", "not FAULT@"), ("reset@1:boards", "not drafters, clients or all"),
    ("reset@-1", ">= 0"), ("abandon@1+5", "an instant")])
def test_bad_partition_schedules_are_refused_with_the_reason(text, message):
    from edgespec.config import ConfigError
    from edgespec_cli.deployment.link_faults import parse_fault_schedule

    with pytest.raises(ConfigError, match=message):
        parse_fault_schedule(text)


def _schedule_run(batching: str, schedule: str):
    """A simulate run's fault schedule with the links' side recorded, not applied (no Ray):
    the run's ``_set_fault`` calls and its progress lines."""
    import shutil
    from types import SimpleNamespace

    from edgespec_cli.deployment.link_faults import parse_fault_schedule
    from edgespec_cli.simulate.run import FleetRun

    said: list[str] = []
    run = FleetRun(None, SimpleNamespace(link_faults=parse_fault_schedule(schedule)),
                   [None, None], batching, [], progress=said.append)
    shutil.rmtree(run._tmp, ignore_errors=True)
    calls: list[tuple] = []
    run._set_fault = lambda dev, links, fault: calls.append((dev, links, fault))
    return run, calls, said


def test_the_server_only_run_breaks_its_clients_links_alone():
    """The server alone has no board: ``all`` breaks the clients' links (recorded so), and a
    drafters' fault breaks and records nothing, said in the progress."""
    run, calls, said = _schedule_run("server-only", "reset@0:all,blackhole@0+1:drafters")
    run._break_links(time.monotonic() - 100, threading.Event())
    assert calls == [(0, "clients", "reset"), (1, "clients", "reset")]
    assert [(a["fault"], a["links"]) for a in run._applied] == [("reset", "clients")]
    assert any("no board's link in this run" in s for s in said)


def test_a_heal_ends_its_own_fault_not_one_of_the_same_kind_on_other_links():
    run, calls, _ = _schedule_run("on", "blackhole@0+1:drafters,blackhole@0+1000:all")
    done = threading.Event()
    breaker = threading.Thread(target=run._break_links, args=(time.monotonic() - 100, done))
    breaker.start()
    try:  # the drafters' heal (due) comes before the wait for the other's (900 s away)
        deadline = time.monotonic() + 60
        while (len(run._applied) < 2 or run._applied[0]["healed_at_s"] is None) and \
                time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        done.set()
        breaker.join(10)
    assert [(a["links"], a["healed_at_s"] is not None) for a in run._applied] == [
        ("drafters", True), ("all", False)]
    assert (0, "drafters", None) in calls and (0, "all", None) not in calls


def test_a_boards_watch_says_why_it_drops_a_silent_stream():
    """The board's heartbeat watch cancels a stream the cache has been silent on for three
    of the cache's intervals, and keeps why (``gave_up``), which the agent logs as the lost
    link's reason in place of the CANCELLED its own cancel raises."""
    import queue

    from drafter_node.liveness import Liveness
    from edgespec.v1 import edgespec_pb2 as pb

    cancelled = threading.Event()
    call = type("Call", (), {"cancel": lambda self: cancelled.set()})()
    link = Liveness(call, queue.Queue(), 0.1, "cache:1")
    try:
        assert link.gave_up is None
        link.heard(pb.CacheMessage(registered=pb.Registered(heartbeat_ms=100)))
        assert cancelled.wait(WAIT_S)  # (three 0.1 s intervals: at least 1 s of silence)
        assert link.gave_up is not None
        assert link.gave_up.startswith("heard nothing from the cache at cache:1 for ")
    finally:
        link.stop()
