"""Running sessions handed to an attached drafter (``verifier_node.handover``): a session admitted
with no board, and one whose board has been gone for ``after_s``, go to a board that attached
later; the cache's owner, session sets and inboxes move in one transaction; the old board's
chunks are refused; pinned sessions and those near their end stay; the output is target-only's
whatever the hand-over. Real Redis, real gRPC, a real drafter agent; the engine stepped here,
so that nothing depends on how a race falls."""

from __future__ import annotations


import pytest
from prometheus_client import CollectorRegistry
from cache_harness import Stream, draft_len, engine_over_cache, eventually, start_agent
from conftest import hf_greedy

from cache_service.codec import text
from cache_service.store_records import StoreError
from drafter_node.agent import DrafterAgent
from edgespec.config import EngineConfig, SamplingParams
from edgespec.drafters import Draft, Drafter, DraftSession
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.protocol.contract import StoreUnavailable
from edgespec.protocol.local_store import LocalSessionStore
from edgespec.runner.target_runner import TargetRunner
from edgespec.v1 import edgespec_pb2 as pb
from verifier_node.handover import MIN_TOKENS_LEFT, Handover
from verifier_node.metrics import VerifierMetrics
from verifier_node.scheduler import Scheduler
from verifier_node.tickets import Ticket

PROMPTS = [[1, 10, 11, 12, 13, 10, 11, 12, 13, 10], [1, 50, 51, 52, 53, 54, 55, 56]]
N = 40


class KnownOutputDrafter(Drafter):
    """Drafts the known continuation of whatever its session holds (opened at any point of a
    session: a board handed one mid-way drafts from its committed end)."""

    name = "known"

    def __init__(self, fulls: list[list[int]]):
        self.fulls = fulls

    def open(self, tokens, params):
        return _KnownSession(self, tokens, params)


class _KnownSession(DraftSession):
    def __init__(self, drafter, tokens, params):
        super().__init__(tokens, params)
        self.drafter = drafter

    def propose(self, k):
        n = len(self.tokens)
        for full in self.drafter.fulls:
            if full[:n] == self.tokens:
                out = full[n:n + k]
                self.tokens.extend(out)
                return Draft(out)
        return Draft()


@pytest.fixture()
def fleet(tiny):
    """An embedded Redis, the draft cache on loopback, a verifier engine over its store."""
    with engine_over_cache(tiny.model, "ho:") as parts:
        yield parts


def _attach(address: str, device: str, drafter: Drafter):
    agent = DrafterAgent(address, device, drafter, window=8, chunk=4)
    return agent, start_agent(agent)


def _admit(engine, prompts, device=None, n=N, pinned=False):
    tickets = {}
    for p in prompts:
        sid = f"s{len(engine.active)}"
        engine.add(Request(p, n, SamplingParams()), session_id=sid, device=device)
        t = Ticket(Request(p, n, SamplingParams()), device, session_id=sid)
        t.pinned = pinned
        tickets[sid] = t
    return tickets


def _inbox(store, device: str) -> list[str]:
    """The kinds of the events in ``device``'s inbox, oldest first."""
    return [text(fields[b"t"]) for _, fields in store.redis.xrange(store.keys.inbox(device))]


def test_sessions_admitted_with_no_board_go_to_a_board_that_attaches_later(fleet, tiny):
    engine, store = fleet["engine"], fleet["store"]
    refs = {tuple(p): hf_greedy(tiny.model, p, N) for p in PROMPTS}
    tickets = _admit(engine, PROMPTS)
    for _ in range(3):  # the server decodes them alone meanwhile
        engine.step()
    assert all(not a.drafter for a in engine.active)
    handover = Handover(engine, lambda: tickets)
    assert handover.run(now=0.0) == 0  # no board attached: nothing moves
    agent, thread = _attach(fleet["address"], "board-late",
                            KnownOutputDrafter([p + refs[tuple(p)] for p in PROMPTS]))
    try:
        assert handover.run(now=0.5) == 0  # once a second at most
        # a step whose commit Redis did not take keeps its verdicts for the next step: no
        # hand-over meanwhile (it drops the draft a kept verdict may have accepted)
        commit_many = store.commit_many
        store.commit_many = lambda verdicts: (_ for _ in ()).throw(StoreUnavailable("down"))
        with pytest.raises(StoreUnavailable):
            engine.step()
        store.commit_many = commit_many
        assert engine.commits_undelivered
        assert handover.run(now=1.0) == 0
        engine.step()  # the kept verdicts land
        assert not engine.commits_undelivered
        assert handover.run(now=2.0) == len(PROMPTS)
        for act in engine.active:
            assert act.drafter == "board-late"
            assert tickets[act.sid].device == "board-late"
            assert store.session_device(act.sid) == "board-late"
        assert sorted(store.devices.sessions_of("board-late")) == sorted(tickets)
        assert _inbox(store, "board-late") == ["assign"] * len(PROMPTS)
        acts = list(engine.active)
        while engine.active:
            engine.step()
    finally:
        agent.stop()
        thread.join(timeout=10)
    for p, act in zip(PROMPTS, acts):
        ref = refs[tuple(p)]
        assert act.output == ref[:len(act.output)] and (len(act.output) == N
                                                        or act.output[-1] == 2)
        assert act.stats.drafter_tokens > 0  # the board drafted for it once handed over
    assert agent.refused == 0


def test_a_session_whose_board_is_gone_goes_to_another_after_the_wait(fleet, tiny):
    engine, store = fleet["engine"], fleet["store"]
    refs = {tuple(p): hf_greedy(tiny.model, p, N) for p in PROMPTS[:1]}
    old = Stream(fleet["channel"], "board-old")  # a hand-driven board that then goes away
    eventually(lambda: store.devices.is_alive("board-old"), "board-old attached")
    tickets = _admit(engine, PROMPTS[:1], device="board-old")
    [sid] = tickets
    ref = refs[tuple(PROMPTS[0])]
    old.send(pb.DraftChunk(session_id=sid, epoch=0, start=len(PROMPTS[0]), tokens=ref[:4],
                           idle=True))  # its one draft, right: the first step takes it
    # in the cache before the step (the stream's chunk and the step's take otherwise race)
    eventually(lambda: draft_len(store, sid) == 4, "the board's draft in the cache")
    engine.step()
    assert engine.active[0].stats.drafter_tokens == 4
    old.close()
    eventually(lambda: not store.devices.is_alive("board-old"), "board-old marked gone")
    agent, thread = _attach(fleet["address"], "board-new",
                            KnownOutputDrafter([p + refs[tuple(p)] for p in PROMPTS[:1]]))
    try:
        metrics = VerifierMetrics(CollectorRegistry())
        handover = Handover(engine, lambda: tickets, metrics, after_s=30.0)
        assert handover.run(now=100.0) == 0  # first seen gone now
        assert handover.run(now=129.0) == 0  # gone for 29 s: it stays
        assert store.session_device(sid) == "board-old"
        assert handover.run(now=130.0) == 1
        assert store.session_device(sid) == "board-new"
        assert sid not in store.devices.sessions_of("board-old")
        assert _inbox(store, "board-old")[-1] == "close"
        assert _inbox(store, "board-new") == ["assign"]
        epoch = int(store.redis.hget(store.keys.session(sid)[0], "epoch"))
        end = len(PROMPTS[0]) + len(engine.active[0].output)
        with pytest.raises(StoreError) as refused:  # the old board's: no longer its session
            store.push(sid, epoch, end, [5], False, 8, device="board-old")
        assert refused.value.kind == "device"
        [act] = engine.active
        while engine.active:
            engine.step()
    finally:
        agent.stop()
        thread.join(timeout=10)
    assert act.output == ref[:len(act.output)]
    assert act.stats.drafter_tokens > 4
    # each board credited with its own drafts: the first with the one before the hand-over
    assert metrics.device_draft_counts("board-old") == (0, 0, 0)  # credited as it finishes
    metrics.finished(tickets[sid].device, act.stats, "length", 1.0, tickets[sid].earlier_boards)
    assert metrics.device_draft_counts("board-old") == (1, 4, 4)
    drafts, drafted, accepted = metrics.device_draft_counts("board-new")
    assert (drafts + 1, drafted + 4, accepted + 4) == (
        act.stats.drafter_drafts, act.stats.drafter_tokens, act.stats.drafter_accepted)


def test_pinned_sessions_and_sessions_near_their_end_are_not_handed_over(fleet, tiny):
    engine, store = fleet["engine"], fleet["store"]
    pinned = _admit(engine, PROMPTS[:1], pinned=True)
    short = _admit(engine, PROMPTS[1:], n=MIN_TOKENS_LEFT - 1)
    tickets = {**pinned, **short}
    agent, thread = _attach(fleet["address"], "board-idle", KnownOutputDrafter([]))
    try:
        assert Handover(engine, lambda: tickets).run(now=0.0) == 0
        assert all(not a.drafter for a in engine.active)
        assert all(store.session_device(s) == "" for s in tickets)
    finally:
        agent.stop()
        thread.join(timeout=10)


def test_the_cache_hands_over_only_what_is_still_the_previous_drafters(fleet):
    store = fleet["store"]
    store.devices.register("board-b", {"max_sessions": 1})
    store.create("x", [1, 2, 3], SamplingParams(), "board-a", 20)
    # moved meanwhile (not boardless): nothing changes, the drafter it has is told
    assert store.hand_over("x", "board-b", previous="") == ("board-a", False)
    assert store.hand_over("gone", "board-b", previous="") == (None, False)  # no such session
    assert store.hand_over("x", "board-b", previous="board-a") == ("board-b", True)
    assert store.session_device("x") == "board-b"
    assert store.devices.sessions_of("board-a") == []
    assert store.devices.sessions_of("board-b") == ["x"]
    # board-b holds its max_sessions (1): another replica's hand-over cannot overfill it
    store.create("y", [1, 2, 3], SamplingParams(), None, 20)
    assert store.hand_over("y", "board-b", previous="") == ("", False)
    assert store.session_device("y") == ""
    store.close("x")
    assert store.hand_over("x", "board-c", previous="board-b") == (None, False)  # ended
    assert store.hand_over("y", "board-b", previous="") == ("board-b", True)  # room again


def test_a_hand_over_whose_watched_keys_change_under_it_reads_what_the_cache_holds(fleet,
                                                                                   monkeypatch):
    """Between the WATCH and the EXEC: a routine refresh of the board's set (its EXPIRE aborts
    the transaction) is tried again; another hand-over of the session (another replica's, or
    this one's whose EXEC reply was lost: redis-py raises WatchError for both) is followed."""
    store = fleet["store"]
    devices = store.devices
    devices.register("board-b", {"max_sessions": 4})
    devices.register("board-c", {"max_sessions": 4})
    store.create("w", [1, 2, 3], SamplingParams(), "board-b", 20)  # board-b's set exists
    store.create("x", [1, 2, 3], SamplingParams(), "board-a", 20)
    limit, meddled = devices._limit, []

    def refresh_once(device):  # read inside the transaction, after the WATCH
        if not meddled:
            meddled.append(device)
            store.redis.expire(store.keys.sessions(device), 600)  # watched: EXEC fails
        return limit(device)

    monkeypatch.setattr(devices, "_limit", refresh_once)
    assert store.hand_over("x", "board-b", previous="board-a") == ("board-b", True)
    assert meddled == ["board-b"] and sorted(devices.sessions_of("board-b")) == ["w", "x"]

    meddled.clear()

    def moved_meanwhile(device):
        if not meddled:
            meddled.append(device)
            store.redis.hset(store.keys.session("x")[0], "device", "board-c")
        return limit(device)

    monkeypatch.setattr(devices, "_limit", moved_meanwhile)
    assert store.hand_over("x", "board-c", previous="board-b") == ("board-c", False)
    assert store.session_device("x") == "board-c"


def test_one_reading_of_the_fleet_picks_many_within_each_boards_limit(fleet):
    devices = fleet["store"].devices
    for name, limit in (("small", 1), ("big", 3)):
        devices.register(name, {"max_sessions": limit})
        devices.mark_alive(name, ttl_ms=60_000)
    devices.register("away", {"max_sessions": 8})
    devices.mark_gone("away")  # registered, not attached
    got = devices.pick_many(10)
    assert sorted(got) == ["big", "big", "big", "small"]  # each limit, no more
    assert got[0] in ("big", "small") and got[1] != got[0]  # the least loaded first
    assert devices.pick() is None  # all reserved
    for d in got:
        devices.release(d)
    assert devices.pick() is not None


def test_a_session_another_replica_handed_over_is_followed_here(fleet, tiny):
    """The cache already names a drafter this engine does not (another replica handed it
    over, or this one's hand-over whose reply was lost): the engine asks that drafter."""
    engine, store = fleet["engine"], fleet["store"]
    tickets = _admit(engine, PROMPTS[:1])
    [sid] = tickets
    agent, thread = _attach(fleet["address"], "board-x", KnownOutputDrafter([]))
    try:
        assert store.hand_over(sid, "board-x", previous="").moved  # not via the engine
        assert engine.active[0].drafter == ""
        assert Handover(engine, lambda: tickets).run(now=0.0) == 0
        assert engine.active[0].drafter == "board-x" and tickets[sid].device == "board-x"
    finally:
        agent.stop()
        thread.join(timeout=10)


def test_a_pin_is_kept_only_where_its_board_took_the_session(verifier_parts):
    from verifier_node.admission import GenerationRequest

    store, engine, sched, admission = verifier_parts
    store.devices.register("b1", {"max_sessions": 4})
    store.devices.mark_alive("b1", ttl_ms=60_000)
    pinned = admission.admit(GenerationRequest(prompt="hi", device_id="b1", max_new_tokens=32))
    free = admission.admit(GenerationRequest(prompt="hi", max_new_tokens=32))
    assert pinned.pinned and pinned.device == "b1"
    assert not free.pinned and free.device == "b1"  # picked, not asked for
    # a resume of the running session that names no device leaves its pin as it was
    again = admission.admit(GenerationRequest(resume_session_id=pinned.session_id))
    assert again is pinned and again.pinned
    again = admission.admit(GenerationRequest(resume_session_id=free.session_id,
                                              device_id="b1"))
    assert again is free and not again.pinned


def test_a_scheduler_hands_over_only_over_a_cache_that_boards_attach_to(fleet, tiny):
    assert Scheduler(fleet["engine"]).handover.after_s == 30.0  # serve's --handover-after
    assert Scheduler(fleet["engine"], handover_after_s=2.5).handover.after_s == 2.5
    assert Scheduler(fleet["engine"], handover_after_s=0).handover is None  # 0: never
    runner = TargetRunner(tiny.model, n_slots=2, max_len=64)
    local = SpecEngine(runner, None, EngineConfig(), stop_ids={2},
                       store=LocalSessionStore())
    assert Scheduler(local).handover is None


@pytest.mark.parametrize("after_s", [0.0, 4.0])
def test_serves_handover_after_reaches_its_scheduler(tiny_dir, after_s):
    from edgespec_cli.server import EdgespecServer, ServerOptions

    srv = EdgespecServer(ServerOptions(listen="127.0.0.1:0", model=str(tiny_dir),
                                       handover_after_s=after_s,
                                       engine=EngineConfig(max_sessions=2, max_context=256)))
    try:
        handover = srv.scheduler.handover
        assert handover is None if after_s == 0 else handover.after_s == after_s
    finally:
        srv.stop(drain_timeout_s=0)
