"""The composed server in process (real gRPC on loopback, embedded Redis): health tells the
truth, stream caps refuse the excess at once, a started server freezes its heap (draining and
stopping: test_server_drain.py)."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest

from edgespec.config import EngineConfig
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec_cli.server import EdgespecServer, ServerOptions

# the in-process server: its fixture (used by name) and helpers
from server_harness import NOT_SERVING, SERVING, _wait_status, server  # noqa: F401

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier

def test_health_is_not_serving_once_the_scheduler_is_dead(server):
    _wait_status(server.port, SERVING)
    server.scheduler.stop()  # the verification loop is gone: nothing would be served
    _wait_status(server.port, NOT_SERVING)


@pytest.mark.parametrize("where", ["step", "forward", "prefill"])
def test_health_is_not_serving_while_every_step_fails_and_serving_after_one_succeeds(server,
                                                                                     where):
    """A fault that fails every verification step (a device fault, say; injected here into the
    engine's step, or into the target's forward or prefill, where the engine fails each session
    alone and the step itself returns) fails each session it meets, and from the third failing
    step in a row health says NOT_SERVING; a step that succeeds makes it SERVING again."""
    from verifier_node.scheduler import FAILING_STEPS

    _wait_status(server.port, SERVING)
    engine = server.scheduler.engine
    faulty = {"step": engine, "forward": engine.target, "prefill": engine.target}[where]
    method = {"step": "step", "forward": "score_rows", "prefill": "prefill_parts"}[where]

    def failing(*args, **kwargs):
        raise RuntimeError("an injected device fault")

    setattr(faulty, method, failing)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.VerifierStub(ch)
        for _ in range(FAILING_STEPS):  # one at a time: a failing step each
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(prompt_ids=[1, 5, 6], max_new_tokens=4),
                                   timeout=60))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        _wait_status(server.port, NOT_SERVING)
        assert f"the last {FAILING_STEPS} verification steps failed" in \
            pb_grpc.VerifierStub(ch).Status(pb.StatusRequest(), timeout=30).unhealthy_reason
        # the forwards that raised are counted (a step that raised ran none to count)
        failed = server.registry.get_sample_value("edgespec:forward_failures_total")
        assert failed == 0 if where == "step" else failed >= FAILING_STEPS
        delattr(faulty, method)  # the fault gone: the class's method again
        got = list(stub.Generate(pb.GenerateRequest(prompt_ids=[1, 5, 6], max_new_tokens=4),
                                 timeout=60))
        assert got[-1].finished
    _wait_status(server.port, SERVING)


def test_health_is_not_serving_while_a_step_hangs_and_serving_once_it_returns(server,
                                                                              monkeypatch):
    """A step that never returns (a hung device or kernel) neither raises nor ends the loop:
    past ``STUCK_STEP_S`` (a second here) health says NOT_SERVING, and SERVING again once the
    step returns; the session it held finishes."""
    import verifier_node.scheduler as scheduler

    monkeypatch.setattr(scheduler, "STUCK_STEP_S", 1.0)
    _wait_status(server.port, SERVING)
    runner = server.scheduler.engine.target
    score_rows, release = runner.score_rows, threading.Event()

    def hung(*a, **k):
        release.wait(120)
        return score_rows(*a, **k)

    monkeypatch.setattr(runner, "score_rows", hung)
    got: list = []
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.VerifierStub(ch)
        call = threading.Thread(target=lambda: got.extend(stub.Generate(
            pb.GenerateRequest(prompt_ids=[1, 5, 6], max_new_tokens=4), timeout=120)))
        call.start()
        try:
            _wait_status(server.port, NOT_SERVING)
            assert server.scheduler.is_alive() and server.scheduler.stuck
            assert stub.Status(pb.StatusRequest(), timeout=30).unhealthy_reason == \
                "a verification step has run for over 1 s"
        finally:
            release.set()
        call.join(120)
    assert not call.is_alive() and got and got[-1].finished
    _wait_status(server.port, SERVING)
    assert not server.scheduler.stuck


def test_a_dead_embedded_redis_is_restarted_with_its_sessions(server):
    """The embedded redis-server runs with an append-only file: the monitor restarts it on
    the same socket and data, and the server serves again (an external Redis going away is
    covered in test_faults.py: health turns NOT_SERVING until it is back)."""
    import edgespec

    _wait_status(server.port, SERVING)
    server.store.redis.set("es:probe", "kept")
    server.redis.client.execute_command("BGREWRITEAOF")
    old = server.redis.proc
    deadline = time.monotonic() + 30
    while server.redis.client.info("persistence")["aof_rewrite_in_progress"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    old.kill()
    old.wait()
    deadline = time.monotonic() + 60
    while server.redis.proc is old or server.redis.proc.poll() is not None:
        assert time.monotonic() < deadline, "the embedded Redis was not restarted"
        time.sleep(0.1)
    _wait_status(server.port, SERVING)
    assert server.store.redis.get("es:probe") == b"kept"
    with edgespec.Client(f"127.0.0.1:{server.port}", timeout=120) as c:
        assert c.generate(prompt_ids=[1, 5, 6], max_new_tokens=4).finish_reason


def test_health_is_not_serving_while_the_embedded_redis_restarts(server):
    """The restart may take long (up to three tries of 30 s on a loaded machine): health says
    NOT_SERVING from the moment the server is found dead, not SERVING until the restart ends."""
    import threading

    _wait_status(server.port, SERVING)
    handle, release = server.redis, threading.Event()
    launch = handle._launch_embedded

    def slow_launch(*args, **kwargs):
        release.wait(60)
        launch(*args, **kwargs)

    handle._launch_embedded = slow_launch
    old = handle.proc
    old.kill()
    old.wait()
    try:
        _wait_status(server.port, NOT_SERVING)  # while the restart has not even begun
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            assert pb_grpc.VerifierStub(ch).Status(pb.StatusRequest(), timeout=30) \
                .unhealthy_reason == "its embedded Redis exited: restarting it"
    finally:
        release.set()
    _wait_status(server.port, SERVING)
    assert handle.proc is not old and handle.proc.poll() is None


def test_attach_streams_beyond_the_cap_are_refused_at_once(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.DraftCacheStub(ch)
        first_out: queue.Queue = queue.Queue()
        first_out.put(pb.DrafterMessage(register=pb.Register(device_id="one")))
        first = stub.Attach(iter(first_out.get, None), timeout=60)
        assert next(first).HasField("registered")
        second = stub.Attach(iter([pb.DrafterMessage(register=pb.Register(device_id="two"))]),
                             timeout=60)
        with pytest.raises(grpc.RpcError) as e:
            next(second)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        first_out.put(None)
        first.cancel()


def test_a_started_server_has_frozen_its_startup_heap_out_of_the_collector(tiny_dir):
    """``start`` moves what is alive (the model, the libraries) into the collector's permanent
    generation (``edgespec.runner.process_heap``): a collection then walks only what serving
    made, and less often (a higher threshold for the youngest generation). The runner is in the
    collector's generations before, and out of them after; ``stop`` gives the heap and the
    thresholds back."""
    import gc

    from edgespec.runner import process_heap
    from edgespec.runner.process_heap import YOUNG_THRESHOLD

    gc.unfreeze()  # another test of this worker may have started a server
    if process_heap._thresholds is not None:  # and left it running: its thresholds back
        gc.set_threshold(*process_heap._thresholds)
    process_heap._thresholds, process_heap._frozen = None, 0
    thresholds = gc.get_threshold()
    srv = EdgespecServer(ServerOptions(
        listen="127.0.0.1:0", model=str(tiny_dir), max_drafters=1,
        engine=EngineConfig(max_sessions=2, max_context=256)))
    try:
        runner = srv.scheduler.engine.target
        assert gc.get_freeze_count() == 0 and any(o is runner for o in gc.get_objects())
        srv.start()
        assert gc.get_freeze_count() > 1000  # the libraries' objects, not a handful
        assert not any(o is runner for o in gc.get_objects())
        # the youngest generation collected less often, the older ones as before
        assert gc.get_threshold() == (max(YOUNG_THRESHOLD, thresholds[0]), *thresholds[1:])
    finally:
        srv.stop(drain_timeout_s=0)
    assert gc.get_freeze_count() == 0  # stopped: the heap given back to the collector
    assert gc.get_threshold() == thresholds


def test_the_collectors_thresholds_come_back_when_the_last_server_stops():
    """Two servers in one process: the first to stop leaves the raised threshold to the one
    still serving; the last gives CPython's back."""
    import gc

    from edgespec.runner import process_heap

    gc.unfreeze()
    if process_heap._thresholds is not None:
        gc.set_threshold(*process_heap._thresholds)
    process_heap._thresholds, process_heap._frozen = None, 0
    before = gc.get_threshold()
    raised = (max(process_heap.YOUNG_THRESHOLD, before[0]), *before[1:])
    try:
        process_heap.freeze_startup_heap()
        process_heap.freeze_startup_heap()
        assert gc.get_threshold() == raised
        process_heap.thaw_heap()
        assert gc.get_threshold() == raised  # the other server still serves
        process_heap.thaw_heap()
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0
        process_heap.thaw_heap()  # a stop too many changes nothing
        assert gc.get_threshold() == before
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
        process_heap._thresholds, process_heap._frozen = None, 0


def test_one_resumed_stream_a_session_is_spared_the_stream_cap_and_no_more(server,
                                                                           monkeypatch):
    """A resume continues a session that already counts: one resumed stream of a session the
    verifier holds is never refused, even when the cap is reached; a second one of the same
    session at once counts as a new stream (refused at the cap), so that resuming one session
    over and over cannot take every worker thread; so does a resume of a session it does not
    hold (a made-up id: refused at the cap). The streams are held open by a stand-in for the
    generation, the held sessions by a stand-in for the scheduler's tickets (what is tested is
    the count of streams, through real gRPC)."""
    service = server.verifier_service
    release = threading.Event()
    monkeypatch.setattr(service.scheduler, "ticket",
                        lambda sid: object() if sid in ("s1", "s2") else None)

    def held(request, context):  # a stream that stays open until released
        yield pb.GenerateResponse(session_id=request.resume_session_id or "new")
        release.wait(60)

    service._generate = held
    refused = grpc.StatusCode.RESOURCE_EXHAUSTED
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.VerifierStub(ch)

        def opened(**kw):
            call = stub.Generate(pb.GenerateRequest(**kw), timeout=60)
            return call, next(call)

        held_calls = [opened(prompt_ids=[1])[0] for _ in range(service.max_streams)]
        for kw in (dict(prompt_ids=[1]), dict(resume_session_id="s1")):
            if "resume_session_id" in kw:
                first, got = opened(**kw)  # the cap is reached: spared
                assert got.session_id == "s1"
                held_calls.append(first)
            with pytest.raises(grpc.RpcError) as e:
                opened(**kw)
            assert e.value.code() == refused
        with pytest.raises(grpc.RpcError) as e:  # a session not held here: a new stream
            opened(resume_session_id="made-up")
        assert e.value.code() == refused
        other, got = opened(resume_session_id="s2")  # another session's resume: spared
        assert got.session_id == "s2"
        release.set()
        for call in [*held_calls, other]:
            assert list(call) == []  # each ends as the stand-in returns
    deadline = time.monotonic() + 30
    while service._streams or service._resuming:  # every count given back
        assert time.monotonic() < deadline, (service._streams, service._resuming)
        time.sleep(0.05)


def test_health_is_not_serving_while_redis_refuses_writes_and_serving_once_it_takes_them(
        server):
    """A Redis that answers pings but refuses every write (full at its maxmemory with no
    eviction: OOM) could neither create nor commit a session: health says NOT_SERVING and
    status says why; once it takes writes again, SERVING. The idle verifier sees it too: its
    health probe writes."""
    _wait_status(server.port, SERVING)
    client = server.redis.client
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1")  # any memory in use is over it
    try:
        _wait_status(server.port, NOT_SERVING)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            status = pb_grpc.VerifierStub(ch).Status(pb.StatusRequest(), timeout=10)
        assert not status.healthy
        assert "its Redis refuses writes" in status.unhealthy_reason
        assert "maxmemory" in status.unhealthy_reason
    finally:
        client.config_set("maxmemory", "0")
    _wait_status(server.port, SERVING)
