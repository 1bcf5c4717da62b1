"""The SDK's ``channel_options`` reach its gRPC channel, blocking and asyncio: a user agent set
there is what a server sees, and an option edgespec sets itself (the largest message received)
is replaced by the caller's. An in-process gRPC server stands in for the verifier."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

import edgespec
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire.channels import CHANNEL_OPTIONS, make_channel

BIG_MODEL_NAME = "m" * 5000  # a Status answer of more than 4 KB


class _Verifier(pb_grpc.VerifierServicer):
    """Answers Status (with a long model name) and Cancel, noting each call's user agent."""

    def __init__(self):
        self.user_agents: list[str] = []

    def _note(self, context) -> None:
        self.user_agents.append(dict(context.invocation_metadata()).get("user-agent", ""))

    def Status(self, request, context):
        self._note(context)
        return pb.StatusResponse(model=BIG_MODEL_NAME)

    def Cancel(self, request, context):
        self._note(context)
        return pb.CancelResponse(cancelled=True)


@pytest.fixture()
def verifier():
    servicer = _Verifier()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def test_the_client_sends_the_user_agent_given_in_channel_options(verifier):
    servicer, address = verifier
    with edgespec.Client(address, timeout=30,
                         channel_options=[("grpc.primary_user_agent", "my-app/1.2")]) as c:
        assert c.status()["model"] == BIG_MODEL_NAME
        assert c.cancel("s1")
    assert len(servicer.user_agents) == 2
    assert all(ua.startswith("my-app/1.2 ") for ua in servicer.user_agents), \
        servicer.user_agents


def test_the_async_client_sends_the_user_agent_given_in_channel_options(verifier):
    servicer, address = verifier

    async def cancel() -> bool:
        async with edgespec.AsyncClient(
                address, timeout=30,
                channel_options=[("grpc.primary_user_agent", "my-async-app/3")]) as c:
            return await c.cancel("s1")

    assert asyncio.run(cancel())
    assert servicer.user_agents[0].startswith("my-async-app/3 "), servicer.user_agents


def test_a_channel_option_replaces_edgespecs_own(verifier):
    """edgespec receives messages up to 4 MiB; a caller's smaller limit wins, so the 5 KB
    Status answer is refused on the client's side."""
    _, address = verifier
    with edgespec.Client(address, timeout=30, channel_options=[
            ("grpc.max_receive_message_length", 1024)]) as c:
        with pytest.raises(edgespec.Overloaded):
            c.status()
    with edgespec.Client(address, timeout=30) as c:  # edgespec's own limit: the answer fits
        assert c.status()["model"] == BIG_MODEL_NAME


def test_make_channel_keeps_its_defaults_without_options(verifier):
    """Callers of make_channel that pass no options get edgespec's channel, as before."""
    _, address = verifier
    names = [name for name, _ in CHANNEL_OPTIONS]
    assert "grpc.max_reconnect_backoff_ms" in names and len(names) == len(set(names))
    with make_channel(address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        assert stub.Status(pb.StatusRequest(), timeout=30).model == BIG_MODEL_NAME


def test_status_as_a_dict_gives_counters_as_ints_at_every_depth():
    """protobuf's JSON mapping writes 64-bit integers as strings; the SDK's dicts hold them as
    ints: a repeated message's, a nested message's, a repeated int64 and a map's values."""
    from edgespec.wire.convert import message_as_dict

    status = message_as_dict(pb.StatusResponse(
        model="m", drafters=[pb.DrafterStatus(device_id="b1", drafts_missed=12, session_steps=44),
                             pb.DrafterStatus(device_id="b2")],
        cost=pb.ServerCost(cpu_s=1.5, committed_tokens=2 ** 40, forwards=3),
        runner=pb.RunnerStatus(graph_buckets=4, graph_replays=7)))
    assert status["drafters"][0]["drafts_missed"] == 12
    assert status["drafters"][0]["session_steps"] == 44
    assert status["drafters"][1]["drafts_missed"] == 0  # a default is a field too
    assert status["cost"] == {**status["cost"], "committed_tokens": 2 ** 40, "forwards": 3,
                              "cpu_s": 1.5}
    assert (status["runner"]["graph_buckets"], status["runner"]["graph_replays"]) == (4, 7)
    stats = message_as_dict(pb.Stats(steps=5, accepted_per_pos=[3, 2], stacks={"mag": 9}))
    assert (stats["steps"], stats["accepted_per_pos"], stats["stacks"]) == (5, [3, 2], {"mag": 9})
    ints = [v for d in status["drafters"] for k, v in d.items() if k in (
        "drafts_missed", "steps_unwaited", "session_steps", "ready_drafts", "verified_drafts",
        "finished_drafts", "finished_draft_tokens", "finished_accepted_tokens")]
    assert ints and all(type(v) is int for v in ints)
