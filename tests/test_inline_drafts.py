"""A cheap drafter drafting in the verifier's thread (``edgespec.engine.inline_drafts``): the
default in process for MaG and Cacheback, with no drafting thread; greedy, seeded sampling and
trees equal target-only, as with the thread (``draft_inline=False``); a window shorter than the
ask keeps the draft session and the store in step; a drafter that fails on a session costs that
session its drafts and nothing else; ended sessions' draft sessions are closed."""

from __future__ import annotations

import threading

import pytest
from conftest import hf_greedy, hf_keyed_sampled

from edgespec.config import EngineConfig, SamplingParams
from edgespec.drafters import build_drafter
from edgespec.drafters.mag import MaGDrafter, MaGSession
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.runner.target_runner import TargetRunner

PROMPTS = [
    [1, 10, 11, 12, 13, 10, 11, 12, 13, 10],
    [1, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61],
    [1, 30, 31, 30, 31, 30],
    [1, 70, 71, 72, 70, 71, 72, 70],
]
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=5)


@pytest.fixture(scope="module")
def setup(looping):
    """A target whose greedy output soon cycles: drafts MaG and Cacheback get right."""
    runner = TargetRunner(looping.model, n_slots=8, max_len=256)
    refs = [hf_greedy(looping.model, p, 40) for p in PROMPTS]
    return runner, refs


# a fixed draft length, waited for: every step verifies drafts whatever the machine's speed
FIXED = dict(max_draft=4, window=8, chunk=2, adaptive=False, draft_wait_ms=5000)


def _generate(runner, drafter, cfg, params=None):
    with SpecEngine(runner, drafter, cfg, stop_ids=set() if params else {2}) as engine:
        assert (engine.worker is None) == cfg.draft_inline
        assert (engine.inline is not None) == cfg.draft_inline
        results = engine.generate_many([Request(p, 40, params or SamplingParams())
                                        for p in PROMPTS])
    return results


@pytest.mark.parametrize("spec", ["mag", "mag+cacheback", "cacheback"])
@pytest.mark.parametrize("inline", [True, False])
def test_greedy_output_equals_target_only_inline_and_threaded(looping, setup, spec, inline):
    runner, refs = setup
    cfg = EngineConfig(**FIXED, draft_inline=inline)
    results = _generate(runner, build_drafter(spec, looping, runner), cfg)
    assert [r.token_ids for r in results] == refs
    assert sum(r.stats.accepted_tokens for r in results) > 0  # drafts were verified


@pytest.mark.parametrize("spec", ["mag", "mag+cacheback", "cacheback"])
@pytest.mark.parametrize("k,window,n_new", [(2, 16, 40), (1, 16, 3), (2, 5, 40)])
def test_chains_drafted_to_a_window_past_a_boards_lead_equal_target_only(looping, setup, spec,
                                                                         k, window, n_new):
    """A window wider than a board's lead (2k + 2), and one that cuts it, and an output that
    ends within the lead: greedy output equals target-only."""
    runner, _ = setup
    refs = [hf_greedy(looping.model, p, n_new) for p in PROMPTS]
    cfg = EngineConfig(max_draft=k, window=window, chunk=2, adaptive=False, draft_wait_ms=5000)
    with SpecEngine(runner, build_drafter(spec, looping, runner), cfg, {2}) as engine:
        results = engine.generate_many([Request(p, n_new, SamplingParams()) for p in PROMPTS])
    assert [r.token_ids for r in results] == refs
    if n_new > 3:
        assert sum(r.stats.accepted_tokens for r in results) > 0  # drafts were verified


def test_inline_is_the_in_process_default_for_cheap_drafters_only(tiny, tiny_draft_dir):
    runner = TargetRunner(tiny.model, n_slots=2, max_len=256)
    assert EngineConfig().draft_inline
    with SpecEngine(runner, build_drafter("mag", tiny, runner)) as engine:
        assert engine.inline is not None and engine.worker is None
    model = build_drafter(f"model:{tiny_draft_dir}", tiny, runner, n_slots=4, max_len=256)
    with SpecEngine(runner, model) as engine:  # a forward a token: its own thread
        assert engine.inline is None and engine.worker is not None


def test_an_inline_step_of_chains_weighs_no_wait(looping, setup, monkeypatch):
    """Drafted right before the take, every draft is ready when taken: the adaptive planner
    (its widths, its probes) weighs no wait for it (``wait_worth`` is never called), no ask
    says to wait (the drafter's deadline notwithstanding), and the output stays target-only's.
    With a drafting thread the waits are weighed and asked for."""
    import edgespec.engine.step_drafts as step_drafts
    from edgespec.protocol.local_store import LocalSessionStore

    runner, refs = setup
    weighed, waits = [], []
    real, take = step_drafts.wait_worth, LocalSessionStore.take_when_ready
    me = threading.get_ident()  # another test's engine left running here weighs its own waits

    def counting(*a, **k):
        if threading.get_ident() == me:
            weighed.append(1)
        return real(*a, **k)

    def taking(store, wants, wait_s):
        if threading.get_ident() == me:
            waits.extend(w.wait for w in wants if w.k > 0)
        return take(store, wants, wait_s)

    monkeypatch.setattr(step_drafts, "wait_worth", counting)
    monkeypatch.setattr(LocalSessionStore, "take_when_ready", taking)
    cfg = EngineConfig(max_draft=4, window=8, chunk=2, draft_wait_ms=50)
    results = _generate(runner, build_drafter("mag"), cfg)
    assert [r.token_ids for r in results] == refs and not weighed
    assert waits and not any(waits)  # asks were made, none to wait for
    waits.clear()
    threaded = EngineConfig(max_draft=4, window=8, chunk=2, draft_inline=False)
    results = _generate(runner, build_drafter("mag"), threaded)
    assert [r.token_ids for r in results] == refs and weighed and any(waits)


@pytest.mark.slow
def test_seeded_sampling_and_trees_inline_equal_target_only(looping, setup):
    runner, refs = setup
    keyed = [hf_keyed_sampled(looping.model, p, 40, SAMPLED) for p in PROMPTS]
    cfg = EngineConfig(max_draft=4, window=8, chunk=2)  # the planner's widths and probes
    sampled = _generate(runner, build_drafter("mag"), cfg, SAMPLED)
    assert [r.token_ids for r in sampled] == keyed
    trees = EngineConfig(max_draft=4, window=8, chunk=2, tree_width=4, tree_nodes=8)
    results = _generate(runner, build_drafter("mag"), trees)
    assert [r.token_ids for r in results] == refs


class CountingMaG(MaGDrafter):
    """MaG that counts its sessions' closes and fails on every session whose prompt's second
    token is ``fail_on``."""

    def __init__(self, fail_on: int | None = None):
        super().__init__()
        self.fail_on, self.opened, self.closed = fail_on, 0, 0

    def open(self, tokens, params):
        self.opened += 1
        s = super().open(tokens, params)
        drafter = self

        class Session(MaGSession):
            def propose_tree(self, k, width):
                if self.tokens[1] == drafter.fail_on:
                    raise RuntimeError("the drafter broke")
                return super().propose_tree(k, width)

            def close(self):
                drafter.closed += 1

        s.__class__ = Session
        return s


def test_a_drafter_failing_on_one_session_costs_it_its_drafts_only(setup):
    runner, refs = setup
    drafter = CountingMaG(fail_on=PROMPTS[0][1])
    cfg = EngineConfig(**FIXED)
    with SpecEngine(runner, drafter, cfg, stop_ids={2}) as engine:
        results = engine.generate_many([Request(p, 40) for p in PROMPTS])
        again = engine.generate(Request(PROMPTS[1], 40))  # the engine still drafts
    assert [r.token_ids for r in results] == refs
    assert results[0].stats.draft_tokens == 0  # decoded alone from its first step
    assert sum(r.stats.accepted_tokens for r in results[1:]) > 0
    assert again.token_ids == refs[1] and again.stats.accepted_tokens > 0
    assert drafter.closed == drafter.opened  # the failed one too, and every ended one


class PastTheVocabulary(MaGDrafter):
    """MaG that drafts one id past the target's vocabulary in each session's first draft,
    declaring its ids its sessions' own (``context_ids``) or not."""

    def __init__(self, context_ids: bool, vocab: int):
        super().__init__()
        self.context_ids, self.vocab = context_ids, vocab

    def open(self, tokens, params):
        s = super().open(tokens, params)
        vocab, first = self.vocab, [True]

        class Session(MaGSession):
            def propose_tree(self, k, width):
                d = super().propose_tree(k, width)
                if d.tokens and first:  # its first draft: a token its context never held
                    first.pop()
                    d.tokens[0] = self.tokens[-len(d.tokens)] = vocab + 3
                return d

        s.__class__ = Session
        return s


@pytest.mark.parametrize("context_ids", [False, True])
def test_a_drafters_ids_past_the_vocabulary_never_reach_the_output(setup, context_ids, caplog):
    """Drafting inline, a drafter's ids are checked where they enter the store unless it
    declares them its sessions' own (``Drafter.context_ids``: MaG's are): undeclared, a bad
    id costs its session its drafts; declared wrongly, the forward's own guard verifies the
    row without its draft. Either way the output is target-only's."""
    runner, refs = setup
    drafter = PastTheVocabulary(context_ids, runner.vocab_size)
    with SpecEngine(runner, drafter, EngineConfig(**FIXED), stop_ids={2}) as engine:
        results = engine.generate_many([Request(p, 40) for p in PROMPTS])
    assert [r.token_ids for r in results] == refs
    if not context_ids:  # refused by the store: every session decoded alone
        assert all(r.stats.draft_tokens == 0 for r in results)
    else:  # let in, dropped by the forward's guard for one step: the sessions draft on
        assert "outside the vocabulary" in caplog.text
        assert sum(r.stats.accepted_tokens for r in results) > 0


def test_ended_sessions_draft_sessions_are_closed_while_others_run(setup):
    runner, refs = setup
    drafter = CountingMaG()
    cfg = EngineConfig(**FIXED)
    with SpecEngine(runner, drafter, cfg, stop_ids={2}) as engine:
        first = engine.generate_many([Request(p, 40) for p in PROMPTS[:2]])
        opened = drafter.opened
        assert opened == 2
        engine.generate(Request(PROMPTS[2], 40))  # its first step closes the ended two
        assert drafter.closed >= opened and set(engine.inline.sessions) <= {"local-2"}
    assert drafter.closed == drafter.opened  # closing the engine closes the rest
    assert [r.token_ids for r in first] == refs[:2]


def test_a_window_shorter_than_the_ask_keeps_the_draft_session_with_the_store(setup):
    runner, refs = setup
    cfg = EngineConfig(max_draft=6, window=2, chunk=2, adaptive=False)
    drafter = build_drafter("mag")
    with SpecEngine(runner, drafter, cfg, stop_ids={2}) as engine:
        store, inline = engine.store, engine.inline
        synced = []
        draft = inline.draft

        def checked_draft(wants):
            draft(wants)
            asked = {w.session_id for w in wants if w.k > 0}  # none past an output's end
            for sid, entry in inline.sessions.items():
                state = store.sessions.get(sid)
                if state is not None:
                    assert len(state.draft) <= 2
                    if sid in asked:  # one asked nothing is left as it stands
                        synced.append(entry.draft.tokens == state.tokens + state.draft)

        inline.draft = checked_draft
        results = engine.generate_many([Request(p, 40) for p in PROMPTS])
    assert [r.token_ids for r in results] == refs
    assert synced and all(synced)


def _store_with(prompts: dict[str, list[int]], cfg: EngineConfig = EngineConfig()):
    from edgespec.engine.inline_drafts import InlineDrafts
    from edgespec.protocol.local_store import LocalSessionStore

    store = LocalSessionStore()
    for sid, prompt in prompts.items():
        store.create(sid, prompt, SamplingParams(), drafter="mag")
    return store, InlineDrafts(build_drafter("mag"), store, cfg)


def test_a_session_asked_nothing_for_longer_than_the_fix_log_is_drafted_for_again():
    from edgespec.protocol.contract import DraftWant, Verdict

    store, inline = _store_with({"s": [1, 2, 3, 1, 2]})
    inline.draft([DraftWant("s", 2)])
    state = store.sessions["s"]
    assert state.draft == [3, 1, 2]  # the ask, and a guess at the step's own token
    fixes = state.fixes.maxlen + 44  # steps decoding it alone, a fix each, past the log's end
    for _ in range(fixes):
        [out] = store.commit_many([Verdict("s", state.epoch, state.end, 0, 9)])
        assert out.ok and out.fix is not None
    inline.draft([DraftWant("s", 2)])
    assert state.has_drafter and state.draft == [9]  # drafted for again, not given up on
    assert inline.sessions["s"].draft.tokens == state.tokens + state.draft
    inline.close()


def test_a_session_id_used_again_is_a_new_session_to_its_drafter():
    from edgespec.protocol.contract import DraftWant

    store, inline = _store_with({"s": [1, 2, 3, 1, 2]})
    inline.draft([DraftWant("s", 2)])
    store.close("s")
    store.create("s", [5, 6, 7, 5, 6], SamplingParams(), drafter="mag")
    inline.draft([DraftWant("s", 2)])
    assert store.sessions["s"].draft == [7, 5, 6]  # from its own prompt, not the first one's
    assert inline.sessions["s"].draft.tokens == [5, 6, 7, 5, 6, 7, 5, 6]
    inline.close()


def test_a_whole_draft_accepted_with_the_guessed_token_goes_on_without_a_fix():
    """The draft holds one token past the ask: a step that accepts all it took and whose own
    token is that one commits without a fix; the draft session goes on as it stands and learns
    the tokens so committed as it learns a fix's; a wrong guess is an ordinary fix."""
    from edgespec.protocol.contract import DraftWant, Verdict

    store, inline = _store_with({"s": [1, 2, 3, 1, 2]})
    state, mag = store.sessions["s"], inline.drafter
    inline.draft([DraftWant("s", 2)])
    [taken] = store.take_when_ready([DraftWant("s", 2)], 0.0)
    assert taken.tokens == [3, 1] and state.draft == [3, 1, 2]
    assert mag.bigrams.followers(3) == {1: 1}
    [out] = store.commit_many([Verdict("s", taken.epoch, taken.start, 2, 2)])
    assert out.ok and out.fix is None and state.draft == []
    session = inline.sessions["s"].draft
    inline.draft([DraftWant("s", 2)])
    assert inline.sessions["s"].draft is session  # drafted on, not opened again
    assert state.tokens == [1, 2, 3, 1, 2, 3, 1, 2] and state.draft == [3, 1, 2]
    assert session.tokens == state.tokens + state.draft
    assert mag.bigrams.followers(3) == {1: 2}  # the committed 3 -> 1 learnt, once
    [out] = store.commit_many([Verdict("s", state.epoch, state.end, 2, 9)])  # a wrong guess
    assert out.ok and out.fix is not None
    inline.draft([DraftWant("s", 2)])
    assert session.tokens == state.tokens + state.draft and state.tokens[-3:] == [3, 1, 9]
    assert mag.bigrams.followers(1) == {2: 3, 9: 1}
    inline.close()


def test_a_tree_is_drafted_to_the_ask_its_branches_where_the_step_takes_them():
    """No guess past a tree's ask: a branch hanging there could never be taken, and would
    take the place of one that can."""
    from edgespec.protocol.contract import Branch, DraftWant

    store, inline = _store_with({"s": [5, 1, 2, 7, 8, 6, 1, 2, 9, 9, 4, 1, 2]},
                                EngineConfig(tree_width=4, tree_nodes=8))
    inline.draft([DraftWant("s", 2, branch_budget=4)])
    state = store.sessions["s"]
    assert state.draft == [9, 9] and state.branches == [Branch(0, (7, 8))]
    assert all(b.at < 2 for b in state.branches)
    [taken] = store.take_when_ready([DraftWant("s", 2, branch_budget=4)], 0.0)
    assert taken.branches == state.branches
    inline.close()


def test_a_chain_drafted_to_the_window_serves_the_next_steps_without_a_call():
    """A chain is drafted past the ask and the guess, to the whole window (further than the
    2k + 2 a board keeps): a step that accepts its ask and the guess leaves the rest in the
    store, and the next steps, asking no more than that, take it without calling the drafter;
    a window shorter than the chain bounds it."""
    from edgespec.protocol.contract import DraftWant, Verdict

    prompt = list(range(1, 13)) * 2  # MaG's suffix match continues with 1..12
    store, inline = _store_with({"s": prompt})
    state = store.sessions["s"]
    inline.draft([DraftWant("s", 2)])
    assert state.draft == list(range(1, 13))  # 2 asked, 12 drafted (the chain's end)
    calls = []
    session = inline.sessions["s"].draft
    propose = session.propose_tree
    session.propose_tree = lambda *a: calls.append(a) or propose(*a)
    for end in (3, 6, 9):  # three steps, each accepting its ask and the guess
        [taken] = store.take_when_ready([DraftWant("s", 2)], 0.0)
        [out] = store.commit_many([Verdict("s", taken.epoch, taken.start, 2, end)])
        assert out.ok and out.fix is None and state.draft == list(range(end + 1, 13))
        inline.draft([DraftWant("s", 2)])
    assert calls == [] and state.draft == [10, 11, 12]
    inline.draft([DraftWant("s", 4)])  # a longer ask than the store holds: drafted on
    assert len(calls) == 1 and state.draft[:3] == [10, 11, 12] and len(state.draft) >= 5
    inline.close()

    store, inline = _store_with({"s": prompt}, EngineConfig(window=8))
    inline.draft([DraftWant("s", 2)])
    assert store.sessions["s"].draft == list(range(1, 9))  # the window's 8
    assert inline.sessions["s"].draft.tokens == prompt + list(range(1, 9))
    inline.close()


def test_a_chain_is_drafted_no_further_than_a_step_can_verify_before_the_output_ends():
    """A session with 4 output tokens left (max_new_tokens 4): its steps verify drafts at the
    first 3 of them at most (a step's own token is the last), so the lead (2k + 2 = 6 for an
    ask of 2) is cut to 3, and once a commit leaves one token, nothing is drafted."""
    from edgespec.engine.inline_drafts import InlineDrafts
    from edgespec.protocol.contract import DraftWant, Verdict
    from edgespec.protocol.local_store import LocalSessionStore

    store = LocalSessionStore()
    store.create("s", [1, 2, 3, 4, 5, 6, 1, 2], SamplingParams(), drafter="mag",
                 max_new_tokens=4)
    inline = InlineDrafts(build_drafter("mag"), store, EngineConfig())
    state = store.sessions["s"]
    assert state.output_end == 12
    inline.draft([DraftWant("s", 2)])
    assert state.draft == [3, 4, 5]  # 6 would be drafted without the output's end
    [taken] = store.take_when_ready([DraftWant("s", 2)], 0.0)
    [out] = store.commit_many([Verdict("s", taken.epoch, taken.start, 2, 5)])
    assert out.ok and state.end == 11 and state.draft == []
    inline.draft([DraftWant("s", 2)])
    assert state.draft == []  # the next step's own token ends the output: no draft is used
    inline.close()
