"""Resuming sessions, step by step and without timing: the scheduler's loop is driven by hand
(its thread is never started), against the embedded Redis."""

from __future__ import annotations

from conftest import hf_greedy

from edgespec.config import EngineConfig, SamplingParams
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.protocol.contract import Verdict
from edgespec.sdk.stream import Collector, Resumer
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.wire.convert import logprobs_to_pb
from verifier_node.admission import GenerationRequest
from verifier_node.service import response_logprobs

PROMPT = [1, 10, 11, 12, 13, 10, 11]


def test_the_last_commit_holds_exactly_the_output(verifier_parts, looping):
    """A correct 6-token draft under max_new_tokens=2: the cache keeps 2 tokens, not 7."""
    store, engine, _, _ = verifier_parts
    ref = hf_greedy(looping.model, PROMPT, 8)
    act = engine.add(Request(PROMPT, 2, SamplingParams()), session_id="s1", device="board-1")
    store.redis.set(store.keys.session("s1")[2], b"".join(
        t.to_bytes(4, "little") for t in ref[:6]))  # the draft, as a drafter would push it
    engine.step()
    assert act.output == ref[:2] and act.finish == "length"
    rec = store.load("s1")
    assert rec.committed == ref[:2] and rec.finish_reason == "length"


def test_a_finished_session_whose_close_never_ran_is_replayed_not_regenerated(verifier_parts,
                                                                              looping):
    store, _, _, admission = verifier_parts
    store.create("s2", PROMPT, SamplingParams(), None, max_new_tokens=3)
    ref = hf_greedy(looping.model, PROMPT, 3)
    for i, tok in enumerate(ref):  # committed by a verifier killed before its close
        store.commit_many([Verdict("s2", i, len(PROMPT) + i, 0, tok,  # no draft: each a fix
                                   finish_reason="length" if i == 2 else "")])
    ticket = admission.admit(GenerationRequest(resume_session_id="s2"))
    assert ticket.ended and ticket.result.finish_reason == "length"
    assert ticket.tokens == ref


def test_an_orphan_cancel_does_not_end_a_session_a_client_resumed(verifier_parts):
    _, engine, sched, admission = verifier_parts
    ticket = admission.admit(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=50))
    sched._admit()
    with admission.follow(ticket):
        pass  # the first stream broke: its orphan cancel is queued ...
    resumed = admission.admit(GenerationRequest(resume_session_id=ticket.session_id))
    assert resumed is ticket  # ... but the client resumed before the loop applied it
    with admission.follow(resumed):
        sched._apply_cancels()
        assert not ticket.ended and len(engine.sessions) == 1
        engine.step()
        assert len(ticket.tokens) >= 1
    sched._apply_cancels()  # the resumed stream left too: now it is cancelled
    assert ticket.result.finish_reason == "cancelled" and not engine.sessions


class _Aborted(Exception):
    """What a gRPC handler's ``context.abort`` raises, here."""


class _Context:
    """The parts of a handler's context ``VerifierService.Generate`` uses."""

    def abort(self, code, details):
        raise _Aborted(code, details)

    def time_remaining(self):
        return None

    def is_active(self):
        return True

    def set_trailing_metadata(self, metadata):
        pass


def test_a_refused_resume_leaves_the_session_cancellable_when_its_reader_leaves(verifier_parts):
    """A resume counting more output than the session can give is refused after admission
    took its claim on the running session: the refusal gives the claim back, so the session is
    still cancelled when its own reader leaves (a review's find: the claim stayed, and every
    orphan cancel of the session was void from then on; it decoded for nobody)."""
    import grpc

    from verifier_node.service import VerifierService

    _, engine, sched, admission = verifier_parts
    service = VerifierService(admission)
    ticket = admission.admit(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=6))
    sched._admit()
    with admission.follow(ticket):
        try:
            list(service.Generate(pb.GenerateRequest(resume_session_id=ticket.session_id,
                                                     resume_from=7), _Context()))
        except _Aborted as e:
            assert e.args[0] == grpc.StatusCode.INVALID_ARGUMENT
            assert "past its output limit of 6 tokens" in e.args[1]
        else:
            raise AssertionError("the resume was not refused")
        assert ticket.claims == 0 and not ticket.ended
    sched._apply_cancels()  # its reader left: the session is cancelled, its slot freed
    assert ticket.result.finish_reason == "cancelled" and not engine.sessions


def test_an_orphan_cancel_applied_before_the_resumed_stream_follows_is_void(verifier_parts):
    """The loop may apply the first stream's orphan cancel after the resume got the running
    ticket but before its handler follows it: the resume voids it all the same."""
    _, engine, sched, admission = verifier_parts
    ticket = admission.admit(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=50))
    sched._admit()
    engine.step()
    with admission.follow(ticket):
        pass  # the first stream broke: its orphan cancel is queued
    resumed = admission.admit(GenerationRequest(resume_session_id=ticket.session_id))
    assert resumed is ticket
    sched._apply_cancels()  # the loop comes round before the resumed handler follows
    assert not ticket.ended and len(engine.sessions) == 1
    with admission.follow(resumed):
        engine.step()
    sched._apply_cancels()  # the resumed stream left too, after following: now cancelled
    assert ticket.result.finish_reason == "cancelled" and not engine.sessions


def test_a_stopping_verifier_leaves_its_sessions_resumable(verifier_parts, looping):
    store, engine, sched, admission = verifier_parts
    ref = hf_greedy(looping.model, PROMPT, 12)
    ticket = admission.admit(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=12))
    sched._admit()
    engine.step()
    engine.step()
    sched._shut_down()
    assert ticket.error is not None and not engine.active
    rec = store.load(ticket.session_id)
    assert rec.finish_reason is None and rec.committed == ref[:len(rec.committed)]
    resumed = admission.admit(GenerationRequest(resume_session_id=ticket.session_id))
    assert resumed is not ticket and resumed.tokens == rec.committed
    sched._admit()
    while engine.sessions:
        engine.step()
    assert resumed.result.token_ids == ref


def test_a_resumed_session_keeps_its_penalties_and_bias(verifier_parts):
    """The cache keeps a session's penalties and logit bias with its sampling settings: a
    verifier that resumes it from there continues target-only decoding with them."""
    store, engine, sched, admission = verifier_parts
    with SpecEngine(engine.target, None, EngineConfig(), stop_ids=set()) as alone:
        plain = alone.generate(Request(PROMPT, 12, SamplingParams(temperature=0.9,
                                                                  seed=4))).token_ids
        params = SamplingParams(temperature=0.9, seed=4, presence_penalty=-0.75,
                                frequency_penalty=1.25, logit_bias={plain[3]: -100, 20: 3})
        ref = alone.generate(Request(PROMPT, 12, params)).token_ids
    assert ref[:3] == plain[:3] and ref != plain  # the settings matter after the first step
    ticket = admission.admit(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=12,
                                               params=params))
    sched._admit()
    while len(ticket.tokens) < 5:
        engine.step()
    sched._shut_down()
    rec = store.load(ticket.session_id)
    assert rec.params == params and rec.committed == ref[:len(rec.committed)]
    assert 5 <= len(rec.committed) < 12  # its continuation counts them
    resumed = admission.admit(GenerationRequest(resume_session_id=ticket.session_id))
    sched._admit()
    while engine.sessions:
        engine.step()
    assert resumed.result.token_ids == ref


def test_a_running_ticket_that_ends_before_its_resume_submits_it_is_not_queued_again(
        verifier_parts):
    """A resume finds the running ticket, which ends before the resume submits it (the session
    finished in between): it is handed back as it ended, not queued to run its request again."""
    from edgespec.engine.spec_engine import Result
    from edgespec.protocol.request_stats import Stats

    _, engine, sched, admission = verifier_parts
    ticket = admission.admit(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=8))
    sched._admit()
    running = sched.ticket(ticket.session_id)
    assert running is ticket and not running.ended
    sched._end(ticket, result=Result([4, 5], Stats(), "stop"))  # it ends right then
    assert sched.submit(running) is ticket and ticket.ended
    assert sched.ticket(ticket.session_id) is None and not sched._pending


def test_a_resumed_streams_logprobs_stay_with_their_tokens(verifier_parts, looping):
    """A session resumed from the cache, whose client holds fewer tokens than the cache kept
    (the break came after a commit, before its tokens were sent): the tokens between go in a
    response of their own with no logprobs, and the SDK gives them None; every later token has
    its own, target-only's."""
    store, engine, sched, admission = verifier_parts
    ref = hf_greedy(looping.model, PROMPT, 8)
    store.create("s5", PROMPT, SamplingParams(), None, max_new_tokens=8)
    for i, tok in enumerate(ref[:3]):  # committed by a verifier killed before sending 2 of them
        store.commit_many([Verdict("s5", i, len(PROMPT) + i, 0, tok)])
    ticket = admission.admit(GenerationRequest(resume_session_id="s5", logprobs=1))
    sched._admit()
    while not ticket.ended:
        engine.step()
    with SpecEngine(engine.target, None, EngineConfig(), stop_ids=set()) as alone:
        own = alone.generate(Request(PROMPT, 8, logprobs=1)).logprobs
    res = Resumer.of_call(type("Client", (), {"timeout": None, "max_resumes": 1}), None,
                          prompt_ids=PROMPT, logprobs=1)
    collected = Collector(res)
    cursor = 1  # the client received one token before the break: resume_from
    collected.add(pb.GenerateResponse(session_id="s5", token_ids=ref[:1], text="x",
                                      logprobs=logprobs_to_pb(own[:1])))
    while cursor < len(ticket.tokens):
        new, shown = response_logprobs(ticket, cursor, ticket.tokens[cursor:])
        assert len(shown) in (0, len(new))
        collected.add(pb.GenerateResponse(session_id="s5", token_ids=new, text="x",
                                          logprobs=logprobs_to_pb(shown)))
        cursor += len(new)
    collected.add(pb.GenerateResponse(session_id="s5", finished=True, finish_reason="length"))
    out = collected.result()
    assert out.token_ids == ref
    assert out.logprobs == own[:1] + [None, None] + own[3:]


def test_a_resumed_session_scores_its_prompt_again_when_asked(verifier_parts, looping):
    """A stream that broke before it had its prompt's logprobs asks again on its resume: the
    verifier that prefills the session from the cache (prompt and committed tokens) scores
    the prompt, the same logprobs as a session that never broke, and the continuation is
    target-only's."""
    store, engine, sched, admission = verifier_parts
    ref = hf_greedy(looping.model, PROMPT, 8)
    with SpecEngine(engine.target, None, EngineConfig(), stop_ids=set()) as alone:
        own = alone.generate(Request(PROMPT, 8, prompt_logprobs=2)).prompt_logprobs
    store.create("s6", PROMPT, SamplingParams(), None, max_new_tokens=8)
    for i, tok in enumerate(ref[:3]):
        store.commit_many([Verdict("s6", i, len(PROMPT) + i, 0, tok)])
    ticket = admission.admit(GenerationRequest(resume_session_id="s6", prompt_logprobs=2))
    sched._admit()
    while not ticket.ended:
        engine.step()
    assert ticket.prompt_logprobs == own and len(own) == len(PROMPT) - 1
    assert ticket.result.token_ids == ref


def test_a_re_created_prompt_alone_is_scored_again(verifier_parts, looping):
    """A prompt scored alone whose session the cache lost is re-created (the SDK's request
    again, holding no output) and run: its prompt scored as before, no output; not answered
    at once as a session whose client holds its whole output."""
    store, engine, sched, admission = verifier_parts
    with SpecEngine(engine.target, None, EngineConfig(), stop_ids=set()) as alone:
        own = alone.generate(Request(PROMPT, 0, prompt_logprobs=2)).prompt_logprobs
    ticket = admission.admit(GenerationRequest(prompt_ids=PROMPT, prompt_only=True,
                                               prompt_logprobs=2, lost_session_id="ab" * 16))
    sched._admit()
    while not ticket.ended:
        engine.step()
    assert ticket.prompt_logprobs == own and len(own) == len(PROMPT) - 1
    assert (ticket.result.token_ids, ticket.result.finish_reason) == ([], "length")


def test_a_finished_prompt_alone_asked_for_its_scores_is_re_created(verifier_parts):
    """A prompt alone that ended before its stream had its scores (the cache keeps none, and
    they are its whole output): its resume is answered as a session the cache lost, so that
    the SDK re-creates it and it is scored again; a resume that asks for no scores gets the
    ended session."""
    import pytest

    from verifier_node.admission import SessionNotFound

    store, engine, sched, admission = verifier_parts
    act = engine.add(Request(PROMPT, 0, prompt_logprobs=2), session_id="s9")
    while act.finish is None:
        engine.step()
    assert store.load("s9").finish_reason == "length"
    with pytest.raises(SessionNotFound, match="send the request again"):
        admission.admit(GenerationRequest(resume_session_id="s9", prompt_logprobs=2))
    ended = admission.admit(GenerationRequest(resume_session_id="s9"))
    assert ended.ended and (ended.result.token_ids, ended.result.finish_reason) == ([], "length")


def test_a_record_without_an_output_limit_is_not_resumed_as_a_prompt_alone(verifier_parts):
    """A record whose max_new_tokens is 0 (one older than the limits, or a prompt alone that
    never ended) has no output a resume could continue: answered as a session the cache lost
    (the SDK then re-creates it from its own request), not run as a prompt scored alone that
    ends at once."""
    import pytest

    from verifier_node.admission import SessionNotFound

    store, engine, sched, admission = verifier_parts
    store.create("s7", PROMPT, SamplingParams(), None, max_new_tokens=0)
    with pytest.raises(SessionNotFound, match="send the request again"):
        admission.admit(GenerationRequest(resume_session_id="s7"))
    assert not engine.sessions


def test_a_re_created_session_longer_than_the_context_is_refused_before_any_work(
        verifier_parts):
    """``committed_ids`` past the context limit (found by a hostile client's probe: three
    million of them, with max_new_tokens 1, were answered as a whole output after seconds of
    copies and scans each, 2.5 GB across 12 callers) are refused at once, as a prompt is."""
    import pytest

    from edgespec.config import ConfigError

    store, engine, sched, admission = verifier_parts
    limit = engine.target.max_len
    committed = [10] * (limit - len(PROMPT) + 1)
    with pytest.raises(ConfigError, match="exceed the context limit"):
        admission.admit(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=1,
                                          committed=committed, lost_session_id="ab" * 16))
    # the most that fits: answered as a session whose client holds its whole output
    held = admission.admit(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=len(committed) - 1,
                                             committed=committed[1:], lost_session_id="ab" * 16))
    assert held.ended and held.result.finish_reason == "length"
