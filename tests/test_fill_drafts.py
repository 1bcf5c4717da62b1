"""The verifier's own MaG drafts for a board's empty drafts (``--fill-drafts``): lossless, only
where the board's draft is empty, counted apart, in step with the session through its commits.

The engine runs in process over a store (the local one, and the embedded Redis) whose sessions
belong to a board that never drafts: every draft the steps take is empty, as a board's is while
it reads a prompt or redrafts after a fix. The looping target's output repeats its context, so
MaG's drafts are right in most steps.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import pytest
from conftest import hf_greedy, hf_keyed_sampled

from edgespec.config import ConfigError, EngineConfig, SamplingParams
from edgespec.drafters.mag import MaGDrafter
from edgespec.engine.fill_drafts import FillDrafts, resolve_fill
from edgespec.engine.generation import ActiveSession, Request
from edgespec.engine.proposals import HeadBranch, StepDraft
from edgespec.engine.spec_engine import SpecEngine
from edgespec.protocol.local_store import LocalSessionStore
from edgespec.runner.target_runner import TargetRunner

PROMPTS = [[1, 10, 11, 12, 13, 10, 11, 12, 13, 10], [1, 30, 31, 30, 31, 30]]
N = 24
BOARD = "board-0"


@contextmanager
def _engine(model, store: str, **cfg):
    """An engine over ``store`` ("local" or "redis": the embedded one) whose sessions' board
    never drafts; no wait for drafts (none comes)."""
    runner = TargetRunner(model, n_slots=4, max_len=256)
    config = EngineConfig(max_draft=4, draft_wait_ms=0, **cfg)
    if store == "local":
        with SpecEngine(runner, config=config, stop_ids={2},
                        store=LocalSessionStore(None, runner.vocab_size)) as engine:
            yield engine
        return
    from cache_service.redis_conn import RedisHandle
    from cache_service.store import RedisSessionStore

    handle = RedisHandle()
    store = RedisSessionStore(handle.client, ttl_s=60)
    try:
        with SpecEngine(runner, config=config, stop_ids={2}, store=store) as engine:
            yield engine
    finally:
        store.shutdown()
        handle.close()


def _run(engine: SpecEngine, params: SamplingParams) -> list[ActiveSession]:
    acts = [engine.add(Request(p, N, params), device=BOARD) for p in PROMPTS]
    while engine.active:
        engine.step()
    return acts


@pytest.mark.parametrize("store", ["local", "redis"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_empty_board_drafts_filled_by_the_verifier_decode_as_the_target_alone(
        looping, store, sampled):
    params = SamplingParams(temperature=0.9, top_k=20, seed=7) if sampled else SamplingParams()
    if sampled:
        refs = [hf_keyed_sampled(looping.model, p, N, params) for p in PROMPTS]
    else:
        refs = [hf_greedy(looping.model, p, N, eos=(2,)) for p in PROMPTS]
    # a fixed draft length: every step asks for 4 tokens, whatever the clock says
    with _engine(looping.model, store, fill_drafts="mag", adaptive=False) as engine:
        acts = _run(engine, params)
        assert not engine.fill.sessions  # every ended session's draft session closed
    for act, ref in zip(acts, refs):
        assert act.output == ref and act.finish == "length"
        s = act.stats
        assert s.fill_tokens > 0 and 0 < s.fill_accepted <= s.fill_tokens
        assert 0 < s.fill_drafts == s.num_drafts <= s.steps
        # the fill's tokens are the only drafts here, counted as drafted and accepted too
        assert s.draft_tokens == s.fill_tokens and s.accepted_tokens == s.fill_accepted
        assert (s.drafter_drafts, s.drafter_tokens, s.drafter_accepted) == (0, 0, 0)
        assert s.steps < N  # accepted drafts: fewer steps than tokens


def test_without_the_fill_the_same_sessions_decode_one_token_a_step(looping):
    with _engine(looping.model, "local", fill_drafts="none", adaptive=False) as engine:
        assert engine.fill is None
        acts = _run(engine, SamplingParams())
    for act, prompt in zip(acts, PROMPTS):
        assert act.output == hf_greedy(looping.model, prompt, N, eos=(2,))
        assert act.stats.steps == N and act.stats.draft_tokens == 0 == act.stats.fill_tokens


def test_the_planners_own_asks_bound_what_is_filled(looping):
    """Adaptive planning, the cost model fitted on this machine's clock (how much it asks is
    the clock's): whatever it asks, no row gets more fill tokens than the planner asked, and
    the output is the target's."""
    with _engine(looping.model, "local", fill_drafts="mag") as engine:
        acts = [engine.add(Request(p, N), device=BOARD) for p in PROMPTS]
        propose, plan, seen = engine._propose, engine._plan, []

        def planned():
            wants = plan()
            seen.append({w.session_id: w.k for w in wants})
            return wants

        def proposed(taken):
            rows = propose(taken)
            for r in rows:
                assert len(r.fill_offer) <= seen[-1][r.act.sid]
                assert r.tokens == () and r.branches == (
                    (HeadBranch(0, r.fill_offer),) if r.fill_offer else ())
            return rows

        engine._plan, engine._propose = planned, proposed
        while engine.active:
            engine.step()
        assert seen
    for act, prompt in zip(acts, PROMPTS):
        assert act.output == hf_greedy(looping.model, prompt, N, eos=(2,))


def test_a_boards_own_draft_is_verified_and_never_filled(looping):
    with _engine(looping.model, "local", fill_drafts="mag", adaptive=False) as engine:
        acts = [engine.add(Request(p, N), device=BOARD) for p in PROMPTS]
        while len(acts[1].output) < 12:  # into the loop, where MaG drafts for both
            engine.step()
        state = engine.store.sessions[acts[0].sid]
        board = hf_greedy(looping.model, PROMPTS[0], N, eos=(2,))[len(acts[0].output):][:4]
        engine.store.push_draft(acts[0].sid, state.epoch, acts[0].end, board)
        propose, rows = engine._propose, []
        engine._propose = lambda taken: rows.extend(propose(taken)) or rows
        before = [len(a.output) for a in acts]
        engine.step()  # one forward: the board's chain on one row, a fill on the other
        assert rows[0].tokens == tuple(board) and not rows[0].fill_offer
        assert not rows[0].branches
        assert rows[1].fill_offer and rows[1].tokens == ()
        assert len(acts[0].output) - before[0] == len(board) + 1  # all of it, and the bonus
        assert acts[1].stats.fill_drafts > 0
        engine._propose = propose
        while engine.active:
            engine.step()
    for act, prompt in zip(acts, PROMPTS):
        assert act.output == hf_greedy(looping.model, prompt, N, eos=(2,))
        s = act.stats  # a step's draft is the board's or a fill, never both
        assert (s.num_drafts, s.draft_tokens, s.accepted_tokens) == (
            s.drafter_drafts + s.fill_drafts, s.drafter_tokens + s.fill_tokens,
            s.drafter_accepted + s.fill_accepted)
    assert acts[0].stats.drafter_accepted >= len(board)


def test_the_drafters_share_of_a_row_leaves_the_verifiers_branches_out():
    """A row of the board's chain and branch, and the head's branch beside them: the board
    proposed its chain's and its branch's tokens, and what it proposed of the accepted path
    is its own."""
    from edgespec.protocol.contract import Branch
    from edgespec.engine.proposals import HeadBranch, StepDraft, drafter_share

    row = StepDraft(None, 0, 5, (10, 11, 12), (Branch(1, (20, 21)), HeadBranch(0, (30, 31))),
                    head_offer=(30, 31))
    assert row.drafted == 7
    assert drafter_share(row, 2, ()) == (5, 2)  # two chain tokens accepted
    assert drafter_share(row, 1, (20, 21)) == (5, 3)  # the board's branch taken
    assert drafter_share(row, 0, (30, 31)) == (5, 0)  # the head's branch taken
    plain = StepDraft(None, 0, 5, (10, 11), (Branch(0, (40,)),))
    assert drafter_share(plain, 0, (40,)) == (3, 1)
    # the head's branch going on past the board's: the board's part of it is the board's
    longer = StepDraft(None, 0, 5, (10, 11, 12), (Branch(1, (20, 21)),
                                                  HeadBranch(1, (20, 21, 22))))
    assert drafter_share(longer, 1, (20, 21, 22)) == (5, 3)


def test_a_fill_teaches_the_boards_branch_rates_nothing(looping):
    """The fill's tokens are a branch to the step, but not the board's: the sessions' branch
    acceptance (what plans a board's branch tokens) stays at its prior."""
    from edgespec.drafters.draft_rates import BRANCH_PRIOR

    with _engine(looping.model, "local", fill_drafts="mag", adaptive=False) as engine:
        acts = [engine.add(Request(p, N), device=BOARD) for p in PROMPTS]
        while engine.active and not all(a.stats.fill_accepted for a in acts):
            engine.step()
        assert all(a.stats.fill_accepted for a in acts)
        rows = [a.slot for a in acts]
        assert (engine.rates.branch_trials[rows] == BRANCH_PRIOR[1]).all()
        assert (engine.rates.branch_hits[rows] == BRANCH_PRIOR[0] * BRANCH_PRIOR[1]).all()


def test_the_fills_figures_cross_the_wire_and_reach_the_metrics_apart_from_the_boards():
    from prometheus_client import CollectorRegistry, generate_latest

    from edgespec.protocol.request_stats import Stats
    from edgespec.wire.convert import stats_from_pb, stats_to_pb
    from verifier_node.metrics import VerifierMetrics

    s = Stats(steps=9, num_drafts=6, draft_tokens=20, accepted_tokens=11, fill_drafts=2,
              fill_tokens=5, fill_accepted=1, drafter_drafts=4, drafter_tokens=15,
              drafter_accepted=10)
    back = stats_from_pb(stats_to_pb(s))
    assert (back["fill_drafts"], back["fill_tokens"], back["fill_accepted"]) == (2, 5, 1)
    # the board's own share travels too: what a client's per-board figures are taken from
    assert (back["drafter_drafts"], back["drafter_tokens"], back["drafter_accepted"]) == \
        (4, 15, 10)
    m = VerifierMetrics(CollectorRegistry())
    m.finished(BOARD, s, "length", 1.0)
    text = generate_latest(m.registry).decode()
    for line in (f'edgespec:fill_draft_tokens_total{{device="{BOARD}"}} 5.0',
                 f'edgespec:fill_accepted_tokens_total{{device="{BOARD}"}} 1.0',
                 # the board's own: its drafts, draft tokens and accepted ones
                 f'edgespec:device_drafts_total{{device="{BOARD}"}} 4.0',
                 f'edgespec:device_draft_tokens_total{{device="{BOARD}"}} 15.0',
                 f'edgespec:device_accepted_tokens_total{{device="{BOARD}"}} 10.0'):
        assert line in text, line


def test_the_fills_draft_session_holds_the_committed_tokens_through_the_steps(looping):
    with _engine(looping.model, "local", fill_drafts="mag", adaptive=False) as engine:
        acts = [engine.add(Request(p, N), device=BOARD) for p in PROMPTS]
        for _ in range(4):
            engine.step()
            rows = engine._propose(engine._take(engine._plan()))  # proposed, then taken back
            for act, row in zip(acts, rows):
                tokens = engine.fill.sessions[act.sid].draft.tokens
                assert tokens[:act.end] == act.req.prompt_ids + act.output
                assert tokens[act.end:] == list(row.fill_offer)  # the proposal just made
        engine.cancel(acts[0].sid)
        assert list(engine.fill.sessions) == [acts[1].sid]


def _row(act: ActiveSession, tokens=()) -> StepDraft:
    return StepDraft(act, 0, act.end, tuple(tokens))


def _act(prompt, verify="exact", drafter=BOARD, sid="s") -> ActiveSession:
    from edgespec.drafters.adaptive import DraftLength

    act = ActiveSession(sid, Request(list(prompt), N), 0, DraftLength(4))
    act.verify, act.drafter = verify, drafter
    return act


def test_only_a_boards_exact_sessions_get_fills_within_the_steps_room():
    fill = FillDrafts(MaGDrafter())
    seen = [3, 5, 6, 7, 8, 9, 4, 5, 6]  # MaG drafts 7, 8, 9, 4 (a 2-token match: at most 4)
    rows = [_row(_act(seen, sid="a")), _row(_act(seen, verify="loose", sid="b")),
            _row(_act(seen, drafter="", sid="c")), _row(_act(seen, sid="d"))]
    out = fill.fill(rows, [4, 4, 4, 0], room=100, fits=100)
    assert out[0].fill_offer == (7, 8, 9, 4)
    assert out[0].branches == (HeadBranch(0, (7, 8, 9, 4)),) and out[0].width == 5
    assert out[1:] == rows[1:]  # loose: chains only; no board; asked nothing
    assert fill.fill(rows[:1], [3], room=100, fits=100)[0].fill_offer == (7, 8, 9)  # its ask
    assert fill.fill(rows[:1], [4], room=2, fits=100)[0].fill_offer == (7, 8)  # the budget
    assert fill.fill(rows[:1], [4], room=100, fits=3)[0].fill_offer == (7, 8)  # width 1 + 2
    two = fill.fill([rows[0], rows[3], _row(_act(seen, sid="e"))], [4, 4, 4], room=6, fits=100)
    assert [r.fill_offer for r in two] == [(7, 8, 9, 4), (7, 8), ()]  # the room, in row order


def test_a_fill_drafter_that_fails_costs_its_session_its_fills_only():
    class Broken(MaGDrafter):
        def open(self, tokens, params):
            session = super().open(tokens, params)
            if tokens[1] == 9:
                session.propose = lambda k: 1 / 0
            return session

    fill = FillDrafts(Broken())
    good, bad = _act([3, 5, 6, 7, 8, 4, 5, 6], sid="good"), _act([1, 9, 6, 9, 6], sid="bad")
    out = fill.fill([_row(bad), _row(good)], [3, 3], room=100, fits=100)
    assert out[0].fill_offer == () and out[1].fill_offer == (7, 8, 4)
    assert fill.sessions[bad.sid].draft is None  # no more tries for it
    again = fill.fill([_row(bad)], [3], room=100, fits=100)
    assert again[0].fill_offer == ()


def test_fill_drafts_is_checked_and_left_out_where_it_cannot_serve(looping):
    with pytest.raises(ConfigError, match="fill_drafts"):
        EngineConfig(fill_drafts="llamacpp")
    for other in ({"head": "default"}, {"auto": True}):
        with pytest.raises(ConfigError, match="--fill-drafts"):
            EngineConfig(fill_drafts="mag", **other)
    assert replace(EngineConfig(), fill_drafts="mag").fill_drafts == "mag"
    with _engine(looping.model, "local", fill_drafts="mag", tree_nodes=0) as engine:
        assert engine.fill is None  # a fill is branch tokens: none where none are verified


def test_the_default_fills_a_servers_boards_and_nothing_else(looping):
    """``auto`` (the default): MaG fills where the verifier serves boards; an engine drafting
    in process, one with a draft head or --auto (whose head drafts every row) gets none, and
    refuses no option for it."""
    from edgespec.drafters import build_drafter

    assert EngineConfig().fill_drafts == "auto"
    assert resolve_fill("auto", serves_boards=True, head=False) == "mag"
    assert resolve_fill("auto", serves_boards=False, head=False) == "none"
    assert resolve_fill("auto", serves_boards=True, head=True) == "none"
    assert resolve_fill("none", serves_boards=True, head=False) == "none"
    for other in ({"head": "default"}, {"auto": True}):  # accepted: it resolves to none
        assert EngineConfig(**other).fill_drafts == "auto"
    with _engine(looping.model, "local") as engine:
        assert engine.fill is not None and engine.fill.drafter.name == "mag"
    runner = TargetRunner(looping.model, n_slots=2, max_len=128)
    with SpecEngine(runner, build_drafter("mag"), EngineConfig()) as engine:
        assert engine.fill is None  # drafted in process: no board to fill for
    with SpecEngine(runner, None, EngineConfig()) as engine:
        assert engine.fill is None  # target-only in process (--drafter none): no board
    with SpecEngine(runner, config=EngineConfig(auto=True),
                    store=LocalSessionStore(None, runner.vocab_size)) as engine:
        assert engine.fill is None
