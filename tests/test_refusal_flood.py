"""A board that floods the cache with chunks it refuses (sessions that do not exist, another
board's) is read no faster than the refusals' pace (``chunk_intake.RefusalPace``): its stream
stays attached and every refusal is answered, another board's chunks are stored meanwhile, and
the cache says once that it holds the board back. Found by a hostile board's probe: 10,000
refusals a second took 93% of the server's core and doubled every session's latency."""

from __future__ import annotations

import logging

import grpc

from cache_service.chunk_intake import RefusalPace
from edgespec.config import SamplingParams
from edgespec.v1 import edgespec_pb2 as pb

# the in-process cache: its fixtures (used by name) and helpers
from cache_harness import Stream, cache, redis_handle, store  # noqa: F401


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_pace_lets_a_burst_through_then_asks_for_the_time_its_refusals_take():
    clock = FakeClock()
    pace = RefusalPace(rate=2.0, burst=4.0, clock=clock)
    assert pace.after(3) == 0.0 and pace.held == 0  # within the burst
    assert pace.after(3) == 1.0 and pace.held == 1  # 2 past it, at 2 a second
    clock.now += 1.0
    assert pace.after(0) == 0.0  # the second waited refilled what was owed
    clock.now += 60.0  # a long quiet spell refills the burst, no more
    assert pace.after(4) == 0.0
    assert pace.after(1) == 0.5
    assert pace.after(0) == 0.5  # still owed: no time has passed
    assert pace.held == 3
    assert pace.after(10 ** 6) == 5.0  # one message owes at most max_wait_s
    clock.now += 5.0
    assert pace.after(0) == 0.0


def test_a_board_flooding_refused_chunks_is_held_back_and_nobody_else_waits(cache, store,
                                                                            caplog):
    cache.service.intake.refusal_pace = lambda: RefusalPace(rate=100.0, burst=10.0)
    store.create("s1", [1, 2, 3], SamplingParams(), "honest")
    caplog.set_level(logging.WARNING, logger="edgespec.cache")
    evil, honest = Stream(cache.channel, "evil"), Stream(cache.channel, "honest")
    evil.next("registered")
    honest.next("registered")
    for burst in range(3):  # 150 chunks for sessions that do not exist
        evil.out.put(pb.DrafterMessage(chunks=pb.DraftChunks(chunks=[
            pb.DraftChunk(session_id=f"nope{burst}x{i}", epoch=0, start=3, tokens=[5])
            for i in range(50)])))
    honest.send(pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5, 6]))
    ack = honest.next("ack")
    assert (ack.session_id, ack.code, ack.kept) == ("s1", grpc.StatusCode.OK.value[0], 2)
    refused = [evil.next("ack") for _ in range(150)]  # every one answered: still attached
    assert {a.code for a in refused} == {grpc.StatusCode.NOT_FOUND.value[0]}
    said = [r.getMessage() for r in caplog.records if "refused faster than" in r.getMessage()]
    assert len(said) == 1 and "drafter evil" in said[0], said
    for s in (evil, honest):
        s.close()


def test_pushed_chunks_refused_too_fast_are_refused_unchecked_for_a_while(cache, store, caplog):
    """PushDraft's refusals share one pace (its device is the caller's word): past it, every
    pushed chunk, an honest one too, is refused RESOURCE_EXHAUSTED without a look at the
    store, and the cache says so once."""
    from cache_harness import code_of

    # a refill of one refusal a hundred seconds: nothing refills within the test
    cache.service.intake.push_pace = RefusalPace(rate=0.01, burst=3.0)
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    caplog.set_level(logging.WARNING, logger="edgespec.cache")
    unknown = pb.DraftChunk(session_id="nope", epoch=0, start=3, tokens=[5])
    codes = [code_of(lambda: cache.push(unknown, device="dev1")) for _ in range(4)]
    assert codes == [grpc.StatusCode.NOT_FOUND] * 4  # the burst, and one past it, checked
    honest = pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5])
    for _ in range(2):
        assert code_of(lambda: cache.push(honest, device="dev1")) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
    said = [r.getMessage() for r in caplog.records if "PushDraft refuses" in r.getMessage()]
    assert len(said) == 1
    cache.service.intake.push_pace = RefusalPace()  # a fresh pace: checked and stored again
    assert cache.push(honest, device="dev1").kept == 1
