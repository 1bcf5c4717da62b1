"""Requests arriving together are taken in together and prefilled by the steps, a budget of
prompt tokens a step (``SpecEngine.admit``, ``engine.prefill_queue``): several prompts in one
shared forward, a long prompt over several steps while the running sessions keep getting
tokens. Every output stays identical to target-only greedy decoding; a request the engine
refuses, or whose prefill fails, fails alone; a session cancelled while it waits for its
prefill gives its slot back."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import hf_greedy

from edgespec.config import ConfigError, EngineConfig
from edgespec.engine.spec_engine import Admission, Request, SpecEngine
from edgespec.runner.target_runner import TargetRunner
from verifier_node.scheduler import Scheduler
from verifier_node.tickets import Ticket

WAIT_S = 120
BUDGET = 60  # prompt tokens a step; prompts are cut at multiples of it


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 60) for _ in range(rng.randint(5, 40))] for _ in range(n)]


@pytest.fixture()
def engine(tiny):
    runner = TargetRunner(tiny.model, n_slots=6, max_len=160)
    with SpecEngine(runner, None, EngineConfig(max_sessions=6, max_context=160,
                                               prefill_budget=BUDGET), stop_ids={2}) as e:
        yield e


def _run(engine: SpecEngine) -> None:
    for _ in range(1000):
        if not engine.sessions:
            return
        engine.step()
    raise AssertionError("the sessions did not finish in 1000 steps")


def test_prompts_admitted_together_share_a_prefill_and_decode_as_target_only(tiny, engine,
                                                                             monkeypatch):
    alone: list[int] = []
    prefill = engine.target.prefill
    monkeypatch.setattr(engine.target, "prefill",
                        lambda slot, ids, **kw: alone.append(slot) or prefill(slot, ids, **kw))
    prompts = _prompts(5)
    got = engine.add_many([Admission(Request(p, 24)) for p in prompts])
    assert not any(isinstance(g, Exception) for g in got)
    assert alone == [] and len(engine.active) == 5  # one shared prefill, every prompt in
    _run(engine)
    assert [g.output for g in got] == [hf_greedy(tiny.model, p, 24) for p in prompts]


def test_a_step_prefills_up_to_its_budget_and_the_rest_waits(tiny, engine):
    prompts = [[1] + list(range(3, 32)), [1] + list(range(5, 34))] + _prompts(3, seed=3)
    got = engine.admit([Admission(Request(p, 12)) for p in prompts])
    assert engine.active == [] and len(engine.sessions) == 5
    engine.step()  # 29 + 29 prompt tokens: the budget; the others wait
    assert engine.active[:2] == got[:2] and len(engine.active) == 2
    _run(engine)
    assert [g.output for g in got] == [hf_greedy(tiny.model, p, 12) for p in prompts]


def test_a_long_prompt_is_prefilled_over_steps_while_a_running_stream_gets_tokens(tiny, engine):
    short = _prompts(1, seed=4)[0]
    running = engine.add(Request(short, 30))
    long_prompt = [1] + [random.Random(5).randrange(3, 60) for _ in range(140)]
    [late] = engine.admit([Admission(Request(long_prompt, 8))])
    seen = []
    while late in engine.prefilling.sessions and len(seen) < 10:
        before = len(running.output)
        engine.step()
        seen.append(len(running.output) - before)
    assert seen == [1, 1, 1]  # 140 tokens in parts of 60, 60, 20: a token a step meanwhile
    _run(engine)
    assert running.output == hf_greedy(tiny.model, short, 30)
    assert late.output == hf_greedy(tiny.model, long_prompt, 8)


def test_a_long_prompt_alone_is_prefilled_over_steps_that_verify_nothing(tiny, engine):
    prompt = [1] + [random.Random(7).randrange(3, 60) for _ in range(130)]
    [act] = engine.admit([Admission(Request(prompt, 6))])
    reports = []
    while act in engine.prefilling.sessions and len(reports) < 10:
        reports.append(engine.step())
    # parts of 60, 60 and 10 tokens: the third step's prefill completes it, and it decodes
    assert reports[:2] == [None, None] and len(reports) == 3 and reports[2].sessions == 1
    _run(engine)
    assert act.output == hf_greedy(tiny.model, prompt, 6)


def test_a_refused_request_or_a_failed_prefill_fails_alone(tiny, engine, monkeypatch):
    prompts = _prompts(3, seed=2)
    broken: set[int] = set()
    parts = engine.target.prefill_parts

    def prefill_parts(slots, rows):
        if broken & set(slots):
            raise RuntimeError("a device fault")
        parts(slots, rows)

    monkeypatch.setattr(engine.target, "prefill_parts", prefill_parts)
    errors: list[Exception] = []
    got = engine.admit([Admission(Request(prompts[0], 16)), Admission(Request([1, 10_000], 8)),
                        Admission(Request(prompts[1], 16)), Admission(Request(prompts[2], 16))])
    assert isinstance(got[1], ConfigError)  # a token outside the vocabulary
    got[3].on_error = errors.append
    broken.add(got[3].slot)
    _run(engine)
    assert len(errors) == 1 and got[3] not in engine.sessions
    assert engine.free_slots == 6
    assert [got[0].output, got[2].output] == [hf_greedy(tiny.model, p, 16) for p in prompts[:2]]


def test_a_session_cancelled_while_waiting_for_its_prefill_gives_its_slot_back(engine):
    [act] = engine.admit([Admission(Request([1] * 100, 4))])
    finished = []
    act.on_finish = finished.append
    assert engine.cancel(act.sid)
    assert engine.sessions == [] and engine.free_slots == 6
    assert [r.finish_reason for r in finished] == ["cancelled"]


def test_the_scheduler_streams_a_burst_identical_to_target_only(tiny, engine):
    prompts = _prompts(5, seed=6)
    sched = Scheduler(engine, max_queue=8)
    tickets = [sched.submit(Ticket(Request(p, 12), None)) for p in prompts]
    sched.start()
    try:
        for t in tickets:
            with t.cond:
                assert t.cond.wait_for(lambda t=t: t.result is not None or t.error is not None,
                                       WAIT_S)
    finally:
        sched.stop()
    assert not sched.is_alive()
    assert [t.error for t in tickets] == [None] * 5
    assert [t.result.token_ids for t in tickets] == [hf_greedy(tiny.model, p, 12)
                                                     for p in prompts]
    assert sched.pace.prefill_rate > 0  # the steps' prefill fed the pace


def _ended(t: Ticket) -> bool:
    with t.cond:
        return t.cond.wait_for(lambda: t.result is not None or t.error is not None, WAIT_S)


def test_a_step_that_raises_fails_its_sessions_and_the_loop_serves_on_even_if_a_fail_raises(
        tiny, engine, monkeypatch):
    """A step raises (a bug) and failing one of its sessions raises too (its callback broke):
    the scheduler's loop lives on, fails the other session, and serves the next request as
    target-only decoding would."""
    prompts = _prompts(3, seed=7)
    sched = Scheduler(engine, max_queue=8)
    first = [sched.submit(Ticket(Request(p, 12), None)) for p in prompts[:2]]
    real_step, real_fail, broken = engine.step, engine.fail, []

    def step_once_broken():
        if not broken and len(engine.active) == 2:
            broken.append("step")
            raise RuntimeError("a bug in the step")
        return real_step()

    def fail(act, exc):
        if len(broken) == 1:  # the first session the loop fails: its fail raises
            broken.append(act.sid)
            raise RuntimeError("a broken callback")
        return real_fail(act, exc)

    monkeypatch.setattr(engine, "step", step_once_broken)
    monkeypatch.setattr(engine, "fail", fail)
    sched.start()
    try:
        assert all(_ended(t) for t in first)
        failed = [t for t in first if t.error is not None]
        later = sched.submit(Ticket(Request(prompts[2], 12), None))
        assert _ended(later)
    finally:
        sched.stop()
    assert len(broken) == 2 and len(failed) == 1  # the other session failed, once
    assert later.error is None and later.result.token_ids == hf_greedy(tiny.model, prompts[2], 12)


def test_the_prefill_budget_must_be_positive():
    with pytest.raises(ConfigError, match="prefill_budget"):
        EngineConfig(prefill_budget=0)


class RecordingWriter:
    """A prompt writer that records what it is asked to write (the queue's logic alone)."""

    def __init__(self):
        self.calls: list[list[tuple[int, int]]] = []  # per write: (slot, tokens)
        self.lengths: dict[int, int] = {}

    def prefill_parts(self, slots, parts, reads=None) -> None:
        self.calls.append([(s, len(p)) for s, p in zip(slots, parts)])
        if reads is not None:  # each read gets logits [1, T, V] of its part's T positions
            for part, read in zip(parts, reads):
                if read is not None:
                    read(torch.zeros(1, len(part), 5))
        for s, p in zip(slots, parts):
            self.lengths[s] = self.lengths.get(s, 0) + len(p)

    def rollback(self, slot, length) -> None:
        self.lengths[slot] = length


def _waiting(queue, slot: int, n: int):
    from edgespec.drafters.adaptive import DraftLength
    from edgespec.engine.generation import ActiveSession

    act = ActiveSession(f"s{slot}", Request([1] * (n + 1), 4), slot, DraftLength(4))
    queue.add(act, [1] * n)
    return act


def test_a_step_spends_its_budget_in_passes_of_whole_chunks_oldest_first():
    from edgespec.engine.prefill_queue import PrefillQueue

    writer = RecordingWriter()
    queue = PrefillQueue(writer, chunk=4)
    a, b, c = _waiting(queue, 0, 9), _waiting(queue, 1, 3), _waiting(queue, 2, 0)
    step = queue.advance(10)
    # pass 1: a's 4, b's 3, c's none (left 3); pass 2: a's next 4 does not fit
    assert writer.calls == [[(0, 4), (1, 3)]] and step.tokens == 7
    assert step.ready == [b, c] and queue.tokens_left == 5
    step = queue.advance(10)  # a's 4 then its last 1: two passes in one step
    assert writer.calls[1:] == [[(0, 4)], [(0, 1)]] and step.ready == [a]
    assert writer.lengths == {0: 9, 1: 3} and queue.tokens_left == 0 and len(queue) == 0


class RecordingReader:
    """A part reader that records the parts it was handed (their starts and lengths)."""

    def __init__(self, chunk: int, until: int):
        self.chunk, self.until, self.got = chunk, until, []

    def reads(self, start: int) -> bool:
        return start < self.until

    def read(self, start: int, logits) -> None:
        self.got.append((start, logits.shape[1]))


def test_a_read_prompt_is_cut_at_its_readers_chunk_and_read_where_it_asks():
    """A prompt whose logits are read shares the passes with the others, its parts ending at
    multiples of its reader's chunk (not the queue's); a part past what the reader reads (a
    resumed session's committed tokens) is written without a read."""
    from edgespec.drafters.adaptive import DraftLength
    from edgespec.engine.generation import ActiveSession
    from edgespec.engine.prefill_queue import PrefillQueue

    writer = RecordingWriter()
    queue = PrefillQueue(writer, chunk=8)
    plain = _waiting(queue, 0, 10)
    reader = RecordingReader(chunk=3, until=6)
    read = ActiveSession("r", Request([1] * 9, 4), 1, DraftLength(4))
    queue.add(read, [1] * 8, reader)
    step = queue.advance(None)
    assert writer.calls == [[(0, 8), (1, 3)], [(0, 2), (1, 3)], [(1, 2)]]
    assert reader.got == [(0, 3), (3, 3)]  # the part from 6 holds no position it reads
    assert step.ready == [plain, read] and step.readers == {id(read): reader}


def test_a_part_larger_than_the_budget_still_moves_a_step():
    from edgespec.engine.prefill_queue import PrefillQueue

    writer = RecordingWriter()
    queue = PrefillQueue(writer, chunk=8)
    act = _waiting(queue, 0, 8)
    assert queue.advance(3).ready == [act] and writer.calls == [[(0, 8)]]


def test_generate_many_with_a_refused_request_runs_and_keeps_none(tiny, engine):
    prompts = _prompts(3, seed=8)
    with pytest.raises(ConfigError):
        engine.generate_many([Request(prompts[0], 8), Request([1, 10_000], 8),
                              Request(prompts[1], 8)])
    assert engine.sessions == [] and engine.free_slots == 6


def test_once_the_store_is_unreachable_the_rest_of_a_batch_is_not_tried(engine, monkeypatch):
    from edgespec.protocol.contract import StoreUnavailable

    tried = []

    def create(sid, *args, **kw):
        tried.append(sid)
        raise StoreUnavailable("the draft cache's Redis: down")

    monkeypatch.setattr(engine.store, "create", create)
    got = engine.admit([Admission(Request(p, 4)) for p in _prompts(3, seed=9)])
    assert len(tried) == 1 and all(isinstance(g, StoreUnavailable) for g in got)
    assert engine.sessions == [] and engine.free_slots == 6


def test_a_prefill_whose_report_raised_is_not_reported_again(tiny, engine):
    """The prefill reports (``on_prefill``: the scheduler's pace) are taken before they are
    made: one that raised is not made again at every later step, and the others are made once
    each."""
    reports: list[int] = []

    def on_prefill(tokens: int, seconds: float) -> None:
        reports.append(tokens)
        if len(reports) == 1:
            raise RuntimeError("a pace that broke")

    engine.on_prefill = on_prefill
    first, second = _prompts(2, seed=3)
    engine.admit([Admission(Request(first, 4))])
    with pytest.raises(RuntimeError, match="a pace that broke"):
        engine.step()  # its prefill's report raised
    engine.admit([Admission(Request(second, 4))])
    _run(engine)
    assert reports == [len(first) - 1, len(second) - 1]  # (a prompt's last token: its first step's)
