"""The draft cache and an edge drafter count what really crosses their link (an in-process
DraftCache on loopback, the embedded Redis): attaches, chunks and tokens, acknowledgements'
round trips, fixes, refusals by code on both sides; ``edgespec drafter --metrics-port`` serves a
board's over HTTP, and a port that cannot be is refused before anything starts."""

from __future__ import annotations

import re
import urllib.request

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from cache_service.metrics import CacheMetrics
from drafter_node.agent import ACK_EVERY, DrafterAgent
from drafter_node.metrics import DrafterMetrics
from edgespec.config import SamplingParams
from edgespec.protocol.contract import Verdict
from edgespec.v1 import edgespec_pb2 as pb

# the in-process cache of the hostile-drafter tests: its fixtures (used by name) and helpers
from cache_harness import (  # noqa: F401
    Cache, SlotDrafter, draft_len, eventually, redis_handle, start_agent, store)


def value(registry, name, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_cache_and_drafter_count_what_crosses_the_link(store):
    cache_reg, drafter_reg = CollectorRegistry(), CollectorRegistry()
    cache = Cache(store)
    cache.service.metrics = CacheMetrics(cache_reg)  # before any call: the service reads it late
    dm = DrafterMetrics(drafter_reg)
    agent = DrafterAgent(cache.address, "edge-m", SlotDrafter(), window=4, chunk=2, metrics=dm)
    t = start_agent(agent)
    try:
        eventually(lambda: value(cache_reg, "edgespec:drafters_attached") == 1, "attached")
        assert value(cache_reg, "edgespec:drafter_attaches_total", device="edge-m") == 1
        store.create("s1", [1, 2, 3], SamplingParams(), "edge-m")
        eventually(lambda: draft_len(store, "s1") == 4, "a full window of drafts")
        eventually(lambda: value(drafter_reg, "edgespec:drafter_link_rtt_seconds_count") >= 1,
                   "the first chunk acknowledged (one in ACK_EVERY asks for its ack)")
        assert value(drafter_reg, "edgespec:drafter_draft_tokens_total") >= 4
        assert value(cache_reg, "edgespec:cache_chunks_total", result="ok", code="OK") >= 2
        assert value(cache_reg, "edgespec:cache_draft_tokens_total") >= 4
        # a fix reaches the drafter
        store.commit_many([Verdict(session_id="s1", epoch=0, start=3, n_accepted=0, token=9)])
        eventually(lambda: value(drafter_reg, "edgespec:drafter_fixes_received_total") == 1,
                   "the fix counted")
        # a chunk the cache refuses is counted on both sides, by its code
        with agent.cond:
            agent._send(agent._out, pb.DraftChunk(session_id="nope", start=1, tokens=[5]))
        eventually(lambda: value(drafter_reg, "edgespec:drafter_chunks_refused_total",
                                 code="NOT_FOUND") == 1, "the refusal counted by the drafter")
        assert value(cache_reg, "edgespec:cache_chunks_total", result="refused",
                     code="NOT_FOUND") == 1
        with pytest.raises(grpc.RpcError):  # PushDraft refusals count too
            cache.push(pb.DraftChunk(session_id="nope", start=1, tokens=[5]), device="edge-m")
        assert value(cache_reg, "edgespec:cache_chunks_total", result="refused",
                     code="NOT_FOUND") == 2
    finally:
        agent.stop()
        t.join(30)
    try:
        sent = value(drafter_reg, "edgespec:drafter_chunks_sent_total")
        assert sent == agent.chunks_sent + 1  # the hand-made chunk besides the drafted ones
        # one chunk in ACK_EVERY asked for its ack when stored (the first among them)
        assert value(drafter_reg, "edgespec:drafter_link_rtt_seconds_count") <= \
            -(-sent // ACK_EVERY)
        eventually(lambda: value(cache_reg, "edgespec:drafters_attached") == 0, "detached")
        ok = value(cache_reg, "edgespec:cache_chunks_total", result="ok", code="OK")
        assert ok <= sent - 1  # chunks still queued when the link closed may never arrive
    finally:
        cache.stop()


def test_drafter_command_serves_metrics(store, tmp_path):
    from procs import Proc

    cache = Cache(store)
    cache.service.metrics = CacheMetrics(CollectorRegistry())
    proc = Proc(["drafter", "--cache", cache.address, "--device-id", "edge-cli",
                 "--metrics-port", 0, "--log-level", "INFO"], tmp_path / "drafter.log")
    try:
        proc.wait_for("attached to", timeout=120)
        url = re.search(r"drafter metrics on (http://\S+/metrics)", proc.text()).group(1)
        store.create("s1", [1, 2, 3, 1, 2, 3], SamplingParams(), "edge-cli")

        def scraped():
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            samples = {s.name: s.value for fam in text_string_to_metric_families(text)
                       for s in fam.samples}
            return samples if samples.get("edgespec:drafter_chunks_sent_total", 0) >= 1 \
                else None

        samples = eventually(scraped, "a chunk counted on the drafter's /metrics")
        assert "edgespec:drafter_link_rtt_seconds_bucket" in samples
    finally:
        assert proc.stop() == 0
        cache.stop()


def test_drafter_metrics_port_is_checked_before_anything_starts(capsys):
    from edgespec_cli.main import main

    assert main(["drafter", "--device-id", "x", "--metrics-port", "70000"]) == 2
    assert "--metrics-port" in capsys.readouterr().err


def test_a_rested_board_hears_one_fix_for_what_it_missed_and_drafts_from_the_end(store):
    """A board told that the steps ask nothing of its session (``wanted`` 0) is sent no event for
    the commits that follow while they ask nothing; the commit that asks again reaches it as one
    fix carrying every token since, and the real agent drafts on from the session's end: its
    chunk is stored (the cache takes only a chunk at the current epoch and end) and its draft
    session holds the committed tokens."""
    cache = Cache(store)
    reg = CollectorRegistry()
    dm = DrafterMetrics(reg)
    agent = DrafterAgent(cache.address, "edge-r", SlotDrafter(), window=4, chunk=2, metrics=dm)
    t = start_agent(agent)

    def commit(token: int, wanted: int) -> None:  # the step rejects the draft: a fix each time
        snap = store.snapshot("s1")
        [out] = store.commit_many([Verdict("s1", snap.epoch, len(snap.tokens), 0, token,
                                           wanted=wanted)])
        assert out.error is None and out.fix is not None

    try:
        store.create("s1", [1, 2, 3], SamplingParams(), "edge-r")
        eventually(lambda: draft_len(store, "s1") == 4, "a full window of drafts")
        commit(9, wanted=0)  # the board is told to rest
        eventually(lambda: value(reg, "edgespec:drafter_fixes_received_total") == 1,
                   "the resting fix heard")
        commit(10, wanted=0)
        commit(11, wanted=0)
        commit(12, wanted=2)  # asked again: 10, 11 and 12 in one fix
        eventually(lambda: draft_len(store, "s1") > 0, "a draft at the session's end")
        snap = store.snapshot("s1")
        assert snap.tokens == [1, 2, 3, 9, 10, 11, 12]
        with agent.cond:
            target = agent.book.targets["s1"]
            assert (target.epoch, target.committed_end) == (snap.epoch, 7)
            assert target.draft is not None and target.draft.tokens[:7] == snap.tokens
        assert value(reg, "edgespec:drafter_fixes_received_total") == 2
    finally:
        agent.stop()
        t.join(30)
        cache.stop()


def test_a_boards_refusal_series_exist_before_any_refusal():
    """The refusals' series (what the dashboard reads) are there at 0 before any chunk is
    refused, one for each code the cache refuses with."""
    from drafter_node.metrics import REFUSAL_CODES

    reg = CollectorRegistry()
    DrafterMetrics(reg)
    for code in REFUSAL_CODES:
        assert reg.get_sample_value("edgespec:drafter_chunks_refused_total", {"code": code}) == 0
