"""Links that fail quietly, broken without killing a process: a TCP relay (``FaultyLink``)
between a drafter and the server, or an SDK client and the server, that blackholes, abandons,
resets, refuses or slows the link. gRPC keepalive (``edgespec.wire.keepalive``, set here to a
1 s ping with 1 s to answer) must notice each, the drafter must attach again, the SDK must
resume its call on a new connection, and every output must equal target-only decoding.

Without keepalive an abandoned connection is never noticed (the board waited on one for good):
the abandon tests fail then. No timing assertions: waits have generous bounds (``WAIT_S``)."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import hf_greedy

import edgespec
from drafter_node.agent import DrafterAgent
from edgespec.config import EngineConfig
from edgespec.drafters import build_drafter
from edgespec_cli.deployment.link_faults import FaultyLink
from edgespec_cli.server import EdgespecServer, ServerOptions

pytestmark = pytest.mark.slow  # servers and threads: not the fast tier

WAIT_S = 60  # how long a test waits for what must happen (never a timing assertion)
PROMPT = [1, 5, 6, 7, 5, 6, 7, 5]
N = 40


def eventually(cond, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture()
def fast_keepalive(monkeypatch):
    monkeypatch.setenv("EDGESPEC_KEEPALIVE_S", "1")
    monkeypatch.setenv("EDGESPEC_KEEPALIVE_TIMEOUT_S", "1")


@pytest.fixture()
def server(tiny_dir, fast_keepalive):
    srv = EdgespecServer(ServerOptions(
        listen="127.0.0.1:0", model=str(tiny_dir), max_drafters=4, drain_timeout_s=5,
        engine=EngineConfig(max_sessions=4, max_context=256))).start()
    yield srv
    srv.stop(drain_timeout_s=0)


@pytest.fixture(scope="module")
def reference(tiny):
    return hf_greedy(tiny.model, PROMPT, N)


class Board:
    """A MaG drafter agent in this process whose link to the server goes through a relay."""

    def __init__(self, server: EdgespecServer, device_id: str):
        self.link = FaultyLink(f"127.0.0.1:{server.port}").start()
        self.agent = DrafterAgent(self.link.address, device_id, build_drafter("mag"),
                                  backoff_max_s=1.0)
        self.thread = threading.Thread(target=self.agent.run, daemon=True)
        self.thread.start()
        self.server, self.device_id = server, device_id

    def attached(self) -> bool:
        return (self.agent.connected.is_set()
                and self.server.store.devices.is_alive(self.device_id))

    def close(self) -> None:
        self.agent.stop()
        self.thread.join(WAIT_S)
        self.link.stop()
        assert not self.thread.is_alive()


def generate(address: str, **kw) -> edgespec.GenerateResult:
    with edgespec.Client(address, timeout=WAIT_S) as client:
        return client.generate(prompt_ids=PROMPT, max_new_tokens=N, temperature=0, **kw)


@pytest.mark.parametrize("fault", ["abandon", "blackhole", "reset", "refuse"])
def test_a_board_attaches_again_after_its_link_fails_quietly(server, reference, fault):
    board = Board(server, "board-1")
    try:
        eventually(board.attached, "the first attach")
        attaches = board.agent.attaches
        board.link.apply(fault)
        if fault in ("blackhole", "refuse"):
            # the server's keepalive gives up on the silent board; the board's on the server
            eventually(lambda: not server.store.devices.is_alive("board-1"),
                       "the cache marking the silent board detached")
            board.link.heal()
        eventually(lambda: board.agent.attaches > attaches and board.attached(),
                   f"the board attaching again after {fault}")
        out = generate(f"127.0.0.1:{server.port}", device_id="board-1")
        assert out.token_ids == reference
        assert out.stats.get("num_drafts", 0) > 0  # drafted for again, not only decoded alone
    finally:
        board.close()


def test_a_slow_board_link_costs_no_output(server, reference):
    board = Board(server, "board-slow")
    try:
        eventually(board.attached, "the first attach")
        board.link.slow(0.05)
        out = generate(f"127.0.0.1:{server.port}", device_id="board-slow")
        assert out.token_ids == reference
        board.link.heal()
    finally:
        board.close()


@pytest.mark.parametrize("fault", ["abandon", "blackhole"])
def test_an_sdk_stream_survives_its_connection_going_silent(server, reference, fault):
    """A client's connection abandoned (or blackholed) mid-stream: keepalive notices, the SDK
    resumes the session on a new connection (the relay passes new ones after an abandon; after
    a blackhole it is healed once the old connection was given up), token for token."""
    with FaultyLink(f"127.0.0.1:{server.port}") as link:
        got: list[int] = []
        with edgespec.Client(link.address, timeout=WAIT_S) as client:
            stream = client.stream(prompt_ids=PROMPT, max_new_tokens=N, temperature=0)
            for piece in stream:
                got.extend(piece.token_ids)
                if got and link.connections == 1 and len(got) < N:
                    link.apply(fault)
                    if fault == "blackhole":
                        threading.Timer(4.0, link.heal).start()
        assert got == reference
        assert link.connections >= 2  # resumed on a new connection


def test_a_unary_generate_survives_an_abandoned_connection(server, reference):
    with FaultyLink(f"127.0.0.1:{server.port}") as link:
        with edgespec.Client(link.address, timeout=WAIT_S) as client:
            assert client.generate(prompt_ids=PROMPT, max_new_tokens=4).token_ids
            link.abandon()  # the idle connection is forgotten before the next call
            out = client.generate(prompt_ids=PROMPT, max_new_tokens=N, temperature=0)
        assert out.token_ids == reference and link.connections >= 2
