"""The engine's whole step (plan -> take -> propose -> verify -> decide -> commit): it never edits
what the store handed it, commits once the verdicts of a step whose commit failed, fails alone a
session whose drafts or callback break, closes the sessions that end together in one call and
changes nothing a retry reads. The rows it builds from the proposers' drafts and the cut a
verdict gets: ``test_step_proposals``."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from conftest import hf_greedy
from tree_oracle import OracleTreeDrafter

from edgespec.config import EngineConfig
from edgespec.engine.generation import Request
from edgespec.engine.spec_engine import SpecEngine
from edgespec.protocol.contract import StoreUnavailable, TakenDraft
from edgespec.runner.target_runner import TargetRunner


# -- a whole step -------------------------------------------------------------------------------
class _RecordingStore:
    """The engine's store, with a copy of every draft it hands over, to check afterwards that
    the step left them as they were."""

    def __init__(self, store):
        self.inner, self.handed = store, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def take_when_ready(self, wants, wait_s):
        taken = self.inner.take_when_ready(wants, wait_s)
        self.handed.extend((t, copy.deepcopy(t)) for t in taken if isinstance(t, TakenDraft))
        return taken


def test_a_step_never_edits_the_stores_drafts_and_stays_lossless(tiny):
    """Trees (the oracle drafter's branches): the drafts the store handed over are as they
    were, the output is target-only's."""
    prompts = [[1, 10, 11, 12, 13, 10, 11], [1, 50, 51, 52, 53]]
    refs = {tuple(p): hf_greedy(tiny.model, p, 24) for p in prompts}
    runner = TargetRunner(tiny.model, n_slots=2, max_len=128)
    cfg = EngineConfig(adaptive=False, draft_wait_ms=5000, tree_width=3)
    drafter = OracleTreeDrafter(refs, runner.vocab_size, seed=3)
    with SpecEngine(runner, drafter, cfg, stop_ids={2}) as engine:
        recording = _RecordingStore(engine.store)
        engine.store = recording
        results = engine.generate_many([Request(p, 24) for p in prompts])
    for p, r in zip(prompts, results):
        assert r.token_ids == refs[tuple(p)]
    assert recording.handed and any(t.branches for t, _ in recording.handed)
    assert all(t == before for t, before in recording.handed)


class _GarbageStore(_RecordingStore):
    """A store that lets token ids outside the vocabulary through (as a store whose check was
    skipped would)."""

    def __init__(self, store, vocab):
        super().__init__(store)
        self.vocab = vocab

    def take_when_ready(self, wants, wait_s):
        taken = self.inner.take_when_ready(wants, wait_s)
        return [TakenDraft(t.epoch, t.start, [self.vocab + 5, *t.tokens[1:]], t.branches)
                if isinstance(t, TakenDraft) and t.tokens else t for t in taken]


class _FlakyCommits(_RecordingStore):
    """A store whose every third commit fails as an unreachable Redis does: before it lands,
    or (``landed``) after, its reply lost."""

    def __init__(self, store, landed: bool):
        super().__init__(store)
        self.landed, self.calls = landed, 0

    def commit_many(self, verdicts):
        self.calls += 1
        if self.calls % 3:
            return self.inner.commit_many(verdicts)
        if self.landed:
            self.inner.commit_many(verdicts)
        raise StoreUnavailable("the store went away")


@pytest.mark.parametrize("landed", [False, True])
def test_verdicts_whose_commit_failed_are_committed_by_the_next_step_once(tiny, landed):
    """A step whose commit raised keeps its verdicts; the next step commits them first (a
    commit that landed is recognised as a replay): the output is target-only's, each step
    counted once in its session's stats, with its take and forward times."""
    prompts = [[1, 10, 11, 12, 13, 10, 11], [1, 50, 51, 52, 53]]
    refs = {tuple(p): hf_greedy(tiny.model, p, 16) for p in prompts}
    runner = TargetRunner(tiny.model, n_slots=2, max_len=128)
    cfg = EngineConfig(adaptive=False, draft_wait_ms=5000)
    drafter = OracleTreeDrafter(refs, runner.vocab_size, seed=3)
    failed = 0
    with SpecEngine(runner, drafter, cfg, stop_ids={2}) as engine:
        flaky = _FlakyCommits(engine.store, landed)
        engine.store = flaky
        acts = [engine.add(Request(p, 16)) for p in prompts]
        while engine.active:
            try:
                engine.step()
            except StoreUnavailable:
                failed += 1
    assert failed and flaky.calls > failed
    for p, act in zip(prompts, acts):
        assert act.output == refs[tuple(p)] and act.finish in ("stop", "length")
        # every step counted once: a step adds its accepted draft tokens and one of its own
        assert act.stats.steps > 0 and act.stats.forward_s > 0 and act.stats.take_s > 0
        assert act.stats.accepted_tokens + act.stats.steps == len(act.output)


def test_ids_past_the_vocabulary_cost_their_drafts_not_the_session(tiny):
    """The forward's own guard: a row holding an id outside the vocabulary is verified without
    its draft (on CUDA such an id would be a device assert ending every session)."""
    prompts = [[1, 10, 11, 12, 13, 10, 11], [1, 50, 51, 52, 53]]
    refs = {tuple(p): hf_greedy(tiny.model, p, 16) for p in prompts}
    runner = TargetRunner(tiny.model, n_slots=2, max_len=128)
    drafter = OracleTreeDrafter(refs, runner.vocab_size, seed=3)
    cfg = EngineConfig(adaptive=False, draft_wait_ms=5000, tree_width=3)
    with SpecEngine(runner, drafter, cfg, stop_ids={2}) as engine:
        engine.store = _GarbageStore(engine.store, runner.vocab_size)
        results = engine.generate_many([Request(p, 16) for p in prompts])
    for p, r in zip(prompts, results):
        assert r.token_ids == refs[tuple(p)] and r.finish_reason in ("stop", "length")
        assert r.stats.accepted_tokens == 0  # no draft token was verified


@pytest.mark.parametrize("dropped", [0, 1, 2], ids=["first", "middle", "last"])
def test_a_session_dropped_mid_step_leaves_the_others_draft_lengths_their_own(tiny, dropped):
    """A step reads its sessions' draft-length rows once and reuses them while all are still
    in it: a session cancelled between verification and commit is not counted, and the others
    learn their own verdicts, as ``DraftRates.update`` over their rows alone gives; their
    output stays target-only's."""
    prompts = [[1, 40, 41, 42, 43, 44], [1, 50, 51, 52, 53], [1, 60, 61, 62, 60, 61]]
    refs = {tuple(p): hf_greedy(tiny.model, p, 20) for p in prompts}
    assert all(len(r) == 20 for r in refs.values())  # none stops before the step below
    runner = TargetRunner(tiny.model, n_slots=3, max_len=128)
    cfg = EngineConfig(max_draft=4, adaptive=False, draft_wait_ms=5000)
    drafter = OracleTreeDrafter(refs, runner.vocab_size, seed=3)
    with SpecEngine(runner, drafter, cfg, stop_ids={2}) as engine:
        acts = [engine.add(Request(p, 20)) for p in prompts]
        engine.step()
        assert engine.active == acts
        drafts = engine._propose(engine._take(engine._plan()))
        decided = engine._forward_and_verify(drafts)
        kept = [d for d in decided if d.act is not acts[dropped]]
        assert len(kept) == 2 and sum(len(d.draft.tokens) for d in kept)  # the others drafted
        engine.cancel(acts[dropped].sid)
        expected = copy.deepcopy(engine.rates)
        expected.update(np.array([d.act.draft_len.row for d in kept]),
                        np.array([len(d.draft.tokens) for d in kept]),
                        np.array([d.verdict.n_accepted for d in kept]))
        engine._commit(decided)
        for name in ("chain_hits", "chain_trials", "at_hits", "at_trials", "k"):
            assert np.array_equal(getattr(engine.rates, name), getattr(expected, name)), name
        while engine.active:
            engine.step()
    for i, (p, act) in enumerate(zip(prompts, acts)):
        if i != dropped:
            assert act.output == refs[tuple(p)]


class _CountingCloses(_RecordingStore):
    """The engine's store, counting how the engine tells it of ended sessions."""

    def __init__(self, store):
        super().__init__(store)
        self.closes, self.batches = [], []

    def close(self, session_id, finish_reason="stop"):
        self.closes.append(session_id)
        self.inner.close(session_id, finish_reason)

    def close_many(self, finished):
        self.batches.append(dict(finished))
        self.inner.close_many(finished)


def test_sessions_that_end_in_one_step_are_closed_in_one_call(tiny):
    """Three sessions asked as many tokens end in the same step: the store is told of all three
    in one call (one round trip to Redis), each with its finish reason, after their last
    tokens; each result is target-only's; a session cancelled alone is closed alone."""
    prompts = [[1, 40, 41, 42, 43, 44], [1, 50, 51, 52, 53], [1, 60, 61, 62, 60, 61]]
    refs = [hf_greedy(tiny.model, p, 8) for p in prompts]
    runner = TargetRunner(tiny.model, n_slots=4, max_len=128)
    with SpecEngine(runner, None, EngineConfig(), stop_ids={2}) as engine:
        counting = _CountingCloses(engine.store)
        engine.store = counting
        ended = []
        acts = [engine.add(Request(p, 8)) for p in prompts]
        for act in acts:
            act.on_finish = ended.append
        while engine.active:
            engine.step()
        assert [r.token_ids for r in ended] == refs  # each told once, in the sessions' order
        assert [r.finish_reason for r in ended] == ["length"] * 3
        assert counting.batches == [{a.sid: "length" for a in acts}] and counting.closes == []
        act = engine.add(Request(prompts[0], 8))
        engine.cancel(act.sid)
        assert counting.batches[1:] == [{act.sid: "cancelled"}]


@pytest.mark.parametrize("fault", ["on_finish", "on_tokens"])
def test_a_callback_that_raises_costs_the_others_ending_in_its_step_nothing(tiny, fault):
    """Three sessions end in one step and the middle one's callback raises. Its ``on_finish``:
    the step raises that error, and every other session that ended is closed in the store and
    told of its finish with its whole output, not failed. Its last ``on_tokens``: that session
    alone fails (told why), the step goes on, and the others end as they would have."""
    from edgespec.engine.generation import SessionFailed

    prompts = [[1, 40, 41, 42, 43, 44], [1, 50, 51, 52, 53], [1, 60, 61, 62, 60, 61]]
    refs = [hf_greedy(tiny.model, p, 8) for p in prompts]
    runner = TargetRunner(tiny.model, n_slots=4, max_len=128)

    def broken(*_):
        raise RuntimeError("a client's callback broke")

    with SpecEngine(runner, None, EngineConfig(), stop_ids={2}) as engine:
        counting = _CountingCloses(engine.store)
        engine.store = counting
        requests = [Request(p, 8) for p in prompts]
        if fault == "on_tokens":  # the middle session's last tokens
            requests[1].on_tokens = lambda new, got=[]: got.extend(new) or \
                (broken() if len(got) >= 8 else None)
        acts = [engine.add(r) for r in requests]
        calls, errors = [], []
        for i, act in enumerate(acts):
            act.on_finish = broken if fault == "on_finish" and i == 1 else \
                (lambda r, i=i: calls.append((i, r)))
            act.on_error = errors.append
        if fault == "on_finish":
            with pytest.raises(RuntimeError, match="callback broke"):
                while engine.active:
                    engine.step()
        else:
            while engine.active:
                engine.step()
        ended = dict(calls)
        told = [0, 2]
        assert sorted(i for i, _ in calls) == told  # each told once
        assert [ended[i].token_ids for i in told] == [refs[i] for i in told]
        assert [ended[i].finish_reason for i in told] == ["length"] * len(told)
        assert {acts[i].sid for i in told} <= {sid for b in counting.batches for sid in b}
        assert engine.active == []
        if fault == "on_tokens":
            [error] = errors
            assert isinstance(error, SessionFailed) and "callback raised" in str(error)
            assert str(error.__cause__) == "a client's callback broke"
        else:
            assert errors == []


@pytest.mark.parametrize("cancelled", [0, 2], ids=["applied-before", "applied-after"])
def test_a_callback_that_cancels_a_session_of_its_step_ends_it_once(tiny, cancelled):
    """The middle session's last tokens' callback cancels another session that ends in the
    same step: one applied before it keeps its finish reason and whole output ("length"), one
    applied after it ends "cancelled" without that step's tokens; each is told exactly once."""
    prompts = [[1, 40, 41, 42, 43, 44], [1, 50, 51, 52, 53], [1, 60, 61, 62, 60, 61]]
    refs = [hf_greedy(tiny.model, p, 8) for p in prompts]
    runner = TargetRunner(tiny.model, n_slots=4, max_len=128)
    with SpecEngine(runner, None, EngineConfig(), stop_ids={2}) as engine:
        requests = [Request(p, 8) for p in prompts]
        acts: list = []
        requests[1].on_tokens = lambda new, got=[]: got.extend(new) or \
            (engine.cancel(acts[cancelled].sid) if len(got) >= 8 else None)
        acts.extend(engine.add(r) for r in requests)
        told = []
        for i, act in enumerate(acts):
            act.on_finish = lambda r, i=i: told.append((i, r.finish_reason, list(r.token_ids)))
        while engine.active:
            engine.step()
    assert sorted(i for i, *_ in told) == [0, 1, 2]
    result = {i: (reason, out) for i, reason, out in told}
    assert result[1] == ("length", refs[1])
    if cancelled == 0:
        assert result[0] == ("length", refs[0])
    else:
        assert result[2] == ("cancelled", refs[2][:7])
        assert acts[2].output == refs[2][:7]  # not applied once it ended


def test_verification_changes_nothing_a_retry_reads(tiny):
    """Scoring and judging a batch of trees leave the KV cache's committed state alone (a
    failed batch is verified again row by row): verified twice, the same verdicts; the accepted
    branches are moved into place in the commit stage, and the output stays target-only's."""
    import torch

    prompts = [[1, 10, 11, 12, 13, 10, 11], [1, 50, 51, 52, 53]]
    refs = {tuple(p): hf_greedy(tiny.model, p, 24) for p in prompts}
    runner = TargetRunner(tiny.model, n_slots=2, max_len=128)
    cfg = EngineConfig(adaptive=False, draft_wait_ms=5000, tree_width=3)
    drafter = OracleTreeDrafter(refs, runner.vocab_size, seed=3)
    moved = 0
    with SpecEngine(runner, drafter, cfg, stop_ids={2}) as engine:
        acts = [engine.add(Request(p, 24)) for p in prompts]
        while engine.active:
            drafts = engine._propose(engine._take(engine._plan()))
            lengths = list(runner.cache.lengths)
            kv = [k[:, :, :].clone() for k in runner.cache.k]
            first = engine._forward_and_verify(drafts)
            assert runner.cache.lengths == lengths
            for before, now in zip(kv, runner.cache.k):
                for d in drafts:
                    L = lengths[d.act.slot]
                    assert torch.equal(before[d.act.slot, :, :L], now[d.act.slot, :, :L])
            again = engine._forward_and_verify(drafts)
            assert again == first
            engine._head_pending.clear()
            moved += sum(list(r.path) != list(range(len(r.path))) for r in first)
            engine._place(first)
            engine._commit(first)
    assert moved  # some accepted path held a branch, moved into place at commit
    for p, act in zip(prompts, acts):
        assert act.output == refs[tuple(p)]


def test_a_session_that_fails_to_start_fails_alone_and_gives_its_slot_back(tiny):
    """Its prompt in, a session that cannot start (the head's state for it, say, a device out
    of memory) was out of the prefill queue and in no list: the step raised, the loop failed
    every session in flight and this one's ticket waited for ever. It fails alone now, told
    why, its KV slot given back; a caller's ``on_error`` that raises costs no one else."""
    from edgespec.engine.generation import Admission, SessionFailed

    prompts = [[1, 40, 41, 42, 43, 44], [1, 50, 51, 52, 53]]
    ref = hf_greedy(tiny.model, prompts[1], 8)
    runner = TargetRunner(tiny.model, n_slots=2, max_len=128)
    with SpecEngine(runner, None, EngineConfig(max_sessions=2), stop_ids={2}) as engine:
        start = engine._start
        doomed: list = []

        def start_or_fail(act):
            if act in doomed:
                raise MemoryError("the head's state for it")
            start(act)

        engine._start = start_or_fail
        # admitted as the scheduler admits: prefilled by the steps (``add`` prefills at once)
        acts = engine.admit([Admission(Request(p, 8)) for p in prompts])
        doomed.append(acts[0])
        errors, done = [], []

        def broken_on_error(exc):
            errors.append(exc)
            raise RuntimeError("the caller's on_error broke")

        acts[0].on_error = broken_on_error
        acts[1].on_finish = done.append
        while engine.sessions:
            engine.step()
        [error] = errors
        assert isinstance(error, SessionFailed) and "starting the session failed" in str(error)
        assert [r.token_ids for r in done] == [ref]
        assert len(runner.cache._free) == 2  # both slots back


def test_every_rows_root_successor_is_one_past_its_kv_length(tiny, monkeypatch):
    """The verification takes greedy rows' positions from the rows' KV lengths on the device
    (``VerifyBatch.of_rows``): one past each row's root, which is where every draft starts, in
    every step (admissions joining, drafts accepted, fixed and cut, sessions ending), greedy
    and sampled; a greedy batch's positions are those starts, with no copy."""
    from edgespec.config import SamplingParams
    from edgespec.drafters import build_drafter
    from edgespec.verify.verify_step import VerifyBatch

    seen = []
    of_rows = VerifyBatch.of_rows.__func__

    def checked(cls, rows, starts, params, modes):
        assert (rows.start_index + 1).tolist() == list(starts)
        vb = of_rows(cls, rows, starts, params, modes)
        assert vb.starts.tolist() == list(starts)
        seen.append(len(starts))
        return vb

    monkeypatch.setattr(VerifyBatch, "of_rows", classmethod(checked))
    prompts = [[1, 10, 11, 12, 13, 10, 11], [1, 50, 51, 52, 53, 50, 51, 52], [1, 7, 8, 7, 8]]
    runner = TargetRunner(tiny.model, n_slots=2, max_len=128)
    with SpecEngine(runner, build_drafter("mag"), EngineConfig(max_sessions=2),
                    stop_ids={2}) as engine:
        for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=5)):
            results = engine.generate_many([Request(p, 12, params) for p in prompts[:2]])
            results += engine.generate_many([Request(prompts[2], 12, params)])
            if params.greedy:
                for p, r in zip(prompts, results):
                    assert r.token_ids == hf_greedy(tiny.model, p, 12)
    assert len(seen) > 4
