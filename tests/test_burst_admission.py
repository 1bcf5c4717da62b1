"""Requests arriving together are admitted together: their prompts prefilled in one shared
prefill (``SpecEngine.add_many``), up to the prefill budget's prompt tokens between two steps
(at least one request), so a burst delays the running streams by a bounded prefill a step. Each
output stays identical to target-only greedy decoding; a request the engine refuses fails
alone, its neighbours in the batch admitted."""

from __future__ import annotations

import random

import pytest
from conftest import hf_greedy

from edgespec.config import ConfigError, EngineConfig
from edgespec.engine.spec_engine import Admission, Request, SpecEngine
from edgespec.runner.target_runner import TargetRunner
from verifier_node.scheduler import Scheduler, Ticket

WAIT_S = 120


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 60) for _ in range(rng.randint(5, 40))] for _ in range(n)]


@pytest.fixture()
def engine(tiny):
    runner = TargetRunner(tiny.model, n_slots=6, max_len=128)
    with SpecEngine(runner, None, EngineConfig(max_sessions=6, max_context=128,
                                               prefill_budget=60), stop_ids={2}) as e:
        yield e


def test_admitting_a_batch_keeps_every_output_identical_to_target_only(tiny, engine,
                                                                      monkeypatch):
    alone: list[int] = []
    prefill = engine.target.prefill
    monkeypatch.setattr(engine.target, "prefill",
                        lambda slot, ids, **kw: alone.append(slot) or prefill(slot, ids, **kw))
    prompts = _prompts(5)
    got = engine.add_many([Admission(Request(p, 24)) for p in prompts])
    assert len(got) == 5 and not any(isinstance(g, Exception) for g in got)
    assert alone == []  # one shared prefill, none alone
    while engine.active:
        engine.step()
    assert [g.output for g in got] == [hf_greedy(tiny.model, p, 24) for p in prompts]


def test_a_refused_request_in_a_batch_fails_alone(tiny, engine):
    prompts = _prompts(3, seed=2)
    bad = Request([1, 10_000], 8)  # a token outside the vocabulary
    got = engine.add_many([Admission(Request(prompts[0], 16)), Admission(bad),
                           Admission(Request(prompts[1], 16))])
    assert isinstance(got[1], ConfigError)
    assert engine.free_slots == 6 - 2  # the refused request's slot was never kept
    while engine.active:
        engine.step()
    assert [got[0].output, got[2].output] == [hf_greedy(tiny.model, p, 16)
                                              for p in prompts[:2]]


def test_the_scheduler_admits_up_to_the_prefill_budget_between_two_steps(tiny, engine):
    """Prompts of 30 tokens against a budget of 60: two a step (the first always admitted,
    even past the budget), the streams identical to target-only decoding."""
    prompts = [[1] + list(range(3, 32)) for _ in range(2)] + _prompts(3, seed=3)
    sched = Scheduler(engine, max_queue=8)
    tickets = [sched.submit(Ticket(Request(p, 12), None)) for p in prompts]
    sched._admit()  # the loop's admission, before its first step
    assert len(engine.active) == 2  # 30 + 30 tokens: the budget
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


def test_a_prompt_longer_than_the_budget_is_admitted_alone(engine):
    sched = Scheduler(engine, max_queue=8)
    for p in ([1] * 100, [1] * 5):
        sched.submit(Ticket(Request(p, 4), None))
    sched._admit()
    assert [len(a.req.prompt_ids) for a in engine.active] == [100]
    sched._admit()
    assert [len(a.req.prompt_ids) for a in engine.active] == [100, 5]


def test_the_prefill_budget_must_be_positive():
    with pytest.raises(ConfigError, match="prefill_budget"):
        EngineConfig(prefill_budget=0)
