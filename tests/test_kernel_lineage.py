"""One kernel set per session: the runner's choices as one record, its fingerprint kept with
each session, and a session that moves to other kernels saying from where its decoding differs.

Layers: the record and the lineage rules alone; admission over the embedded Redis (resumes and
re-creations driven by hand); the SDK's resume logic without a server; and two real verifiers
over one Redis, float32 and a half-precision dtype this CPU serves exactly (two kernel sets on
one machine), behind the router, over gRPC.
"""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest
import torch
from conftest import hf_greedy

from edgespec.client import Client, build_request
from edgespec.sdk.stream import Resumer as _Resumer
from edgespec.config import ConfigError, EngineConfig, SamplingParams
from edgespec.protocol.lineage import Lineage, checked_lineage, continued_on, joined
from edgespec.runner.kernel_set import HeadLayout, KernelSet, choose_kernel_set
from edgespec.runner.target_runner import TargetRunner
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from verifier_node.admission import GenerationRequest

PROMPT = [1, 10, 11, 12, 13, 10, 11]
OTHER = "0123456789abcdef"  # another replica's kernel set
SID = "c" * 32


# -- the record ------------------------------------------------------------------------------------
def test_the_runner_is_built_from_its_kernel_set_and_every_choice_moves_the_fingerprint(looping):
    runner = TargetRunner(looping.model, n_slots=1, max_len=128)
    ks = runner.kernel_set
    cfg = looping.model.config
    heads = HeadLayout(cfg.num_attention_heads, cfg.num_key_value_heads,
                       cfg.hidden_size // cfg.num_attention_heads)
    assert ks == choose_kernel_set("cpu", torch.float32, heads)  # chosen the same way twice
    assert (ks.kernels, ks.products, ks.attention, ks.dtype) == ("eager", "packed", "blocks",
                                                                 "float32")
    assert runner.col_tile == ks.col_tile and ks.proven
    assert ks.threads == torch.get_num_threads() and ks.torch_version == torch.__version__
    assert choose_kernel_set("cpu", torch.bfloat16, heads).fingerprint != ks.fingerprint
    assert choose_kernel_set("cpu", torch.float32, heads, pack=False).products == "plain"
    for f in dataclasses.fields(KernelSet):  # any one choice changed: another fingerprint
        value = getattr(ks, f.name)
        other = (not value if isinstance(value, bool) else value + 1 if isinstance(value, int)
                 else value + "x")
        assert dataclasses.replace(ks, **{f.name: other}).fingerprint != ks.fingerprint, f.name
    given = TargetRunner(looping.model, n_slots=1, max_len=128, kernel_set=ks)
    assert given.kernel_set is ks and given.run_state()["kernel_set"]["fingerprint"] == \
        ks.fingerprint
    with pytest.raises(ConfigError, match="kernel set is for bfloat16"):
        TargetRunner(looping.model, n_slots=1, max_len=128,
                     kernel_set=dataclasses.replace(ks, dtype="bfloat16"))
    with pytest.raises(ConfigError, match="kernels must be one of"):
        choose_kernel_set("cpu", torch.float32, heads, kernels="fast")


# -- the lineage rules -----------------------------------------------------------------------------
def test_a_session_on_another_kernel_set_differs_from_its_committed_output_on():
    a, b = "a" * 16, "b" * 16
    assert continued_on(None, a, 5) == Lineage(a)  # a new session
    assert continued_on(Lineage(""), a, 5) == Lineage(a)  # recorded before lineages were kept
    assert continued_on(Lineage(a), a, 5) == Lineage(a)  # the same kernels: one decoding
    assert continued_on(Lineage(a), b, 5) == Lineage(a, 5)  # other kernels from token 5
    assert continued_on(Lineage(a), b, 0) == Lineage(b)  # nothing decoded yet: b's alone
    assert continued_on(Lineage(a, 3), b, 9) == Lineage(a, 3)  # the first difference stays
    assert continued_on(Lineage(a, 3), a, 9) == Lineage(a, 3)  # coming back does not undo it
    # the client's side: what a stream's first response reports, joined with what it holds
    assert joined(None, Lineage(a), 0) == Lineage(a)
    assert joined(Lineage(a), Lineage(a), 7) == Lineage(a)
    assert joined(Lineage(a), Lineage(a, 4), 7) == Lineage(a, 4)  # the verifier's record
    assert joined(Lineage(a), Lineage(b), 7) == Lineage(a, 7)  # a verifier that kept none
    assert joined(Lineage(a, 2), Lineage(a, 4), 7) == Lineage(a, 2)  # the earliest
    assert joined(Lineage(a, 2), Lineage(b), 9) == Lineage(a, 2)


@pytest.mark.parametrize("kernels,differs,error", [
    ("", 2, "needs the kernel_set"), ("A" * 16, 0, "16 lowercase hex"),
    ("a" * 15, 0, "16 lowercase hex"), ("a" * 16, 4, r"in \[0, 3\]"),
    ("a" * 16, -1, r"in \[0, 3\]")])
def test_a_clients_malformed_lineage_is_refused(kernels, differs, error):
    with pytest.raises(ValueError, match=error):
        checked_lineage(kernels, differs, 3)
    assert checked_lineage("", 0, 3) is None and checked_lineage("a" * 16, 3, 3) == \
        Lineage("a" * 16, 3)


# -- admission over the embedded Redis -------------------------------------------------------------
def run_out(sched, engine) -> None:
    sched._admit()
    while engine.sessions:
        engine.step()


def test_a_new_session_records_this_verifiers_kernel_set(verifier_parts):
    store, engine, sched, admission = verifier_parts
    ticket = admission.admit(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=3))
    run_out(sched, engine)
    here = engine.target.kernel_set.fingerprint
    assert store.load(ticket.session_id).lineage == Lineage(here)
    assert admission.kernels == here


@pytest.mark.parametrize("recorded,expected", [
    ("here", "here"),  # the same kernel set: continued as one decoding
    (OTHER, "differs"),  # another set decoded the first 4 tokens
    ("", "here"),  # a session recorded by a verifier that kept no kernel set
])
def test_a_resumed_session_keeps_its_lineage_and_differs_where_it_changed_kernels(
        verifier_parts, looping, recorded, expected):
    store, engine, sched, admission = verifier_parts
    here = engine.target.kernel_set.fingerprint
    ref = hf_greedy(looping.model, PROMPT, 10)
    store.create(SID, PROMPT, SamplingParams(), None, max_new_tokens=10, committed=ref[:4],
                 lineage=Lineage(here if recorded == "here" else recorded))
    ticket = admission.admit(GenerationRequest(resume_session_id=SID))
    want = Lineage(OTHER, 4) if expected == "differs" else Lineage(here)
    assert ticket.request.lineage == want
    run_out(sched, engine)
    assert ticket.result.token_ids == ref  # float32 here: the same tokens either way
    assert store.load(SID).lineage == want  # kept for the next resume


def test_a_session_resumed_before_any_output_is_simply_this_kernel_sets(verifier_parts):
    store, engine, _, admission = verifier_parts
    store.create(SID, PROMPT, SamplingParams(), None, max_new_tokens=5, lineage=Lineage(OTHER))
    ticket = admission.admit(GenerationRequest(resume_session_id=SID))
    assert ticket.request.lineage == Lineage(engine.target.kernel_set.fingerprint)


def test_a_recreated_session_carries_the_clients_lineage_on(verifier_parts, looping):
    _, engine, sched, admission = verifier_parts
    ref = hf_greedy(looping.model, PROMPT, 8)
    ticket = admission.admit(GenerationRequest(
        prompt_ids=PROMPT, max_new_tokens=8, lost_session_id=SID, committed=ref[:3],
        kernel_set=OTHER))
    assert ticket.request.lineage == Lineage(OTHER, 3)
    run_out(sched, engine)
    assert ticket.result.token_ids == ref
    with pytest.raises(ConfigError, match="kernels_differ_from"):
        admission.admit(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=8,
                                          lost_session_id=SID, committed=ref[:3],
                                          kernel_set=OTHER, kernels_differ_from=5))


# -- the SDK's resume logic ------------------------------------------------------------------------
class _Err(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "test"


def test_the_sdk_keeps_the_lineage_across_resumes_and_sends_it_on():
    a, b = "a" * 16, "b" * 16
    res = _Resumer(build_request(prompt_ids=[1, 2]), None, max_resumes=8)
    res.seen(pb.GenerateResponse(session_id=SID, prompt_tokens=2, kernel_set=a))
    res.seen(pb.GenerateResponse(session_id=SID, token_ids=[5, 6, 7]))
    assert res.lineage == Lineage(a)
    res.retry_after(_Err())
    resume = res.next_request()
    assert resume.kernel_set == a and resume.kernels_differ_from == 0
    # the resume lands on a verifier of another kernel set, one whose cache kept no record
    res.seen(pb.GenerateResponse(session_id=SID, resumed=True, kernel_set=b))
    res.seen(pb.GenerateResponse(session_id=SID, token_ids=[8]))
    assert res.lineage == Lineage(a, 3)
    res.retry_after(_Err())
    again = res.next_request()
    assert again.kernel_set == a and again.kernels_differ_from == 3


# -- two verifiers of two kernel sets behind the router --------------------------------------------
def second_dtype() -> str:
    """A dtype besides float32 that this CPU serves exactly: bfloat16 where its products are
    batch-invariant, else float16 (CPU kinds differ: docs/measured/cpu-kinds/)."""
    from edgespec.runner.dtype_probe import exact_here

    for name in ("bfloat16", "float16"):
        if exact_here(name):
            return name
    pytest.skip("this CPU serves no dtype but float32 exactly: one kernel set here")


@pytest.fixture()
def replicas(looping_dir):
    from edgespec_cli.server import EdgespecServer, ServerOptions
    from verifier_node.router import VerifierRouter

    engine = EngineConfig(max_sessions=2, max_context=256)
    a = EdgespecServer(ServerOptions(listen="127.0.0.1:0", model=str(looping_dir),
                                     dtype="float32", engine=engine)).start()
    b = None
    router = None
    try:
        b = EdgespecServer(ServerOptions(listen="127.0.0.1:0", model=str(looping_dir),
                                         roles=("verifier",), redis_url=a.redis.url,
                                         dtype=second_dtype(), engine=engine)).start()
        # b first: without a preference the router would pick it (ties go to the first)
        router = VerifierRouter("127.0.0.1:0", [f"127.0.0.1:{b.port}",
                                                f"127.0.0.1:{a.port}"]).start()
        yield a, b, router
    finally:
        if router is not None:
            router.stop()
        if b is not None:
            b.stop(drain_timeout_s=0)
        a.stop(drain_timeout_s=0)


def fingerprint(srv) -> str:
    return srv.scheduler.engine.target.kernel_set.fingerprint


def switched(srv) -> float:
    return srv.registry.get_sample_value("edgespec:sessions_kernels_switched_total")


def resume(port: int, sid: str, start: int, kernels: str = "") -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return list(pb_grpc.VerifierStub(ch).Generate(pb.GenerateRequest(
            resume_session_id=sid, resume_from=start, kernel_set=kernels), timeout=120))


def test_a_resume_goes_to_its_kernel_set_and_elsewhere_says_where_its_decoding_differs(
        replicas, looping):
    a, b, router = replicas
    fa, fb = fingerprint(a), fingerprint(b)
    assert fa != fb
    # the router reads each replica's kernel set from its health check: the first check at
    # start may miss its second on a loaded machine, and the monitor's next one reads it
    deadline = time.monotonic() + 60
    while {r.kernel_set for r in router._replicas} != {fa, fb}:
        assert time.monotonic() < deadline, [r.kernel_set for r in router._replicas]
        time.sleep(0.1)
    ref = hf_greedy(looping.model, PROMPT, 12)  # float32 target-only: replica a's decoding
    for sid in ("1" * 32, "2" * 32):  # sessions replica a began: 4 tokens, then it went away
        a.store.create(sid, PROMPT, SamplingParams(), None, max_new_tokens=12,
                       committed=ref[:4], lineage=Lineage(fa))

    # through the router, with the kernel set the SDK holds: to replica a, one decoding
    first, *rest = resume(router.port, "1" * 32, 4, kernels=fa)
    assert (first.kernel_set, first.kernels_differ_from) == (fa, 0)
    assert [t for r in rest for t in r.token_ids] == ref[4:]
    assert rest[-1].finished and switched(a) == 0

    # straight to replica b: continued in its dtype, and said so from token 4 on
    first, *rest = resume(b.port, "2" * 32, 4)
    assert (first.kernel_set, first.kernels_differ_from) == (fa, 4)
    assert rest[-1].finished and len([t for r in rest for t in r.token_ids]) == 8
    assert switched(b) == 1
    assert a.store.load("2" * 32).lineage == Lineage(fa, 4)

    # the SDK's result names the kernel set of a new session's replica
    with Client(f"127.0.0.1:{router.port}", timeout=120) as c:
        out = c.generate(prompt_ids=PROMPT, max_new_tokens=6)
    assert out.kernel_set in (fa, fb) and out.kernels_differ_from == 0


def test_the_router_prefers_a_replica_of_the_sessions_kernel_set():
    from verifier_node.router import VerifierRouter

    router = VerifierRouter("127.0.0.1:0", ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
    try:
        r0, r1, r2 = router._replicas
        for r, k in zip(router._replicas, ("a" * 16, "b" * 16, "b" * 16)):
            r.healthy, r.kernel_set = True, k
        assert router._acquire(set(), None, "b" * 16) == 1  # not the first: another set
        assert router._acquire(set(), None, "b" * 16) == 2  # the same set, fewer streams
        assert router._acquire({1, 2}, None, "b" * 16) == 0  # none of it left: any replica
        assert router._acquire(set(), 0, "b" * 16) == 0  # where it ran comes first
        r1.healthy = False
        assert router._acquire({2}, None, "b" * 16) == 0  # a healthy replica over its set
    finally:
        router.stop()


def test_the_router_is_not_serving_while_no_replica_answers():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from verifier_node.router import VERIFIER_SERVICE, VerifierRouter

    router = VerifierRouter("127.0.0.1:0", ["127.0.0.1:1"]).start()  # nothing listens there
    try:
        with grpc.insecure_channel(f"127.0.0.1:{router.port}") as ch:
            got = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE), timeout=10)
        assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        router.stop()



def test_every_runner_module_is_digested_or_said_to_compute_no_step_values():
    """A module that computes a step's values is in the kernel set's code digest of each path
    (an edit to its arithmetic moves the fingerprint); every other runner module is named as
    computing none, so a new or split module must be placed on one side."""
    import pkgutil

    import edgespec.runner as runner_pkg
    from edgespec.runner.kernel_set import NO_STEP_ARITHMETIC, NUMERIC_CODE

    modules = {m.name for m in pkgutil.iter_modules(runner_pkg.__path__)}
    digested = {name.rsplit(".", 1)[1] for path in NUMERIC_CODE.values() for name in path}
    assert digested.isdisjoint(NO_STEP_ARITHMETIC)
    assert modules == digested | set(NO_STEP_ARITHMETIC)
    # the layers, the weights and the rotary tables of the path every CPU step runs
    assert {"attention", "linear", "target_runner", "eager_forward",
            "model_weights"} <= {n.rsplit(".", 1)[1] for n in NUMERIC_CODE["eager"]}
