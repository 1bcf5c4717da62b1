"""A late drafter costs only its own sessions: the lateness book marks a board late after missed
deadlines, stops waiting for it, waits again every few steps (on a step that asks it for a
draft worth the wait) and recovers it once on time; it judges a board by what its drafts hold,
counts a board's empty drafts by what came before, and says nothing of a board whose session
was asked no draft; a session whose board drafts anew after a fix is waited for as long as its
draft is worth. In process, on the engine's own steps (the links that fail:
``test_link_faults``)."""

from __future__ import annotations

import pytest


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
        acts = [act]  # the planned sessions, beside their asks
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
        acts = [act]  # the planned sessions, beside their asks

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
    # rest_drafters off: these steps' plans alone, no whole steps measured to rest on
    with SpecEngine(TargetRunner(tiny.model, n_slots=2, max_len=64), None,
                    EngineConfig(draft_wait_ms=50, rest_drafters=False)) as engine:
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


def test_a_board_that_went_is_not_judged_by_its_sessions_ready_empty_drafts(tiny, monkeypatch):
    """A board the cache detached (gone: a frozen process, a lost link) leaves its sessions'
    drafts empty and ready (waiting would give nothing): those steps say nothing of it. It
    stays late, its ready drafts are not counted, and it recovers only by drafting again."""
    from edgespec.config import EngineConfig
    from edgespec.engine import step_drafts
    from edgespec.engine.lateness import HITS_TO_RECOVER, MISSES_TO_LATE
    from edgespec.engine.spec_engine import Request, SpecEngine
    from edgespec.runner.target_runner import TargetRunner

    monkeypatch.setattr(step_drafts, "plan_drafts", lambda acts, *a: [2] * len(acts))
    with SpecEngine(TargetRunner(tiny.model, n_slots=2, max_len=96), None,
                    EngineConfig(adaptive=False, draft_wait_ms=0)) as engine:
        act = engine.add(Request([1, 5, 6], 40), device="board")
        for _ in range(MISSES_TO_LATE):
            engine.lateness.record("board", ready=False, waited=True)
        assert engine.lateness.late("board")
        before = engine.lateness.snapshot()["board"]
        engine.store.drafter_gone(act.sid)  # as the cache marks a detached board's sessions
        for _ in range(3 * HITS_TO_RECOVER):
            engine.step()
        assert len(act.output) >= 3 * HITS_TO_RECOVER  # decoded alone meanwhile
        after = engine.lateness.snapshot()["board"]
        assert engine.lateness.late("board")
        assert (after.session_steps, after.ready_drafts) == (before.session_steps,
                                                             before.ready_drafts)
        state = engine.store.sessions[act.sid]
        state.has_drafter = True  # back: its drafts hold tokens again
        for _ in range(HITS_TO_RECOVER):
            state.push_draft(state.epoch, state.end, [7, 7], idle=True)
            engine.step()
        assert not engine.lateness.late("board")
