"""Sessions the verifier's cache lost are re-created by the SDK from what it holds.

A verifier whose Redis does not keep its sessions (``edgespec serve``'s embedded Redis lives in a
temporary folder of the process; an external Redis without persistence) forgets every session
when it is killed. A client whose stream broke then resumes by session id and is answered
NOT_FOUND; the SDK sends its request again with the output tokens it already received
(``committed_ids``) and, for sampling without a seed, the seed the verifier reported on the
first response, so the caller sees one unbroken stream identical to target-only decoding.

Three layers: the SDK's resume logic alone (no server), admission in process (the embedded
Redis, the scheduler driven by hand), and a real ``edgespec serve`` killed with SIGKILL while
three streams (greedy, seeded, unseeded) run, restarted on the same port. A drafter attached and
frozen with SIGSTOP (``--draft-wait-ms 2000``, ``--late-after 0``, its liveness checks out of
reach: ``procs.FROZEN_DRAFTER_ENV``) makes every step of the first serve wait 2 s for
drafts, so the kill after the first token lands between tokens: "mid-generation" is structural,
not a matter of timing luck. (The sampled prompts end in tokens after which the looping model
samples its stop token with a probability below 1e-5: their first token never ends them.)
"""

from __future__ import annotations

import signal

import grpc
import pytest
from conftest import hf_greedy

from edgespec.client import NotFound, build_request
from edgespec.sdk.stream import Resumer as _Resumer
from edgespec.config import ConfigError, EngineConfig, SamplingParams
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.models.loading import stop_token_ids
from edgespec.runner.target_runner import TargetRunner
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.wire.channels import free_port
from procs import FROZEN_DRAFTER_ENV, Streamer, start_drafter, start_serve
from server_harness import server  # noqa: F401  (the in-process server, used by name)
from verifier_node.admission import GenerationRequest, SessionNotFound

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier

TOKEN = "rec0ver"
PROMPT = [1, 10, 11, 12, 13, 10, 11]
N = 120  # tokens per streamed generation
PROMPTS = [[1, 10, 11, 12, 13, 10, 11], [1, 30, 31, 7], [1, 40, 41, 13]]
SEED = 1234
TEMPERATURE = 0.7


def target_only(model, prompt, n, params) -> list[int]:
    """Target-only decoding in process (no drafter): the reference every path must match."""
    runner = TargetRunner(model.model, n_slots=1, max_len=512)
    engine = SpecEngine(runner, None, EngineConfig(max_sessions=1, max_context=512),
                        stop_token_ids(model))
    return engine.generate(Request(list(prompt), n, params)).token_ids


# -- the SDK's resume logic ------------------------------------------------------------------------
class _Err(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "test"


SID_A, SID_B = "a" * 32, "b" * 32


def test_a_resume_answered_not_found_recreates_the_session_from_what_the_client_holds():
    req = build_request("hi", max_new_tokens=9, temperature=0.7, device_id="d1")
    res = _Resumer(req, None, max_resumes=8)
    assert res.next_request() is req
    res.seen(pb.GenerateResponse(session_id=SID_A, prompt_tokens=3, sampling=pb.SamplingParams(
        temperature=0.7, top_p=1.0, has_seed=True, seed=77)))  # the seed the verifier chose
    res.seen(pb.GenerateResponse(session_id=SID_A, token_ids=[5, 6]))
    assert res.retry_after(_Err(grpc.StatusCode.UNAVAILABLE)) > 0  # the verifier died
    resume = res.next_request()
    assert resume.resume_session_id == SID_A and resume.resume_from == 2
    assert res.retry_after(_Err(grpc.StatusCode.NOT_FOUND)) == 0  # its cache lost the session
    again = res.next_request()
    assert again.prompt == "hi" and again.max_new_tokens == 9 and again.device_id == "d1"
    assert list(again.committed_ids) == [5, 6] and again.lost_session_id == SID_A
    assert again.sampling.has_seed and again.sampling.seed == 77
    assert again.sampling.temperature == pytest.approx(0.7)
    assert not req.committed_ids and not req.sampling.has_seed  # the original is left as it was
    # a verifier restarting meanwhile: the re-creation is sent again, not a resume
    assert res.retry_after(_Err(grpc.StatusCode.UNAVAILABLE)) > 0
    assert res.next_request().lost_session_id == SID_A
    res.seen(pb.GenerateResponse(session_id=SID_B, resumed=True, sampling=again.sampling))
    res.seen(pb.GenerateResponse(session_id=SID_B, token_ids=[7]))
    later = res.next_request()  # the re-created session breaks in turn: resumed by its id
    assert later.resume_session_id == SID_B and later.resume_from == 3
    assert res.resumes == 3


def test_not_found_before_any_session_or_from_an_old_verifier_is_raised():
    res = _Resumer(build_request(prompt_ids=[1, 2]), None, max_resumes=8)
    with pytest.raises(NotFound):  # nothing was admitted: a real NOT_FOUND
        res.retry_after(_Err(grpc.StatusCode.NOT_FOUND))
    res.seen(pb.GenerateResponse(session_id=SID_A, token_ids=[4]))
    assert res.retry_after(_Err(grpc.StatusCode.NOT_FOUND)) == 0
    res.next_request()
    with pytest.raises(NotFound):  # a verifier that ignores committed_ids would repeat tokens
        res.seen(pb.GenerateResponse(session_id=SID_B, resumed=False))


def test_a_deadline_that_passes_mid_stream_is_said_in_words():
    """gRPC's bare "Deadline Exceeded" (the call's own timeout) is raised as the resumer's
    sentence: where the deadline passed, and the last answer before it."""
    from edgespec.client import DeadlineExceeded

    res = _Resumer(build_request(prompt_ids=[1, 2]), 60.0, max_resumes=8)
    res.seen(pb.GenerateResponse(session_id=SID_A, token_ids=[4]))
    with pytest.raises(DeadlineExceeded, match=f"the deadline passed during session {SID_A}"):
        res.retry_after(_Err(grpc.StatusCode.DEADLINE_EXCEEDED))
    res = _Resumer(build_request(prompt_ids=[1, 2]), 60.0, max_resumes=8)
    res.seen(pb.GenerateResponse(session_id=SID_A, token_ids=[4]))
    assert res.retry_after(_Err(grpc.StatusCode.UNAVAILABLE)) > 0
    with pytest.raises(DeadlineExceeded, match=f"while resuming session {SID_A} "
                                               r"\(last answer: UNAVAILABLE: test\)"):
        res.retry_after(_Err(grpc.StatusCode.DEADLINE_EXCEEDED))


def test_a_resume_without_a_deadline_waits_for_a_restart_as_long_as_for_a_start(monkeypatch):
    """A stream broken with no deadline resumed with wait_for_ready and no bound: a server
    that never came back held the call for ever. A resume now first waits for the server as a
    first contact does for one loading its model (STARTING_WAIT_S), then says so."""
    import edgespec.client as client_mod
    from edgespec.client import Client, Unavailable

    c = Client("127.0.0.1:1", max_resumes=8)
    c._reached = True
    asked: list[float] = []
    monkeypatch.setattr(c._watch, "unreachable_reason",
                        lambda timeout: asked.append(timeout) or "nothing is listening (test)")

    def generate(request, **kw):  # one token, then the server goes away
        yield pb.GenerateResponse(session_id=SID_A, token_ids=[4])
        raise _Err(grpc.StatusCode.UNAVAILABLE)

    class _Stub:
        Generate = staticmethod(lambda request, **kw: _Call(generate(request, **kw)))

    class _Call:
        def __init__(self, it):
            self.it = it

        def __iter__(self):
            return self.it

        def cancel(self):
            pass

    c.stub = _Stub()
    with pytest.raises(Unavailable, match=f"nothing is listening \\(test\\), resuming session "
                                          f"{SID_A}"):
        c.generate(prompt_ids=[1, 2])
    assert asked == [client_mod.STARTING_WAIT_S]
    c.close()


# -- admission in process --------------------------------------------------------------------------
def run_out(sched, engine) -> None:
    sched._admit()
    while engine.sessions:
        engine.step()


def test_a_recreated_session_continues_after_the_clients_tokens(verifier_parts, looping):
    _, engine, sched, admission = verifier_parts
    ref = hf_greedy(looping.model, PROMPT, 12)
    ticket = admission.admit(GenerationRequest(
        prompt_ids=PROMPT, max_new_tokens=12, device_id="gone", lost_session_id=SID_A,
        committed=ref[:5]))  # pinned to a drafter that is not attached: passed over
    assert ticket.device is None and ticket.tokens == ref[:5] and ticket.session_id != SID_A
    run_out(sched, engine)
    assert ticket.result.token_ids == ref


def test_unseeded_sampling_reports_its_seed_and_a_recreation_continues_the_draw(verifier_parts,
                                                                               looping):
    store, engine, sched, admission = verifier_parts
    ticket = admission.admit(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=40,
                                               params=SamplingParams(temperature=1.0)))
    seed = ticket.request.params.seed  # chosen at admission: the first response reports it
    assert seed is not None
    sched._admit()
    for _ in range(3):
        engine.step()
    sched._shut_down()  # the verifier stops; then its Redis forgets the session
    held = list(ticket.tokens)
    assert 0 < len(held) < 40
    store.redis.delete(*store.keys.session(ticket.session_id))
    with pytest.raises(SessionNotFound):
        admission.admit(GenerationRequest(resume_session_id=ticket.session_id))
    again = admission.admit(GenerationRequest(
        prompt_ids=PROMPT, max_new_tokens=40, lost_session_id=ticket.session_id,
        params=SamplingParams(temperature=1.0, seed=seed), committed=held))
    run_out(sched, engine)
    ref = target_only(looping, PROMPT, 40, SamplingParams(temperature=1.0, seed=seed))
    assert again.result.token_ids == ref


def test_a_client_holding_the_whole_output_gets_the_end_and_no_more_tokens(verifier_parts, looping):
    _, _, _, admission = verifier_parts
    ref = hf_greedy(looping.model, PROMPT, 6)
    done = admission.admit(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=6,
                                             committed=ref, lost_session_id=SID_A))
    assert done.ended and done.result.finish_reason == "length" and done.tokens == ref
    stopped = admission.admit(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=50,
                                                committed=ref[:3] + [2], lost_session_id=SID_A))
    assert stopped.ended and stopped.result.finish_reason == "stop"


@pytest.mark.parametrize("kw,said", [
    # a resume takes its output from the cache
    (dict(resume_session_id=SID_A, committed=[5]), "send none"),
    # out of the vocabulary: named as the output it is, not as the prompt
    (dict(prompt_ids=PROMPT, committed=[1 << 20], lost_session_id=SID_A),
     r"^committed \(output\) token ids must be in"),
    (dict(prompt_ids=PROMPT, committed=[-1], lost_session_id=SID_A), r"^committed \(output\)"),
    (dict(prompt_ids=[1 << 20], committed=[5], lost_session_id=SID_A), r"^prompt token ids"),
    (dict(prompt_ids=PROMPT, committed=[5], lost_session_id="x:y"), "session id"),
    # an output that ended at a stop token (2) before its last: no session produced it
    (dict(prompt_ids=PROMPT, committed=[5, 2, 6], lost_session_id=SID_A),
     "stop token at 1, before their end"),
    # more output than the session could give (a hostile probe's: answered as a whole output)
    (dict(prompt_ids=PROMPT, committed=[5] * 9, lost_session_id=SID_A),
     r"committed_ids \(9\) are more than the max_new_tokens \(8\)"),
])
def test_bad_recreations_are_refused(verifier_parts, kw, said):
    with pytest.raises(ConfigError, match=said):
        verifier_parts[3].admit(GenerationRequest(max_new_tokens=8, **kw))


def test_committed_ids_past_the_context_are_refused_on_the_wire_before_any_work(server):
    """A re-creation holding more tokens than a session can (found by a hostile client's
    probe: three million committed_ids with max_new_tokens 1 were answered as a whole output
    after seconds of copies and scans each) is refused INVALID_ARGUMENT from their count."""
    from edgespec.v1 import edgespec_pb2_grpc as pb_grpc

    limit = server.verifier_service.admission.max_len
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.VerifierStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(
                prompt="hi", max_new_tokens=1, lost_session_id=SID_A,
                committed_ids=[5] * (limit + 1)), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceed the context limit" in e.value.details()


def test_a_resume_counting_more_than_the_session_can_give_is_refused(verifier_parts, server):
    """A client saying it holds more output tokens than the session has or can have (a hostile
    probe's resume_from of 2**31 - 1 on a finished 20-token session was answered as a finished
    stream of no tokens) is refused INVALID_ARGUMENT, on the wire too; up to the output is
    served as before."""
    from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
    from verifier_node.service import resume_count_refused

    admission = verifier_parts[3]
    running = admission.admit(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=6))
    assert resume_count_refused(6, running) is None  # ahead of the cache: the client's count
    assert "past its output limit of 6 tokens" in resume_count_refused(7, running)
    done = admission.admit(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=6,
                                             committed=[5, 6, 2], lost_session_id=SID_A))
    assert done.ended and resume_count_refused(3, done) is None
    assert "past the output of 3 tokens it ended with" in resume_count_refused(4, done)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.VerifierStub(ch)
        first = list(stub.Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=4),
                                   timeout=120))
        sid, out = first[0].session_id, [t for r in first for t in r.token_ids]
        assert first[-1].finished and len(out) == 4
        for past in (5, 2 ** 31 - 1):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(resume_session_id=sid, resume_from=past),
                                   timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"resume_from {past} is past the output of 4 tokens" in e.value.details()
        again = list(stub.Generate(pb.GenerateRequest(resume_session_id=sid, resume_from=2),
                                   timeout=60))
        assert [t for r in again for t in r.token_ids] == out[2:] and again[-1].finished


def test_a_resume_from_below_zero_is_refused_not_read_as_zero():
    from verifier_node.service import generation_request

    with pytest.raises(ConfigError, match="resume_from must be >= 0.*got -1"):
        generation_request(pb.GenerateRequest(resume_session_id=SID_A, resume_from=-1))
    assert generation_request(pb.GenerateRequest(resume_session_id=SID_A, resume_from=0)) \
        .resume_session_id == SID_A


@pytest.mark.parametrize("kw,said", [
    (dict(prompt="hi", committed_ids=[5, 6]), "committed_ids go with lost_session_id"),
    (dict(prompt="hi", resume_from=3), "resume_from goes with resume_session_id"),
    (dict(prompt="hi", kernel_set="k1"), "kernel_set and kernels_differ_from go with"),
    (dict(prompt="hi", kernels_differ_from=4), "kernel_set and kernels_differ_from go with"),
    (dict(messages=[pb.ChatMessage(role="user", content="hi")], raw=True),
     "messages always go through the chat template"),
])
def test_a_field_without_the_one_it_goes_with_is_refused_on_the_wire(kw, said):
    """A client other than the SDK may send them alone: refused, not read as something else
    (committed ids alone were taken for output a new session already had)."""
    from verifier_node.service import generation_request

    with pytest.raises(ConfigError, match=said):
        generation_request(pb.GenerateRequest(**kw))
    assert generation_request(pb.GenerateRequest(prompt="hi", committed_ids=[5],
                                                 lost_session_id=SID_A)).committed == [5]
    assert generation_request(pb.GenerateRequest(resume_session_id=SID_A, kernel_set="k1")) \
        .kernel_set == "k1"


# -- a real serve killed mid-generation ------------------------------------------------------------
def test_serve_killed_mid_generation_streams_complete_as_target_only(looping, looping_dir,
                                                                     tmp_path):
    port = free_port()
    serve, address = start_serve(looping_dir, tmp_path, port=port, token=TOKEN,
                                 extra=["--draft-wait-ms", 2000, "--late-after", 0,
                                        "--keep-drafting"],
                                 env=FROZEN_DRAFTER_ENV)
    drafter = start_drafter(address, "frozen", tmp_path, token=TOKEN, env=FROZEN_DRAFTER_ENV)
    restarted = None
    try:
        drafter.wait_for("attached to")
        drafter.popen.send_signal(signal.SIGSTOP)
        pinned = dict(max_new_tokens=N, device_id="frozen")
        greedy = Streamer(address, TOKEN, prompt_ids=PROMPTS[0], **pinned)
        seeded = Streamer(address, TOKEN, prompt_ids=PROMPTS[1], temperature=TEMPERATURE, seed=SEED,
                          **pinned)
        unseeded = Streamer(address, TOKEN, prompt_ids=PROMPTS[2], temperature=TEMPERATURE,
                            **pinned)
        streams = (greedy, seeded, unseeded)
        for s in streams:
            s.start()
        for s in streams:
            assert s.first.wait(120)
        serve.kill()  # SIGKILL: its embedded Redis goes with it, and every session
        assert serve.popen.returncode == -signal.SIGKILL
        restarted, _ = start_serve(looping_dir, tmp_path, port=port, token=TOKEN)
        for s in streams:
            s.join(240)
            assert not s.is_alive()
        for s in streams:
            assert s.error is None, s.error
            assert s.resumes >= 2  # the resume (NOT_FOUND), then the re-creation
            assert s.final.finish_reason in ("stop", "length")
        assert greedy.ids == hf_greedy(looping.model, PROMPTS[0], N)
        assert seeded.seed == SEED
        assert seeded.ids == target_only(looping, PROMPTS[1], N,
                                         SamplingParams(temperature=TEMPERATURE, seed=SEED))
        assert unseeded.seed is not None  # the seed the first serve chose and reported
        assert unseeded.ids == target_only(
            looping, PROMPTS[2], N, SamplingParams(temperature=TEMPERATURE, seed=unseeded.seed))
        assert "re-creating session" in restarted.text()
    finally:
        drafter.popen.send_signal(signal.SIGCONT)
        assert drafter.stop() == 0
        if restarted is not None:
            assert restarted.stop() == 0
        serve.stop()
