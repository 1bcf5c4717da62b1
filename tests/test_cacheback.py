"""Cacheback: LRU n-gram tables per session, per drafter and fleet-wide (in Redis, synced to
drafters in the background); lossless through the engine and the distributed path."""

from __future__ import annotations

import time

import grpc
import pytest
from conftest import hf_greedy

import edgespec
from cache_service.fleet_table import RedisFleetTable
from cache_service.redis_conn import RedisHandle
from cache_service.store import RedisSessionStore
from drafter_node.fleet_client import RemoteFleetTable
from edgespec.config import EngineConfig, SamplingParams
from edgespec.drafters import build_drafter
from edgespec.drafters.cacheback import CachebackDrafter, FleetSync, NgramTable
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.protocol.fleet_table import ngram_pairs
from edgespec.runner.target_runner import TargetRunner
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from procs import start_drafter, start_serve

# every step waits for the draft with a fixed length: what is drafted does not depend on timing
FIXED = EngineConfig(max_draft=6, adaptive=False, draft_wait_ms=5000)


@pytest.fixture()
def redis_client(redis_url):
    handle = RedisHandle(redis_url)
    handle.client.flushdb()
    yield handle.client
    handle.close()


def test_ngram_pairs_cover_every_order_after_start():
    pairs = list(ngram_pairs([1, 2, 3, 4], start=3))
    assert pairs == [((1, 2, 3), 4), ((2, 3), 4), ((3,), 4)]
    assert list(ngram_pairs([5], 0)) == []


def test_table_keeps_recent_followers_first_and_is_bounded():
    t = NgramTable(max_leaders=100, max_followers=2)
    t.observe([7, 1, 7, 2, 7, 3])
    assert t.follower((7,)) == 3  # the most recent
    assert t._followers[(7,)] == [3, 2]  # at most two, the oldest dropped
    t = NgramTable(max_leaders=3)
    t.observe([7, 1])
    t.observe(list(range(10, 20)))
    assert len(t) == 3  # least recently used leaders forgotten
    assert t.follower((7,)) is None


def test_chained_lookups_and_the_weak_limit():
    d = CachebackDrafter(weak_limit=1)
    s = d.open([1, 2, 3, 4, 1, 2, 3, 5, 1, 2], SamplingParams())
    assert s.propose(5).tokens == [3, 5, 1, 2, 3]  # order-3 and order-2 leaders chain
    assert s.tokens[-5:] == [3, 5, 1, 2, 3]
    lone = d.open([40, 41, 42, 43], SamplingParams())
    assert lone.propose(5).tokens == []  # no leader ending the prompt is known anywhere
    d = CachebackDrafter(weak_limit=1)
    d.table.observe([5, 8])
    d.table.observe([8, 6])
    # only one-token leaders match: one weak guess, no chain of guesses
    assert d.open([1, 5], SamplingParams()).propose(5).tokens == [8]
    d.weak_limit = 2
    assert d.open([1, 5], SamplingParams()).propose(5).tokens == [8, 6]


def test_confirmed_tokens_teach_the_drafter_and_retract_teaches_nothing():
    d = CachebackDrafter()
    s = d.open([1, 2, 3], SamplingParams())
    s.append([60, 61, 62])
    s.retract(4)  # a cascade taking its own draft back
    assert d.table.follower((60,)) is None
    s.append([70, 71])
    s.rollback(6)  # the verifier fixed position 6: tokens up to it are confirmed
    assert d.table.follower((3, 60)) == 70
    other = d.open([5, 60], SamplingParams())  # another session of the same device
    assert other.propose(2).tokens == [70, 71]


def test_mag_first_then_cacheback():
    d = build_drafter("mag+cacheback")
    s = d.open([4, 5, 6, 7, 4, 5], SamplingParams())
    assert s.propose(3).tokens == [6, 7, 4]  # the longest suffix match [4, 5]
    d.table.observe([90, 91, 92, 93])
    s2 = d.open([1, 90, 91], SamplingParams())
    assert s2.propose(2).tokens == [92, 93]  # no match in the session: Cacheback's table


def test_redis_fleet_table_pulls_changes_in_pieces_and_stays_bounded(redis_client):
    fleet = RedisFleetTable(redis_client, prefix="t:", max_leaders=50)
    fleet.record([1, 2, 3, 4, 5])
    first = fleet.pull(0, limit=4)
    assert len(first.entries) == 4 and first.more
    rest = fleet.pull(first.version, limit=100)
    assert not rest.more
    got = {e.leader: e.followers for e in first.entries + rest.entries}
    assert got[(1, 2, 3)] == (4,) and got[(4,)] == (5,) and len(got) == 9
    assert fleet.pull(rest.version).entries == []  # nothing changed since
    fleet.record([3, 9])
    changed = fleet.pull(rest.version)
    assert [(e.leader, e.followers) for e in changed.entries] == [((3,), (9, 4))]
    fleet.record(list(range(100, 400)))
    assert fleet.size() <= 50  # the least recently updated leaders were evicted
    assert redis_client.hlen("t:cb:f") == fleet.size()


def test_a_closed_session_teaches_the_fleet_table_its_output(redis_client):
    store = RedisSessionStore(redis_client, prefix="t:", ttl_s=30)
    store.create("s1", [1, 2, 3], SamplingParams(), None, committed=[4, 5])
    store.close("s1", "stop")  # recorded by the store's recorder thread, soon
    deadline = time.monotonic() + 60
    while not store.fleet.pull(0).entries and time.monotonic() < deadline:
        time.sleep(0.05)
    got = {e.leader: e.followers for e in store.fleet.pull(0).entries}
    assert got[(1, 2, 3)] == (4,) and got[(2, 3, 4)] == (5,)
    assert (1, 2) not in got  # the prompt's own pairs are not recorded, only its tail as leaders
    store.shutdown()


def test_fleet_sync_copies_the_table_into_a_drafter(redis_client):
    fleet = RedisFleetTable(redis_client, prefix="t:")
    d = CachebackDrafter()
    sync = FleetSync(fleet, d.fleet_mirror)
    fleet.record([11, 12, 13, 14])
    assert sync.pull_now() == 6
    assert d.fleet_mirror.follower((11, 12, 13)) == 14
    fleet.clear()  # the table starts over (a Redis without persistence restarted)
    fleet.record([21, 22])
    assert sync.pull_now() == 1 and d.fleet_mirror.follower((21,)) == 22
    s = d.open([7, 11, 12], SamplingParams())
    assert s.propose(2).tokens == [13, 14]  # drafted from the fleet's tokens alone


@pytest.mark.parametrize("spec", ["cacheback", "mag+cacheback"])
def test_engine_output_identical_to_target_only(tiny, looping, spec):
    for model, prompt in ((tiny, [1, 5, 9, 5, 9, 5]), (looping, [1, 30, 31, 30, 31, 30])):
        runner = TargetRunner(model.model, n_slots=2, max_len=256)
        with SpecEngine(runner, build_drafter(spec), FIXED, stop_ids={2}) as engine:
            res = engine.generate(Request(prompt, 40))
        assert res.token_ids == hf_greedy(model.model, prompt, 40)


def test_seeded_sampling_identical_to_target_only(looping):
    prompt = [1, 30, 31, 30, 31, 30]
    params = SamplingParams(temperature=0.8, top_k=20, seed=1234)
    runner = TargetRunner(looping.model, n_slots=2, max_len=256)
    outs = []
    for spec in ("none", "cacheback"):
        drafter = build_drafter(spec)
        with SpecEngine(runner, drafter, FIXED, stop_ids={2}) as engine:
            outs.append(engine.generate(Request(prompt, 40, params)).token_ids)
    assert outs[0] == outs[1]


def test_a_warm_fleet_table_lets_another_device_draft_what_the_first_produced(tiny,
                                                                                 redis_client):
    fleet = RedisFleetTable(redis_client, prefix="t:")
    prompt = [1, 7, 3, 9, 4, 12, 6]
    ref = hf_greedy(tiny.model, prompt, 40)
    runner = TargetRunner(tiny.model, n_slots=2, max_len=256)
    device_a, device_b = CachebackDrafter(fleet=fleet), CachebackDrafter(fleet=fleet)
    with SpecEngine(runner, device_a, FIXED, stop_ids={2}, fleet=fleet) as engine:
        cold = engine.generate(Request(prompt, 40))
    FleetSync(fleet, device_b.fleet_mirror).pull_now()
    with SpecEngine(runner, device_b, FIXED, stop_ids={2}) as engine:
        warm = engine.generate(Request(prompt, 40))
    assert cold.token_ids == warm.token_ids == ref
    assert warm.stats.accepted_tokens > cold.stats.accepted_tokens
    # the repeated request is drafted almost whole from the fleet's table
    assert warm.stats.accepted_tokens >= len(ref) // 2


@pytest.fixture(scope="module")
def cacheback_cluster(looping_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cb-cluster")
    serve, address = start_serve(looping_dir, tmp, None, token="tok",
                                 extra=["--draft-wait-ms", 5000, "--no-adaptive"])
    drafter = start_drafter(address, "cb-1", tmp, "cacheback", token="tok")
    drafter.wait_for("attached to")
    yield address
    assert (drafter.stop(), serve.stop()) == (0, 0)
    log = drafter.text()  # the drafter's own lines, first to last
    assert log.index("edgespec: drafter cb-1: loading cacheback") < log.index("attaching to")
    assert log.index("attached to") < log.index("edgespec: drafter cb-1 stopped")


@pytest.mark.slow  # a serve process and drafters
def test_distributed_cacheback_is_lossless_and_feeds_the_fleet_table(cacheback_cluster, looping):
    prompt = [1, 40, 41, 40, 41, 40, 41]
    with edgespec.Client(cacheback_cluster, token="tok", timeout=120) as c:
        res = c.generate(prompt_ids=prompt, max_new_tokens=30, device_id="cb-1")
    assert res.token_ids == hf_greedy(looping.model, prompt, 30)
    out = prompt + res.token_ids
    leader = tuple(out[4:7])  # the prompt's tail, followed by the first output token
    table = RemoteFleetTable(cacheback_cluster, token="tok")
    try:
        deadline = time.monotonic() + 60
        while True:  # the verifier records a closed session in the background
            pulled = table.pull(0, limit=8192)
            got = {e.leader: e.followers for e in pulled.entries}
            if leader in got or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        table.close()
    assert got[leader][0] == out[7]  # the session's first output token, learned
    assert pulled.version > 0


def test_fleet_table_needs_the_token(cacheback_cluster):
    with grpc.insecure_channel(cacheback_cluster) as ch:
        stub = pb_grpc.DraftCacheStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.FleetTable(pb.FleetTableRequest(since=0), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.FleetTable(pb.FleetTableRequest(since=-1), timeout=10,
                            metadata=[("authorization", "Bearer tok")])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
