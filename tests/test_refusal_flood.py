"""A board that floods the cache with chunks it refuses (sessions that do not exist, another
board's) is held back at the refusals' pace (``cache_service.refusal_pace``): its Attach stream
is read more slowly, stays attached (its silence while unread is not held against it) and has
every refusal answered, another board's chunks are stored meanwhile, attaching again starts
where its pace left off, and the cache says once that it holds the board back; PushDraft
refuses unchecked past the pace. Found by a hostile board's probe: 10,000 refusals a second
took 93% of the server's core and doubled every session's latency."""

from __future__ import annotations

import logging
import time

import grpc

from cache_service.refusal_pace import RefusalPace, RefusalPaces
from edgespec.config import SamplingParams
from edgespec.v1 import edgespec_pb2 as pb

# the in-process cache: its fixtures (used by name) and helpers
from cache_harness import Stream, cache, code_of, redis_handle, store  # noqa: F401

NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _flood(stream: Stream, tag: str, chunks: int) -> None:
    """One DraftChunks of ``chunks`` chunks for sessions that do not exist."""
    stream.out.put(pb.DrafterMessage(chunks=pb.DraftChunks(chunks=[
        pb.DraftChunk(session_id=f"nope{tag}x{i}", epoch=0, start=3, tokens=[5])
        for i in range(chunks)])))


def _wait_for(what: str, ready, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


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
    paces = RefusalPaces(lambda: RefusalPace(rate=1.0, burst=1.0, clock=clock))
    assert paces.after("a", 3) == (2.0, True) and paces.after("a", 0) == (2.0, False)
    assert paces.after("b", 1) == (0.0, False)  # each board its own


def test_a_board_flooding_refused_chunks_is_held_back_and_nobody_else_waits(cache, store,
                                                                            caplog):
    intake = cache.service.intake
    intake.paces = RefusalPaces(lambda: RefusalPace(rate=100.0, burst=10.0))
    store.create("s1", [1, 2, 3], SamplingParams(), "honest")
    caplog.set_level(logging.WARNING, logger="edgespec.cache")
    evil, honest = Stream(cache.channel, "evil"), Stream(cache.channel, "honest")
    evil.next("registered")
    honest.next("registered")
    for burst in range(3):  # 150 chunks for sessions that do not exist
        _flood(evil, str(burst), 50)
    honest.send(pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5, 6]))
    ack = honest.next("ack")
    assert (ack.session_id, ack.code, ack.kept) == ("s1", grpc.StatusCode.OK.value[0], 2)
    refused = [evil.next("ack") for _ in range(150)]  # every one answered: still attached
    assert {a.code for a in refused} == {NOT_FOUND}
    _wait_for("the flood's pace held the board", lambda: intake.paces.of("evil").held >= 1)
    assert intake.paces.of("honest").held == 0  # the other board's pace is its own
    said = [r.getMessage() for r in caplog.records if "refused faster than" in r.getMessage()]
    assert len(said) == 1 and "drafter evil" in said[0], said
    for s in (evil, honest):
        s.close()


def test_a_held_board_is_not_detached_for_its_silence_nor_spared_by_attaching_again(cache,
                                                                                      store):
    """Held back 2 s while announcing a 0.3 s heartbeat (the cache detaches a board silent for
    three of them): its messages are unread for the cache's own reason, so it stays attached.
    Attaching again, it keeps its pace (a new stream used to start with a fresh burst)."""
    intake = cache.service.intake
    intake.paces = RefusalPaces(lambda: RefusalPace(rate=0.01, burst=10.0, max_wait_s=2.0))
    store.create("s1", [1, 2, 3], SamplingParams(), "evil")
    evil = Stream(cache.channel, "evil", heartbeat_ms=300)  # sends none by itself
    evil.next("registered")
    evil.next("assignment")
    _flood(evil, "a", 20)  # 10 past the burst: a 2 s hold (capped)
    assert {evil.next("ack").code for _ in range(20)} == {NOT_FOUND}
    pace = intake.paces.of("evil")
    _wait_for("the board held back", lambda: pace.held == 1)
    evil.send(pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5]))
    ack = evil.next("ack")  # read once the hold ends: the stream was not detached meanwhile
    assert (ack.session_id, ack.code) == ("s1", grpc.StatusCode.OK.value[0])
    evil.close()
    again = Stream(cache.channel, "evil")
    again.next("registered")
    _flood(again, "b", 1)
    assert again.next("ack").code == NOT_FOUND
    assert intake.paces.of("evil") is pace
    _wait_for("the board held back again", lambda: pace.held == 2)  # no fresh burst
    again.close()


def test_pushed_chunks_refused_too_fast_are_refused_unchecked_for_a_while(cache, store, caplog):
    """PushDraft's refusals share one pace without device tokens (its device is the caller's
    word): past it, every pushed chunk, an honest one too, is refused RESOURCE_EXHAUSTED
    without a look at the store, and the cache says so once."""
    # a refill of one refusal a hundred seconds: nothing refills within the test
    cache.service.intake.paces = RefusalPaces(lambda: RefusalPace(rate=0.01, burst=3.0))
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    caplog.set_level(logging.WARNING, logger="edgespec.cache")
    unknown = pb.DraftChunk(session_id="nope", epoch=0, start=3, tokens=[5])
    codes = [code_of(lambda: cache.push(unknown, device="dev1")) for _ in range(4)]
    assert codes == [grpc.StatusCode.NOT_FOUND] * 4  # the burst, and one past it, checked
    honest = pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5])
    for device in ("dev1", "dev2"):  # whatever device the caller names
        assert code_of(lambda: cache.push(honest, device=device)) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
    said = [r.getMessage() for r in caplog.records if "PushDraft refuses" in r.getMessage()]
    assert len(said) == 1
    cache.service.intake.paces = RefusalPaces()  # a fresh pace: checked and stored again
    assert cache.push(honest, device="dev1").kept == 1


def _empty(idle: bool, quiet: bool = True) -> pb.DraftChunk:
    return pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[], idle=idle, quiet=quiet)


def test_chunks_that_tell_nothing_are_paced_as_refusals_and_wake_no_verifier(cache, store):
    """A board flipping its own session's idle flag with empty chunks (found by a hostile
    board's probe: 22,810 such chunks a second, never paced, each waking every verifier) is
    paced as a refusing one: only a chunk that keeps tokens or says the drafter is newly idle
    is news, and only news wakes a verifier."""
    intake = cache.service.intake
    intake.paces = RefusalPaces(lambda: RefusalPace(rate=0.01, burst=2.0, max_wait_s=1.0))
    store.create("s1", [1, 2, 3], SamplingParams(), "evil")
    wakes = store.redis.pubsub(ignore_subscribe_messages=True)
    wakes.subscribe(store.keys.wake)
    evil = Stream(cache.channel, "evil")
    evil.next("registered")
    evil.next("assignment")
    for idle in (True, False, True, False, False):  # news, none, news, none, none
        evil.send(_empty(idle))
    evil.send(pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5]))  # news
    ack = evil.next("ack")  # read after the five before it (a stream's chunks in order)
    assert (ack.code, ack.kept) == (grpc.StatusCode.OK.value[0], 1)
    assert intake.paces.of("evil").held >= 1  # three with no news, past a burst of two
    heard = []
    deadline = time.monotonic() + 2.0  # the script published before it answered the push
    while time.monotonic() < deadline and len(heard) < 3:
        msg = wakes.get_message(timeout=0.1)
        if msg is not None:
            heard.append(msg["data"])
    assert heard == [store.keys.session("s1")[0].encode()] * 3  # the idle flips: once each way
    wakes.close()
    evil.close()


def test_pushed_chunks_with_no_news_are_paced_and_the_refused_read_nothing(cache, store,
                                                                           monkeypatch):
    """PushDraft: an empty chunk that leaves the session as it was counts against the pace;
    past it, a chunk is refused before the cache reads anything from Redis (the target's
    vocabulary included)."""
    cache.service.intake.paces = RefusalPaces(lambda: RefusalPace(rate=0.01, burst=2.0))
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    reads = []
    vocab = cache.service._vocab
    monkeypatch.setattr(cache.service, "_vocab", lambda: reads.append(1) or vocab())
    for _ in range(3):  # not idle already: each tells nothing (the third runs past the burst)
        assert cache.push(_empty(False, quiet=False), device="dev1").kept == 0
    assert code_of(lambda: cache.push(_empty(True), device="dev1")) == \
        grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(reads) == 3  # the refused push read no vocabulary
