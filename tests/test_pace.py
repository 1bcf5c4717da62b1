"""Admission that knows the machine's speed (``verifier_node.pace``): the estimate a new call is
admitted or refused by, and, through the composed server on real gRPC, a call its deadline
cannot be met for refused at once with a retry-after while the others are served. The pace is
set by hand where the decision is asserted, so no assertion depends on this machine's speed."""

from __future__ import annotations

import grpc
import pytest

from edgespec.config import EngineConfig
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire.convert import retry_after_s
from verifier_node.pace import MIN_STEPS, SAFETY, STALE_S, Pace


def _paced(rate: float, session_rate: float, prefill_rate: float = 0.0) -> Pace:
    pace = Pace()
    for _ in range(MIN_STEPS):
        pace.step(int(rate), max(1, round(rate / session_rate)), 1.0)
    if prefill_rate:
        pace.prefill(int(prefill_rate), 1.0)
    return pace


def _queued_ticket(max_new_tokens: int):
    from edgespec.engine.spec_engine import Request
    from verifier_node.tickets import Ticket

    return Ticket(Request([1, 2, 3], max_new_tokens), None, session_id="ahead")


def test_nothing_is_refused_before_the_pace_is_measured_or_without_a_deadline():
    pace = Pace()
    assert pace.verdict(10_000, 10_000, 0, deadline_s=1.0).admit
    pace.step(10, 1, 1.0)
    assert pace.verdict(10_000, 10_000, 0, deadline_s=1.0).admit  # fewer than MIN_STEPS
    paced = _paced(100, 100)
    assert paced.verdict(10_000, 10_000, 0, deadline_s=None).admit


def test_the_estimate_counts_the_work_ahead_and_the_call_alone():
    pace = _paced(rate=100, session_rate=25)  # 4 sessions a step, 25 tokens/s each
    free = pace.verdict(new_tokens=50, ahead_tokens=0, ahead_prompts=0, deadline_s=10)
    assert free.admit and free.estimate_s == pytest.approx(2.0)  # alone: 50 / 25 = 2 s
    ok = pace.verdict(new_tokens=50, ahead_tokens=100, ahead_prompts=0, deadline_s=10)
    assert ok.admit and ok.estimate_s == pytest.approx(3.0)  # a slot in 1 s, then 2 s
    busy = pace.verdict(new_tokens=50, ahead_tokens=950, ahead_prompts=0, deadline_s=10)
    assert not busy.admit and busy.estimate_s == pytest.approx(11.5)  # 9.5 + 2
    assert busy.retry_after_s == pytest.approx(11.5 - SAFETY * 10)
    assert "retry after 3.5 s" in busy.reason() and "950 tokens" in busy.reason()
    # one that cannot make it even alone is told to change the call, not to wait
    alone = pace.verdict(new_tokens=500, ahead_tokens=0, ahead_prompts=0, deadline_s=10)
    assert not alone.admit and "even alone" in alone.reason() and alone.retry_after_s == 0
    # refused within its deadline but past the margin: the reason says the margin
    close = pace.verdict(new_tokens=50, ahead_tokens=750, ahead_prompts=0, deadline_s=10)
    assert not close.admit and close.estimate_s == pytest.approx(9.5)
    assert f"past the 8.0 s ({SAFETY:.0%} of its deadline)" in close.reason()


def test_a_new_call_waits_only_for_the_sessions_it_needs_a_slot_from():
    """The tokens before a call (``pace.tokens_before_a_slot``): none while a KV slot is
    free, however long the running sessions' outputs; else, every slot busy until the call's
    frees, the running sessions' ends played out and the queued tickets run in order, each
    once a slot frees (not beside the running ones). Each session's tokens left are its
    ticket's (``tokens_left``)."""
    from verifier_node.pace import tokens_before_a_slot, tokens_left

    def before(slots: int, running: list[int], queued: list[int] = ()) -> int:
        return tokens_before_a_slot(slots, [tokens_left(_queued_ticket(n)) for n in running],
                                    [tokens_left(_queued_ticket(n)) for n in queued])

    assert before(8, [1900, 1900]) == 0  # 6 slots free: it runs beside them
    assert before(2, [400]) == 0
    assert before(2, [], [50]) == 0  # the queued one takes a free slot, one is left
    assert before(2, [400, 100]) == 2 * 100  # the 100-token one ends first
    # the queued 300 starts at step 100, when the first slot frees: the call's frees at 400
    assert before(2, [400, 100], [300]) == 2 * 400
    # queued ones run one after another in the one slot that frees: 100 + 4 x 100 steps
    assert before(2, [10_000, 100], [100] * 4) == 2 * 500
    assert before(1, []) == 0


def test_prefills_ahead_count_at_the_measured_prefill_rate():
    pace = _paced(rate=100, session_rate=100, prefill_rate=200)
    assert pace.verdict(10, 0, ahead_prompts=100, deadline_s=1).admit  # 0.1 + 0.5 s
    assert not pace.verdict(10, 0, ahead_prompts=400, deadline_s=1).admit  # 0.1 + 2 s


def test_the_averages_follow_the_machine():
    pace = Pace()
    for _ in range(20):
        pace.step(10, 1, 1.0)
    slow = pace.rate
    for _ in range(20):
        pace.step(100, 1, 1.0)
    assert slow == pytest.approx(10) and pace.rate > 95


def test_an_idle_verifier_whose_pace_is_old_measures_again():
    """The pace updates only as steps run: after a slow spell (found by a hostile client's
    flood: 0.2 tokens/s measured, every 30 s call refused "even alone" while none ran), an
    idle verifier whose last step is older than STALE_S admits a call with nothing ahead of
    it; one with work ahead, or beside a running session, is judged as measured."""
    clock = [100.0]
    pace = Pace(clock=lambda: clock[0])
    for _ in range(MIN_STEPS):
        pace.step(1, 1, 5.0)  # 0.2 tokens a second
    assert "even alone" in pace.verdict(26, 0, 0, deadline_s=30, batch=1).reason()
    clock[0] += STALE_S + 1
    assert pace.verdict(26, 0, 0, deadline_s=30, batch=1).admit  # idle, old: measured again
    assert not pace.verdict(26, 0, 0, deadline_s=30, batch=2).admit  # a session running
    assert not pace.verdict(26, 40, 0, deadline_s=30, batch=1).admit  # work ahead of it
    pace.step(1, 1, 5.0)  # a step measured as slow as before: refused again at once
    assert not pace.verdict(26, 0, 0, deadline_s=30, batch=1).admit


@pytest.mark.slow
def test_a_call_the_pace_cannot_serve_in_time_is_refused_at_once_and_others_are_served(tiny_dir):
    import edgespec
    from edgespec_cli.server import EdgespecServer, ServerOptions

    srv = EdgespecServer(ServerOptions(
        listen="127.0.0.1:0", model=str(tiny_dir), max_drafters=1, drain_timeout_s=5,
        engine=EngineConfig(max_sessions=2, max_context=256))).start()
    try:
        srv.scheduler.pace = _paced(rate=20, session_rate=10)
        addr = f"127.0.0.1:{srv.port}"
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.VerifierStub(ch)
            grpc.channel_ready_future(ch).result(timeout=60)
            with pytest.raises(grpc.RpcError) as e:  # 200 tokens at 10/s: 20 s > 0.8 x 10 s
                list(stub.Generate(pb.GenerateRequest(prompt_ids=[1, 5, 6], max_new_tokens=200),
                                   timeout=10))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "even alone" in e.value.details() and "deadline" in e.value.details()
            # not called load: the verifier is idle (a newcomer's probe read "overloaded")
            assert e.value.details().startswith("cannot finish within its deadline: ")
            assert retry_after_s(e.value) is None  # no retry helps a call that cannot fit alone
        refused = srv.registry.get_sample_value("edgespec:request_refused_deadline_total")
        assert refused == 1
        with edgespec.Client(addr, timeout=10) as client:
            srv.scheduler.pace = _paced(rate=20, session_rate=20)
            with srv.scheduler._lock:  # a long session ahead, one of the two slots free
                srv.scheduler._tickets["ahead"] = _queued_ticket(400)
            try:  # admitted: its 10 tokens come beside the other's (0.5 s at 20/s)
                assert client.generate(prompt_ids=[1, 5, 6], max_new_tokens=10).token_ids
                with srv.scheduler._lock:  # both slots taken: it waits for one to end
                    srv.scheduler._tickets["ahead too"] = _queued_ticket(400)
                with pytest.raises(edgespec.Overloaded) as over:  # 800 tokens at 40/s: 20 s
                    client.generate(prompt_ids=[1, 5, 6], max_new_tokens=10)
            finally:
                with srv.scheduler._lock:
                    srv.scheduler._tickets.pop("ahead", None)
                    srv.scheduler._tickets.pop("ahead too", None)
            assert over.value.retry_after_s is not None and over.value.retry_after_s > 0
            srv.scheduler.pace = _paced(rate=20, session_rate=10)
        with edgespec.Client(addr, timeout=None) as client:  # no deadline: admitted
            out = client.generate(prompt_ids=[1, 5, 6], max_new_tokens=200)
            assert out.finish_reason in ("length", "stop") and out.token_ids
        with edgespec.Client(addr, timeout=120) as client:  # 4 tokens fit its deadline
            assert client.generate(prompt_ids=[1, 5, 6], max_new_tokens=4).token_ids
    finally:
        srv.stop(drain_timeout_s=0)


def test_the_rate_is_projected_to_the_batch_a_call_joins_by_the_forward_cost():
    """Measured with one session a step (1 s a step, 2 tokens, 2 rows), a forward whose cost is
    0.8 s + 0.1 s a row: eight sessions take 2.4 s a step (16 tokens), so 6.67 tokens/s in all
    and 0.83 for one; without a cost model the step time stays as measured."""
    pace = Pace(cost_fit=lambda: (0.8, 0.1))  # 0.8 + 0.1 x 2 rows = 1 s at one session
    for _ in range(MIN_STEPS):
        pace.step(2, 1, 1.0, rows=2)
    rate, single = pace.rates_at(8)
    assert rate == pytest.approx(16 / 2.4) and single == pytest.approx(2 / 2.4)
    flat = _paced(rate=2, session_rate=2)
    assert flat.rates_at(8) == (pytest.approx(16), pytest.approx(2))
    # the verdict reads the rate at the batch it is told
    assert pace.verdict(10, 100, 0, deadline_s=40, batch=8).admit  # 100 / 6.67 + 10 / 0.83
    assert not pace.verdict(10, 100, 0, deadline_s=40, batch=1).admit  # 100 / 2 + 10 / 2
