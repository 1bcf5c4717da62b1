"""The replica router over real gRPC, in front of stand-in replicas (a real gRPC server whose
Generate refuses, or holds its stream open, as told): a replica's refusal reaches the client
whole, its retry hint included, and the router's own Generate streams are capped below its
thread pool, so that its health checks always find a thread; its Status merges what each
replica saw of the fleet's drafters."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import edgespec
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire.convert import retry_after_metadata
from edgespec.wire.channels import bind, free_port
from procs import wait_health
from verifier_node.router import VERIFIER_SERVICE, VerifierRouter

pytestmark = pytest.mark.slow  # servers: not the fast tier

WAIT_S = 30


class StandInReplica(pb_grpc.VerifierServicer):
    """A replica whose Generate refuses with RESOURCE_EXHAUSTED and a retry hint (``refuse``),
    or yields one response and holds the stream open until ``release`` is set."""

    def __init__(self, refuse: bool, drafters: tuple[pb.DrafterStatus, ...] = ()):
        self.refuse, self.release = refuse, threading.Event()
        self.drafters = drafters  # what its Status reports
        self.healthy, self.reason = False, ""  # and its health, with why not
        self.server = grpc.server(futures.ThreadPoolExecutor(16))
        pb_grpc.add_VerifierServicer_to_server(self, self.server)
        self.health = health.HealthServicer()
        self.health.set(VERIFIER_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.address = f"127.0.0.1:{bind(self.server, '127.0.0.1:0')}"
        self.server.start()

    def Generate(self, request, context):
        if self.refuse:
            context.set_trailing_metadata(retry_after_metadata(1500))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "verifier overloaded: full")
        yield pb.GenerateResponse(session_id="held")
        self.release.wait(WAIT_S)

    def Status(self, request, context):
        return pb.StatusResponse(model="stand-in", kv_slots=4, drafters=self.drafters,
                                 healthy=self.healthy, unhealthy_reason=self.reason)

    def stop(self):
        self.release.set()
        self.server.stop(0)


@pytest.fixture()
def routed(request):
    replica = StandInReplica(refuse=request.param)
    router = VerifierRouter("127.0.0.1:0", [replica.address], max_streams=1).start()
    yield router, replica
    replica.stop()
    router.stop()


@pytest.mark.parametrize("routed", [True], indirect=True)
def test_a_replicas_refusal_reaches_the_client_with_its_retry_hint(routed):
    router, _ = routed
    with edgespec.Client(f"127.0.0.1:{router.port}", timeout=WAIT_S) as c:
        with pytest.raises(edgespec.Overloaded) as e:
            c.generate(prompt_ids=[1, 2, 3], max_new_tokens=4)
    assert e.value.retry_after_s == 1.5 and "full" in str(e.value)


@pytest.mark.parametrize("routed", [False], indirect=True)
def test_the_routers_generate_streams_are_capped_and_its_health_answers(routed):
    router, replica = routed
    with grpc.insecure_channel(f"127.0.0.1:{router.port}") as ch:
        stub = pb_grpc.VerifierStub(ch)
        held = stub.Generate(pb.GenerateRequest(prompt_ids=[1]), timeout=WAIT_S)
        assert next(held).session_id == "held"  # the one stream the cap allows
        with pytest.raises(grpc.RpcError) as e:
            next(stub.Generate(pb.GenerateRequest(prompt_ids=[1]), timeout=WAIT_S))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        wait_health(f"127.0.0.1:{router.port}", health_pb2.HealthCheckResponse.SERVING,
                    timeout=WAIT_S, service=VERIFIER_SERVICE)
        replica.release.set()
        assert list(held) == []


def test_the_routers_status_merges_what_each_replica_saw_of_a_drafter():
    # acceptance over the finished sessions of both replicas together: a replica whose sessions
    # with the board are all still running (rate 0, nothing finished) does not drag it down
    a_first = pb.DrafterStatus(device_id="board-a", attached=True, sessions=2, late=False,
                               drafts_missed=2, steps_unwaited=0, session_steps=10,
                               ready_drafts=5, verified_drafts=4, acceptance_rate=0.5,
                               mean_acceptance_length=3.0, finished_drafts=10,
                               finished_draft_tokens=40, finished_accepted_tokens=20)
    b_only = pb.DrafterStatus(device_id="board-b", attached=False, session_steps=3)
    a_second = pb.DrafterStatus(device_id="board-a", attached=True, sessions=2, late=True,
                                drafts_missed=3, steps_unwaited=7, session_steps=6,
                                ready_drafts=9, verified_drafts=12, acceptance_rate=0.9,
                                mean_acceptance_length=2.8, finished_drafts=5,
                                finished_draft_tokens=10, finished_accepted_tokens=9)
    a_running = pb.DrafterStatus(device_id="board-a", attached=True, sessions=2,
                                 session_steps=500, verified_drafts=400)
    replicas = [StandInReplica(False, (a_first, b_only)), StandInReplica(False, (a_second,)),
                StandInReplica(False, (a_running,))]
    router = VerifierRouter("127.0.0.1:0", [r.address for r in replicas]).start()
    try:
        with edgespec.Client(f"127.0.0.1:{router.port}", timeout=WAIT_S) as c:
            status = c.status()
    finally:
        for r in replicas:
            r.stop()
        router.stop()
    assert status["kv_slots"] == 12
    by_id = {d["device_id"]: d for d in status["drafters"]}
    assert sorted(by_id) == ["board-a", "board-b"]  # each once
    a = by_id["board-a"]
    assert a["late"] is True and a["sessions"] == 2 and a["attached"] is True
    assert (int(a["drafts_missed"]), int(a["steps_unwaited"]), int(a["session_steps"]),
            int(a["ready_drafts"]), int(a["verified_drafts"])) == (5, 7, 516, 14, 416)
    assert a["acceptance_rate"] == pytest.approx(29 / 50)
    assert a["mean_acceptance_length"] == pytest.approx(1 + 29 / 15)
    assert int(by_id["board-b"]["session_steps"]) == 3


def test_the_routers_status_says_why_no_replica_serves():
    """Healthy while one replica serves; when none does, why not, each replica by address:
    its own reason, or that it does not answer."""
    replicas = [StandInReplica(False), StandInReplica(False)]
    replicas[0].reason = "its Redis does not answer (Connection refused)"
    nowhere = f"127.0.0.1:{free_port()}"
    router = VerifierRouter("127.0.0.1:0", [r.address for r in replicas] + [nowhere]).start()
    try:
        with edgespec.Client(f"127.0.0.1:{router.port}", timeout=WAIT_S) as c:
            none_serve = c.status()
            replicas[1].healthy = True
            one_serves = c.status()
    finally:
        for r in replicas:
            r.stop()
        router.stop()
    assert none_serve["healthy"] is False
    why = none_serve["unhealthy_reason"]
    assert why.startswith("no replica serves: ")
    assert f"{replicas[0].address}: its Redis does not answer (Connection refused)" in why
    assert f"{replicas[1].address}: no reason given" in why
    assert f"{nowhere}: does not answer (UNAVAILABLE)" in why
    assert one_serves["healthy"] is True and one_serves["unhealthy_reason"] == ""


def test_the_routers_status_describes_the_replicas_that_serve():
    """The model, dtype and runner come from a replica that serves (not the first to answer,
    which may not); replicas on different kernel sets are each named."""
    from verifier_node.router import describe_replicas

    def replica(healthy, dtype, fp, desc):
        return pb.StatusResponse(model="m", healthy=healthy, dtype=dtype, runner=pb.RunnerStatus(
            kernel_set=fp, kernel_set_description=desc))

    down = replica(False, "float32", "a" * 16, "eager float32")
    up = replica(True, "bfloat16", "b" * 16, "eager bfloat16")
    merged = pb.StatusResponse()
    describe_replicas(merged, [down, up])
    assert (merged.dtype, merged.runner.kernel_set) == ("bfloat16", "b" * 16)
    assert merged.runner.kernel_set_description == "eager bfloat16"
    other = replica(True, "float32", "c" * 16, "eager float32")
    describe_replicas(merged, [down, up, other])
    assert merged.runner.kernel_set == "b" * 16
    assert "2 kernel sets" in merged.runner.kernel_set_description
    assert "bbbbbbbb (bfloat16): eager bfloat16" in merged.runner.kernel_set_description
    assert "cccccccc (float32): eager float32" in merged.runner.kernel_set_description
    merged = pb.StatusResponse()
    describe_replicas(merged, [down])  # none serves: what the one that answered says
    assert merged.dtype == "float32" and merged.runner.kernel_set == "a" * 16
