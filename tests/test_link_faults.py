"""Links that fail quietly, broken without killing a process: a TCP relay (``FaultyLink``)
between a drafter and the server, or an SDK client and the server, that blackholes, abandons,
resets, refuses or slows the link. gRPC keepalive (``edgespec.wire.keepalive``, set here to a
1 s ping with 1 s to answer) must notice each, the drafter must attach again, the SDK must
resume its call on a new connection, and every output must equal target-only decoding.

Without keepalive an abandoned connection is never noticed (the board waited on one for good):
the abandon tests fail then. No timing assertions: waits have generous bounds (``WAIT_S``)."""

from __future__ import annotations

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
def test_an_sdk_stream_survives_its_link_failing(server, reference, fault):
    """A client's link failing mid-stream: an abandoned or blackholed connection is noticed by
    keepalive, a reset or refused one at once, and the SDK resumes the session on a new
    connection (a blackhole or a refusal healed 4 s later), token for token; a slow link only
    slows it."""
    with FaultyLink(f"127.0.0.1:{server.port}") as link:
        got: list[int] = []
        with edgespec.Client(link.address, timeout=WAIT_S) as client:
            stream = client.stream(prompt_ids=PROMPT, max_new_tokens=N, temperature=0)
            for piece in stream:
                got.extend(piece.token_ids)
                if got and link.connections == 1 and link.mode == "pass" and len(got) < N:
                    link.apply(fault, delay_s=0.02)
                    if fault in ("blackhole", "refuse", "slow"):
                        threading.Timer(4.0, link.heal).start()
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


# -- a late drafter costs only its own sessions --------------------------------------------------
def test_lateness_marks_a_drafter_late_after_missed_deadlines_and_waits_again_once_on_time():
    from edgespec.engine.lateness import HITS_TO_RECOVER, MISSES_TO_LATE, Lateness

    book = Lateness()
    for _ in range(MISSES_TO_LATE - 1):
        book.record("b", ready=False, waited=True)
    assert not book.late("b")
    book.record("b", ready=True, waited=True)  # an on-time step breaks the run
    for _ in range(MISSES_TO_LATE):
        book.record("b", ready=False, waited=True)
    assert book.late("b") and not book.late("other")
    book.record("b", ready=False, waited=False)  # still missing while not waited for
    for _ in range(HITS_TO_RECOVER):
        assert book.late("b")
        book.record("b", ready=True, waited=False)
    assert not book.late("b")
    link = book.snapshot()["b"]
    assert (link.missed, link.unwaited, link.marked_late) == (2 * MISSES_TO_LATE, 3, 1)


def test_a_late_drafter_is_waited_for_again_every_few_steps():
    """While late, a drafter is not waited for, except every PROBE_EVERY-th step: a drafter
    whose drafts need the wait (a slow link that healed) is found on time there and recovers."""
    from edgespec.engine.lateness import HITS_TO_RECOVER, MISSES_TO_LATE, PROBE_EVERY, Lateness

    book = Lateness()
    for _ in range(MISSES_TO_LATE):
        book.record("b", ready=False, waited=True)
    waits = []
    for _ in range(2 * PROBE_EVERY):
        skipped = book.not_waited_for({"b", "fine"})
        assert "fine" not in skipped
        waits.append("b" not in skipped)
        book.record("b", ready=False, waited="b" not in skipped)  # still missing
    assert waits.count(True) == 2 and waits[PROBE_EVERY - 1] and book.late("b")
    for _ in range(HITS_TO_RECOVER * PROBE_EVERY):  # on time only when waited for
        waited = "b" not in book.not_waited_for({"b"})
        book.record("b", ready=waited, waited=waited)
    assert not book.late("b")
    assert Lateness(misses_to_late=0).not_waited_for({"b"}) == set()


def test_a_session_asked_no_draft_says_nothing_of_its_board(tiny):
    """A step that asks a session for no draft (the planner found drafting does not pay) takes
    its empty draft as trivially ready: that must not count its board on time (a silent board
    would recover from late at once) nor as not waited for."""
    from edgespec.config import EngineConfig
    from edgespec.engine.spec_engine import Request, SpecEngine
    from edgespec.protocol.contract import DraftWant, TakenDraft
    from edgespec.runner.target_runner import TargetRunner

    with SpecEngine(TargetRunner(tiny.model, n_slots=2, max_len=64), None,
                    EngineConfig()) as engine:
        act = engine.add(Request([1, 5, 6], 4))
        act.drafter = "board"
        acts = {act.sid: act}
        engine._record_lateness([DraftWant(act.sid, 0, wait=False)],
                                [TakenDraft(0, act.end, [])], acts, 0.5)
        assert "board" not in engine.lateness.snapshot()
        engine._record_lateness([DraftWant(act.sid, 2, wait=True)],
                                [TakenDraft(0, act.end, [], ready=False)], acts, 0.5)
        link = engine.lateness.snapshot()["board"]
        assert (link.session_steps, link.missed, link.unwaited, link.waited_s) == (1, 1, 0, 0.5)


def test_a_boards_empty_drafts_are_counted_by_what_came_before(tiny):
    """A session step asked for a board's draft that held none counts as the session's opening
    (no draft of the board's held tokens yet), again (the step before got none either), after a
    fix (the step before verified one and its commit sent a fix), or otherwise; a draft holding
    tokens, or a session asked nothing, counts in none of them."""
    from edgespec.config import EngineConfig
    from edgespec.engine.spec_engine import Request, SpecEngine
    from edgespec.protocol.contract import DraftWant, TakenDraft
    from edgespec.runner.target_runner import TargetRunner

    with SpecEngine(TargetRunner(tiny.model, n_slots=2, max_len=64), None,
                    EngineConfig()) as engine:
        act = engine.add(Request([1, 5, 6], 4))
        act.drafter = "board"
        acts = {act.sid: act}

        def step(k: int, tokens: list[int], fixed: bool = False) -> tuple[int, int, int, int]:
            act.fixed = fixed  # what the commit before this step told
            engine._record_lateness([DraftWant(act.sid, k, wait=True)],
                                    [TakenDraft(0, act.end, tokens, ready=False)], acts, 0.0)
            link = engine.lateness.snapshot()["board"]
            return link.empty_opening, link.empty_after_fix, link.empty_again, link.empty_other

        assert step(2, []) == (1, 0, 0, 0)  # the board's drafts held nothing yet
        assert step(2, [], fixed=True) == (2, 0, 0, 0)  # still opening
        assert step(2, [7]) == (2, 0, 0, 0)  # a draft: not empty; the session is open
        assert step(2, [], fixed=True) == (2, 1, 0, 0)
        assert step(2, [], fixed=True) == (2, 1, 1, 0)  # a run of empty drafts
        assert step(0, []) == (2, 1, 1, 0)  # asked nothing: says nothing
        assert step(2, [7, 8]) == (2, 1, 1, 0)
        assert step(2, []) == (2, 1, 1, 1)  # the draft held the step's token: no fix


def test_a_commit_tells_its_session_whether_its_drafter_was_sent_a_fix(tiny):
    """``ActiveSession.fixed`` follows the store's commit outcome: set by a commit that
    rejected the board's draft, cleared by one the draft held (its next token the step's own),
    and the output is target-only's either way."""
    from edgespec.config import EngineConfig
    from edgespec.engine.spec_engine import Request, SpecEngine
    from edgespec.runner.target_runner import TargetRunner

    prompt = [1, 5, 6, 9, 4]
    with SpecEngine(TargetRunner(tiny.model, n_slots=2, max_len=96), None,
                    EngineConfig()) as engine:
        want = engine.generate(Request(list(prompt), 30)).token_ids
    with SpecEngine(TargetRunner(tiny.model, n_slots=2, max_len=96), None,
                    EngineConfig(draft_wait_ms=0)) as engine:
        act = engine.add(Request(list(prompt), 30), device="board")
        state = engine.store.sessions[act.sid]
        wrong = (want[0] + 1) % tiny.model.config.vocab_size
        state.push_draft(state.epoch, state.end, [wrong] + want[1:4], idle=True)
        engine.step()
        assert act.fixed and act.output == want[:1]
        state.push_draft(state.epoch, state.end, want[1:14], idle=True)  # more than a step takes
        engine.step()
        assert not act.fixed and act.output == want[:len(act.output)] and len(act.output) > 2


def test_a_late_boards_turn_to_be_waited_for_comes_on_a_step_that_asks_it(tiny, monkeypatch):
    """A late board is waited for on every PROBE_EVERY-th step that asks it for drafts: steps
    planned without drafts do not spend its turn (else, a planner probing every 8th step and a
    turn every 8th step might never meet, and a board that is back would never be waited for)."""
    from edgespec.config import EngineConfig
    from edgespec.engine import step_drafts
    from edgespec.engine.lateness import MISSES_TO_LATE, PROBE_EVERY
    from edgespec.engine.spec_engine import Request, SpecEngine
    from edgespec.runner.target_runner import TargetRunner

    planned = [0]
    monkeypatch.setattr(step_drafts, "plan_drafts", lambda acts, *a: planned * len(acts))
    with SpecEngine(TargetRunner(tiny.model, n_slots=2, max_len=64), None,
                    EngineConfig(adaptive=False, draft_wait_ms=50)) as engine:
        act = engine.add(Request([1, 5, 6], 4))
        act.drafter = "board"
        for _ in range(MISSES_TO_LATE):
            engine.lateness.record("board", ready=False, waited=True)
        assert engine.lateness.late("board")
        for _ in range(3 * PROBE_EVERY + 3):  # asked nothing: its turn does not come nearer
            assert engine._plan()[0].k == 0
        planned[0] = 2
        waits = [engine._plan()[0].wait for _ in range(PROBE_EVERY)]
    assert waits == [False] * (PROBE_EVERY - 1) + [True]


def test_a_late_boards_turn_to_be_waited_for_comes_on_a_step_whose_wait_it_is_worth(
        tiny, monkeypatch):
    """Steps that ask a late board for drafts not worth a wait (the planner's ``wait_worth``
    0) do not spend its turn: it comes on the PROBE_EVERY-th step that would wait for them."""
    from edgespec.config import EngineConfig
    from edgespec.engine import step_drafts
    from edgespec.engine.lateness import MISSES_TO_LATE, PROBE_EVERY
    from edgespec.engine.spec_engine import Request, SpecEngine
    from edgespec.runner.target_runner import TargetRunner

    worth = [0.0]
    monkeypatch.setattr(step_drafts, "plan_drafts", lambda acts, *a: [2] * len(acts))
    monkeypatch.setattr(step_drafts, "wait_worth", lambda g, ks, *a: worth * len(ks))
    with SpecEngine(TargetRunner(tiny.model, n_slots=2, max_len=64), None,
                    EngineConfig(draft_wait_ms=50)) as engine:
        act = engine.add(Request([1, 5, 6], 4))
        act.drafter = "board"
        for _ in range(MISSES_TO_LATE):
            engine.lateness.record("board", ready=False, waited=True)
        for _ in range(3 * PROBE_EVERY + 3):  # asked, worth no wait: never waited for
            want = engine._plan()[0]
            assert want.k == 2 and not want.wait
        worth[0] = 0.010
        waits = [engine._plan()[0].wait for _ in range(PROBE_EVERY)]
    assert waits == [False] * (PROBE_EVERY - 1) + [True]


def test_lateness_judges_a_board_by_what_its_drafts_hold_not_by_their_length():
    """A board slower than the steps holds fewer tokens than asked (not ready) yet brings
    tokens: it is not late. One whose drafts held nothing for a session is."""
    from edgespec.engine.lateness import MISSES_TO_LATE, Lateness

    book = Lateness()
    for _ in range(3 * MISSES_TO_LATE):
        book.record("short", ready=False, waited=True, sessions=(2, 0, 2), useful=True,
                    waited_s=0.002)
        book.record("empty", ready=False, waited=True, sessions=(2, 0, 1), useful=False)
    assert not book.late("short") and book.late("empty")
    link = book.snapshot()["short"]
    assert (link.missed, link.session_steps, link.verified_drafts) == \
        (3 * MISSES_TO_LATE, 6 * MISSES_TO_LATE, 6 * MISSES_TO_LATE)
    assert link.waited_s == pytest.approx(0.006 * MISSES_TO_LATE)
    assert book.snapshot()["empty"].waited_s == 0.0


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


def test_the_attach_heartbeat_notices_a_silent_link_without_keepalive(heartbeat_only, reference):
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


def test_a_session_whose_board_drafts_anew_after_a_fix_is_waited_for_as_its_draft_is_worth(
        tiny, monkeypatch):
    """After a fix its board holds nothing for the session: the step waits for that draft as
    long as the planner finds it worth (``wait_worth`` uncapped), past the deadline for drafts
    on their way, and the take's deadline follows; a session not after a fix, or whose board
    has not drafted for it yet (it reads the prompt), keeps the deadline's cap."""
    from edgespec.config import EngineConfig
    from edgespec.engine import step_drafts
    from edgespec.engine.spec_engine import Request, SpecEngine
    from edgespec.runner.target_runner import TargetRunner

    monkeypatch.setattr(step_drafts, "plan_drafts", lambda acts, *a: [2] * len(acts))
    monkeypatch.setattr(step_drafts, "wait_worth",
                        lambda g, ks, cost, caps: [min(c, 0.08) for c in caps])
    with SpecEngine(TargetRunner(tiny.model, n_slots=2, max_len=64), None,
                    EngineConfig(draft_wait_ms=10, late_after=0)) as engine:  # never late
        act = engine.add(Request([1, 5, 6], 4), device="board")
        class Fitted:  # a fitted forward cost: a second a row and token
            def seconds(self, rows, width):
                return 1.0 * rows * width

        monkeypatch.setattr(engine.cost, "model", lambda: Fitted())
        deadlines = []
        take = engine.store.take_when_ready
        monkeypatch.setattr(engine.store, "take_when_ready",
                            lambda wants, wait_s: deadlines.append(wait_s) or take(wants, 0.0))

        def wait() -> float:
            [want] = engine._plan()
            assert want.k == 2 and want.wait
            engine._take([want])
            return want.wait_s

        assert wait() == 0.01  # opening: nothing drafted for it yet
        act.fixed = True
        assert wait() == 0.01  # its board still reads the prompt
        act.board_drafted = True
        assert wait() == 0.08 and deadlines[-1] == 0.08  # drafting anew after a fix
        act.fixed = False
        assert wait() == 0.01 and deadlines[-1] == 0.01
        act.fixed, engine.wait_ms = True, 0.0  # --draft-wait-ms 0: no step waits, even so
        [want] = engine._plan()
        assert not want.wait
