"""Requests whose bytes do not parse (a truncated protobuf, invalid UTF-8 in a string field)
get INVALID_ARGUMENT from every method of every service the composed server runs, streams
included, and the server serves well-formed calls as before (real gRPC on loopback, the tiny
model, the embedded Redis)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from edgespec.config import EngineConfig
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.wire.convert import auth_metadata
from edgespec_cli.server import EdgespecServer, ServerOptions
from procs import wait_healthy

TOKEN = "tok"
META = auth_metadata(TOKEN)
TRUNCATED = b"\x0a\x05ab"  # field 1, 5 bytes long, of which 2 came
PLACEHOLDER = "XXXX"
BAD_UTF8 = b"\xff\xfe\xfd\xfc"

# method -> (streaming kind, a request with PLACEHOLDER in a string field, or None: none has one)
METHODS = {
    "/edgespec.v1.Verifier/Generate": ("unary_stream", pb.GenerateRequest(prompt=PLACEHOLDER)),
    "/edgespec.v1.Verifier/Cancel": ("unary_unary", pb.CancelRequest(session_id=PLACEHOLDER)),
    "/edgespec.v1.Verifier/Status": ("unary_unary", None),
    "/edgespec.v1.DraftCache/Attach": ("stream_stream", pb.DrafterMessage(
        register=pb.Register(device_id=PLACEHOLDER))),
    "/edgespec.v1.DraftCache/PushDraft": ("unary_unary",
                                          pb.DraftChunk(session_id=PLACEHOLDER)),
    "/edgespec.v1.DraftCache/FleetTable": ("unary_unary", None),
    "/grpc.health.v1.Health/Check": ("unary_unary",
                                     health_pb2.HealthCheckRequest(service=PLACEHOLDER)),
    "/grpc.health.v1.Health/Watch": ("unary_stream",
                                     health_pb2.HealthCheckRequest(service=PLACEHOLDER)),
}


def bad_utf8(request) -> bytes:
    raw = request.SerializeToString()
    assert raw.count(PLACEHOLDER.encode()) == 1
    return raw.replace(PLACEHOLDER.encode(), BAD_UTF8)


def cases():
    for method, (kind, request) in METHODS.items():
        yield pytest.param(method, kind, TRUNCATED, id=f"{method}-truncated")
        if request is not None:
            yield pytest.param(method, kind, bad_utf8(request), id=f"{method}-bad-utf8")


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = EdgespecServer(ServerOptions(
        listen="127.0.0.1:0", model=str(tiny_dir), auth_token=TOKEN, drain_timeout_s=0,
        engine=EngineConfig(max_sessions=2, max_context=256))).start()
    wait_healthy(f"127.0.0.1:{srv.port}")
    yield srv
    srv.stop(drain_timeout_s=0)


@pytest.fixture()
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


def call_raw(channel, method: str, kind: str, messages: list[bytes]) -> list[bytes]:
    """Send ``messages`` as they are (no serializer) and read every raw response."""
    stub = getattr(channel, kind)(method)  # identity (de)serializers
    if kind == "stream_stream":
        return list(stub(iter(messages), metadata=META, timeout=30))
    if kind == "unary_stream":
        return list(stub(messages[0], metadata=META, timeout=30))
    return [stub(messages[0], metadata=META, timeout=30)]


def assert_invalid_argument(err: grpc.RpcError, method: str) -> None:
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert "malformed request" in err.details() and method in err.details()


def assert_still_serving(channel) -> None:
    status = channel.unary_unary("/edgespec.v1.Verifier/Status",
                                 response_deserializer=pb.StatusResponse.FromString)
    assert status(pb.StatusRequest().SerializeToString(), metadata=META, timeout=30).healthy
    check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                response_deserializer=health_pb2.HealthCheckResponse.FromString)
    assert check(health_pb2.HealthCheckRequest().SerializeToString(),
                 timeout=30).status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("method,kind,payload", list(cases()))
def test_a_request_that_does_not_parse_is_invalid_argument(channel, method, kind, payload):
    with pytest.raises(grpc.RpcError) as info:
        call_raw(channel, method, kind, [payload])
    assert_invalid_argument(info.value, method)
    assert_still_serving(channel)


def register(device: str) -> bytes:
    return pb.DrafterMessage(register=pb.Register(device_id=device, draft_model="test",
                                                  max_sessions=1)).SerializeToString()


@pytest.mark.parametrize("payload", [TRUNCATED, bad_utf8(pb.DrafterMessage(
    chunk=pb.DraftChunk(session_id=PLACEHOLDER)))], ids=["truncated", "bad-utf8"])
def test_a_bad_message_later_in_the_attach_stream_is_invalid_argument(channel, payload):
    """After a good Register: the cache reads chunks on a thread of its own."""
    with pytest.raises(grpc.RpcError) as info:
        call_raw(channel, "/edgespec.v1.DraftCache/Attach", "stream_stream",
                 [register("bad-later"), payload])
    assert_invalid_argument(info.value, "/edgespec.v1.DraftCache/Attach")
    assert_still_serving(channel)


def test_a_well_formed_attach_still_registers(channel):
    attach = channel.stream_stream("/edgespec.v1.DraftCache/Attach",
                                   response_deserializer=pb.CacheMessage.FromString)
    done = threading.Event()

    def messages():  # the stream stays open until the test has its answer
        yield register("good")
        done.wait(30)

    call = attach(messages(), metadata=META, timeout=30)
    try:
        assert next(call).HasField("registered")
    finally:
        done.set()
        call.cancel()
    wait_detached(channel, "good")  # before the server stops under the stream's cleanup


def wait_detached(channel, device: str) -> None:
    status = channel.unary_unary("/edgespec.v1.Verifier/Status",
                                 response_deserializer=pb.StatusResponse.FromString)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        st = status(pb.StatusRequest().SerializeToString(), metadata=META, timeout=30)
        if not any(d.device_id == device and d.attached for d in st.drafters):
            return
        time.sleep(0.05)
    raise AssertionError(f"drafter {device} never detached")


def test_the_router_refuses_malformed_requests_too():
    from edgespec.wire.channels import free_port
    from verifier_node.router import VerifierRouter

    router = VerifierRouter("127.0.0.1:0", [f"127.0.0.1:{free_port()}"]).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{router.port}") as ch:
            for method in ("/edgespec.v1.Verifier/Generate", "/edgespec.v1.Verifier/Cancel"):
                kind = METHODS[method][0]
                with pytest.raises(grpc.RpcError) as info:
                    call_raw(ch, method, kind, [bad_utf8(METHODS[method][1])])
                assert_invalid_argument(info.value, method)
    finally:
        router.stop()
