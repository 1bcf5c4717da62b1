"""A drafter agent (``drafter_node.agent``) against a real DraftCache service and against broken
ones: it refuses a session its drafter cannot open or whose token ids are outside the target's
vocabulary and serves on; a cache that breaks the protocol costs the link, not the agent; what
it logs of lost links and an unreachable cache, and how often; two agents with one device id end
with one attached and the other stopped; a wrong address or port is said and refused."""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent import futures

import grpc
import pytest

from drafter_node.agent import DrafterAgent
from edgespec.config import ConfigError, SamplingParams
from edgespec.protocol.contract import Verdict
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire.channels import bind, free_port

# the in-process cache: its fixtures (used by name) and helpers
from cache_harness import (  # noqa: F401
    VOCAB, WAIT_S, Cache, SlotDrafter, cache, draft_len, drafter_idle, eventually, redis_handle,
    start_agent, store, what_ends_the_first_attach)


# -- 3. the agent refuses what its drafter cannot do, and lives on --------------------------------
def test_agent_refuses_a_session_its_drafter_cannot_open_and_keeps_serving(cache, store):
    drafter = SlotDrafter(slots=1)
    agent = DrafterAgent(cache.address, "edge-1", drafter, window=4, chunk=2, max_sessions=1)
    t = start_agent(agent)
    try:
        store.create("s1", [1, 2, 3], SamplingParams(), "edge-1")
        eventually(lambda: draft_len(store, "s1") > 0, "drafts for s1")
        store.create("s2", [1, 2, 3], SamplingParams(), "edge-1")  # pinned beyond capacity
        eventually(lambda: drafter_idle(store, "s2"), "an idle chunk for the refused s2")
        assert t.is_alive() and agent.refused == 1
        # the verifier decodes s2 alone: its fix resets the idle flag, the agent sets it again
        store.commit_many([Verdict(session_id="s2", epoch=0, start=3, n_accepted=0, token=9)])
        eventually(lambda: drafter_idle(store, "s2")
                   and store.redis.hget(store.keys.session("s2")[0], "epoch") == b"1",
                   "an idle chunk for s2 after its fix")
        store.close("s1")
        eventually(lambda: drafter.open_now == 0, "s1's slot freed")
        store.create("s3", [1, 2, 3], SamplingParams(), "edge-1")
        eventually(lambda: draft_len(store, "s3") > 0, "drafts for s3 after the refusal")
        store.close("s3")
        eventually(lambda: drafter.open_now == 0, "s3's slot freed")
        store.create("s4", [99, 2, 3], SamplingParams(), "edge-1")  # propose raises
        eventually(lambda: drafter_idle(store, "s4"),
                   "an idle chunk for s4 whose drafting failed")
        assert t.is_alive() and agent.refused == 2 and drafter.open_now == 0
        store.create("s5", [1, 2, 3], SamplingParams(), "edge-1")
        eventually(lambda: draft_len(store, "s5") > 0, "drafts for s5")
    finally:
        agent.stop()
        t.join(WAIT_S)


def test_agent_refuses_a_session_whose_ids_are_outside_the_vocabulary(cache, store):
    """Token ids from the cache outside the target's vocabulary (a broken or hostile cache; the
    verifier never sends them) reach no drafter's model: the session they come in, an
    assignment or a fix, is refused (an idle chunk), and the agent drafts for the others."""
    drafter = SlotDrafter()
    agent = DrafterAgent(cache.address, "edge-1", drafter, window=4, chunk=2)
    t = start_agent(agent)
    try:
        store.create("s1", [1, 2, VOCAB + 50], SamplingParams(), "edge-1")
        eventually(lambda: drafter_idle(store, "s1"),
                   "an idle chunk for s1, assigned ids outside the vocabulary")
        store.create("s2", [1, 2, 3], SamplingParams(), "edge-1")
        eventually(lambda: draft_len(store, "s2") > 0, "drafts for s2")
        store.commit_many([Verdict(session_id="s2", epoch=0, start=3, n_accepted=0,
                                   token=VOCAB + 7)])  # a fix with an id outside it
        eventually(lambda: drafter_idle(store, "s2")
                   and store.redis.hget(store.keys.session("s2")[0], "epoch") == b"1",
                   "an idle chunk for s2 after its fix, under the fix's epoch")
        store.create("s3", [1, 2, 3], SamplingParams(), "edge-1")
        eventually(lambda: draft_len(store, "s3") > 0, "drafts for s3")
        assert t.is_alive() and agent.refused == 2
    finally:
        agent.stop()
        t.join(WAIT_S)


def test_agent_drafts_for_no_more_sessions_than_it_registered_for(cache, store):
    """A cache that assigns more sessions than the board's ``max_sessions`` (a hostile one
    sent a board of 8 sessions thirty of 1.3M tokens each: 1.5 GB) gets the ones beyond
    refused (an idle chunk each: the verifier decodes them alone), whatever the drafter could
    open; a session that ends makes room again."""
    drafter = SlotDrafter(slots=8)  # it could open more: the board's limit refuses them
    agent = DrafterAgent(cache.address, "edge-1", drafter, window=4, chunk=2, max_sessions=2)
    t = start_agent(agent)
    try:
        for sid in ("s1", "s2"):
            store.create(sid, [1, 2, 3], SamplingParams(), "edge-1")
        eventually(lambda: draft_len(store, "s1") > 0 and draft_len(store, "s2") > 0,
                   "drafts for the two sessions it holds")
        store.create("s3", [1, 2, 3], SamplingParams(), "edge-1")
        eventually(lambda: drafter_idle(store, "s3"),
                   "an idle chunk for s3, beyond the board's two")
        assert agent.refused == 1 and drafter.open_now == 2 and draft_len(store, "s3") == 0
        store.close("s1")
        eventually(lambda: drafter.open_now == 1, "s1's session closed")
        store.create("s4", [1, 2, 3], SamplingParams(), "edge-1")
        eventually(lambda: draft_len(store, "s4") > 0, "drafts for s4 in s1's room")
        assert t.is_alive() and agent.refused == 1
    finally:
        agent.stop()
        t.join(WAIT_S)


class OutOfOrderCache(pb_grpc.DraftCacheServicer):
    """A cache that, on a drafter's first attach, sends an assignment before ``registered``;
    on the next ones behaves, and collects the chunks it gets."""

    def __init__(self):
        self.attaches, self.chunks = 0, queue.Queue()

    def Attach(self, request_iterator, context):
        self.attaches += 1
        assignment = pb.CacheMessage(assignment=pb.Assignment(session_id="s1", tokens=[1, 2, 3]))
        if self.attaches == 1:
            yield assignment
            return
        threading.Thread(target=self._collect, args=(request_iterator,), daemon=True).start()
        yield pb.CacheMessage(registered=pb.Registered(target_model="tiny", window=4, chunk=2,
                                                        vocab_size=VOCAB))
        yield assignment
        while context.is_active():
            time.sleep(0.05)

    def _collect(self, request_iterator):
        try:
            for message in request_iterator:
                if message.HasField("chunk"):
                    self.chunks.put(message.chunk)
        except grpc.RpcError:
            pass  # the link ended (the agent stopped): the stream's reader ends with it


def test_a_cache_that_assigns_before_registering_costs_the_link_not_the_agent():
    """Before ``registered`` the agent knows neither the window nor the vocabulary: a session
    assigned then ends the link (the drafting thread never plans with them unknown), and the
    agent attaches again and drafts."""
    servicer = OutOfOrderCache()
    server = grpc.server(futures.ThreadPoolExecutor(8))
    pb_grpc.add_DraftCacheServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1:0")
    server.start()
    agent = DrafterAgent(f"127.0.0.1:{port}", "edge-1", SlotDrafter())
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        chunk = servicer.chunks.get(timeout=WAIT_S)
        assert chunk.session_id == "s1" and list(chunk.tokens) and set(chunk.tokens) == {7}
        assert servicer.attaches == 2 and t.is_alive()
    finally:
        agent.stop()
        t.join(WAIT_S)
        server.stop(0)


# -- link logs ------------------------------------------------------------------------------------
def agent_messages(caplog, level=None) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "edgespec.drafter" and (level is None or r.levelno == level)]


def test_an_agent_that_never_connected_says_it_cannot_reach_the_cache_once(caplog):
    caplog.set_level(logging.DEBUG, logger="edgespec.drafter")
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    agent = DrafterAgent(address, "edge-nowhere", SlotDrafter(), backoff_max_s=0.2)
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        eventually(lambda: len(agent_messages(caplog, logging.DEBUG)) >= 2, "retries")
    finally:
        agent.stop()
        t.join(WAIT_S)
    warnings = agent_messages(caplog, logging.WARNING)
    assert len(warnings) == 1 and f"cannot reach the cache at {address} yet" in warnings[0]
    assert not any("lost" in m for m in agent_messages(caplog))


def test_an_agent_says_lost_only_for_a_link_it_had(store, caplog):
    caplog.set_level(logging.DEBUG, logger="edgespec.drafter")
    c = Cache(store)
    agent = DrafterAgent(c.address, "edge-lost", SlotDrafter(), backoff_max_s=0.2)
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        assert agent.connected.wait(WAIT_S)
        c.stop()  # the cache goes away: the link existed, and cannot be made again
        eventually(lambda: len(agent_messages(caplog, logging.DEBUG)) >= 2, "retries")
    finally:
        agent.stop()
        c.stop()
        t.join(WAIT_S)
    warnings = agent_messages(caplog, logging.WARNING)
    assert len(warnings) == 2, warnings
    assert f"link to {c.address} lost" in warnings[0]
    assert f"cannot reach the cache at {c.address} since the link was lost" in warnings[1]


def test_an_agent_logs_every_lost_link_across_restarts(store, caplog):
    """Two restarts of the cache on one address: each lost link is logged, and each re-attach
    (the "already said" state of an outage ends with the link it was about)."""
    caplog.set_level(logging.DEBUG, logger="edgespec.drafter")
    address = f"127.0.0.1:{free_port()}"
    c = Cache(store, listen=address)
    agent = DrafterAgent(address, "edge-restarts", SlotDrafter(), backoff_max_s=0.2)
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        for restart in (1, 2):
            eventually(lambda: agent.attaches == restart, f"attach {restart}")
            c.stop()
            eventually(lambda: sum("lost" in m for m in agent_messages(caplog, logging.WARNING))
                       == restart, f"lost link {restart} logged")
            c = Cache(store, listen=address)
        eventually(lambda: agent.attaches == 3, "attach 3")
    finally:
        agent.stop()
        c.stop()
        t.join(WAIT_S)
    infos = [m for m in agent_messages(caplog, logging.INFO) if m.startswith("attached to")]
    assert len(infos) == 3
    lost = [m for m in agent_messages(caplog, logging.WARNING) if "lost" in m]
    assert len(lost) == 2 and all(f"link to {address} lost" in m for m in lost)


def test_two_drafters_with_one_device_id_end_with_one_attached_and_one_stopped(cache, store,
                                                                             caplog):
    """Two boards given one --device-id knocked each other off for good, each re-attach
    replacing the other with nothing said: the cache warns of an attach while the id's stream
    is open and ends the older stream ABORTED, saying so; a drafter told so attaches again once
    (a stale attempt of its own could have looked newer) and stops the second time (a
    ConfigError). Whichever stops, one stops, and the other keeps the id, attached."""
    caplog.set_level(logging.INFO)
    errors: dict[int, BaseException] = {}

    def run(i, agent):
        try:
            agent.run()
        except BaseException as e:  # noqa: BLE001 (the test reads what ended the agent)
            errors[i] = e

    agents = [DrafterAgent(cache.address, "twin", SlotDrafter(), backoff_max_s=0.2)
              for _ in range(2)]
    threads = [threading.Thread(target=run, args=(i, a), daemon=True)
               for i, a in enumerate(agents)]
    threads[0].start()
    assert agents[0].connected.wait(WAIT_S)
    threads[1].start()
    try:
        eventually(lambda: errors, "one of the two drafters stopped")
        [(stopped, error)] = errors.items()
        assert isinstance(error, ConfigError) and "ended this drafter's link twice" in str(error)
        assert "replaced by a newer attach" in str(error) and "--device-id" in str(error)
        threads[stopped].join(WAIT_S)
        kept = agents[1 - stopped]
        assert not threads[stopped].is_alive() and threads[1 - stopped].is_alive()
        eventually(lambda: kept.connected.is_set() and store.devices.is_alive("twin"),
                   "the other drafter attached")
        warned = [r.getMessage() for r in caplog.records
                  if r.name.startswith("edgespec.cache") and "attached again" in r.getMessage()]
        assert warned and "two boards share the id" in warned[0]
    finally:
        for agent, thread in zip(agents, threads):
            agent.stop()
            thread.join(WAIT_S)
    assert len(errors) == 1  # the other ended by stop(), not refused


def test_an_agent_pointed_at_an_http_port_stops_saying_so():
    """A board given the server's HTTP port retried for ever, logging gRPC's "Trying to
    connect an http1.x server": a ConfigError naming the likely mix-up, at its first attach."""
    import http.server

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                            http.server.BaseHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{httpd.server_address[1]}"
    try:
        error = what_ends_the_first_attach(
            DrafterAgent(address, "edge-http", SlotDrafter(), backoff_max_s=0.2))
        assert isinstance(error, ConfigError)
        assert "answers, but not as a gRPC server: the server's --http-port" in str(error)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_agent_with_tls_pointed_at_a_plaintext_cache_stops_saying_so(cache):
    """Every TLS handshake with a plaintext gRPC cache fails, for ever: the board retried,
    logging gRPC's handshake errors; now its first attach ends in a ConfigError naming the
    mismatch (as ``edgespec status`` does)."""
    error = what_ends_the_first_attach(
        DrafterAgent(cache.address, "edge-tls", SlotDrafter(), tls=True, backoff_max_s=0.2))
    assert isinstance(error, ConfigError)
    assert "serves plaintext gRPC" in str(error) and "TLS mismatch" in str(error)


def test_an_unreachable_cache_is_said_again_while_it_lasts(caplog, monkeypatch):
    import drafter_node.agent as agent_mod

    monkeypatch.setattr(agent_mod, "STILL_UNREACHABLE_LOG_S", 0.3)
    caplog.set_level(logging.DEBUG, logger="edgespec.drafter")
    address = f"127.0.0.1:{free_port()}"
    agent = DrafterAgent(address, "edge-still", SlotDrafter(), backoff_max_s=0.2)
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        eventually(lambda: sum("still cannot reach" in m for m in
                               agent_messages(caplog, logging.WARNING)) >= 2, "reminders")
    finally:
        agent.stop()
        t.join(WAIT_S)
    warnings = agent_messages(caplog, logging.WARNING)
    assert f"cannot reach the cache at {address} yet" in warnings[0]
    assert all(f"still cannot reach the cache at {address} after" in m for m in warnings[1:])


@pytest.mark.parametrize("address,why", [("127.0.0.1", "the port included"),
                                         ("http://127.0.0.1:5", "without a scheme"),
                                         ("grpc://h:1", "without a scheme")])
def test_an_agent_refuses_an_address_gRPC_would_misread(address, why):
    with pytest.raises(ConfigError, match=why):
        DrafterAgent(address, "edge-bad", SlotDrafter())
    DrafterAgent("dns:///localhost:5", "edge-ok", SlotDrafter())  # these forms stay accepted
    DrafterAgent("[::1]:5", "edge-ok", SlotDrafter())


def test_an_agent_drafts_no_token_past_where_the_sessions_output_ends(cache, store):
    """The cache tells the board where a session's output ends (prompt + max_new_tokens): with 3
    output tokens left a step verifies at most 2 drafts, so the agent drafts 2 where its window
    allows 4, plans nothing more, and drafts its whole window for a session with room."""
    from edgespec.drafters.drafting_loop import _plan_round, lead_room

    drafter = SlotDrafter()
    agent = DrafterAgent(cache.address, "edge-1", drafter, window=4, chunk=2)
    t = start_agent(agent)
    try:
        store.create("short", [1, 2, 3], SamplingParams(), "edge-1", max_new_tokens=3)
        store.create("long", [1, 2, 3], SamplingParams(), "edge-1", max_new_tokens=50)
        eventually(lambda: draft_len(store, "short") == 2 and draft_len(store, "long") == 4,
                   "both drafted as far as they may be")
        with agent.cond:
            target = agent.book.targets["short"]
            assert target.output_end == 6 and lead_room(target, 4) == 2
            assert [j.sid for j in _plan_round(agent, agent.book)] == []
        assert draft_len(store, "short") == 2
    finally:
        agent.stop()
        t.join(WAIT_S)


class CheapSlotDrafter(SlotDrafter):
    """``SlotDrafter`` that says it drafts in microseconds (as MaG and Cacheback do)."""

    cheap = True


@pytest.mark.parametrize("cheap", [False, True])
def test_a_cheap_drafter_sends_a_sessions_room_in_one_chunk(cache, store, cheap):
    """A model drafter's first chunk after the committed end is one token (the next step gets
    it a token's drafting sooner), the rest of its room (the cache's window, 8) in the cache's
    chunks of 4; a drafter that drafts in microseconds sends the whole room in one chunk: each
    chunk is a message the cache's host handles."""
    drafter = CheapSlotDrafter() if cheap else SlotDrafter()
    agent = DrafterAgent(cache.address, "edge-1", drafter, pace=False)
    t = start_agent(agent)
    try:
        store.create("s", [1, 2, 3], SamplingParams(), "edge-1", max_new_tokens=50)
        eventually(lambda: draft_len(store, "s") == 8, "the session's room drafted")
        with agent.cond:
            assert (agent.window, agent.chunk) == (8, 8 if cheap else 4)
            assert agent.chunks_sent == (1 if cheap else 3)  # 8, or 1 + 4 + 3
    finally:
        agent.stop()
        t.join(WAIT_S)
