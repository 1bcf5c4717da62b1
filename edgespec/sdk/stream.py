"""A call's streams: ``Resumer`` keeps what resuming a broken stream needs (its session, the
tokens received, the kernel sets they were decoded on) and ``Collector`` puts the responses of
its streams together into ``StreamPiece``s and a ``GenerateResult``."""

from __future__ import annotations

import difflib
import inspect
import time
from dataclasses import dataclass, field

import grpc

from ..protocol.lineage import Lineage, joined
from ..v1 import edgespec_pb2 as pb
from ..protocol.token_logprob import TokenLogprob
from ..wire.convert import REFUSAL_METADATA, logprobs_from_pb, stats_from_pb, trailing_value
from .errors import (DeadlineExceeded, EdgespecError, NotFound, PreconditionFailed, Unavailable,
                     translate)
from .request import build_request, check_timeout

# what a generation call takes besides its timeout: ``build_request``'s parameters
REQUEST_OPTIONS = frozenset(inspect.signature(build_request).parameters)

__all__ = ["RESUMABLE", "Collector", "GenerateResult", "Resumer", "StreamPiece"]


@dataclass
class StreamPiece:
    """Tokens committed since the previous piece, and their text. The last piece of a stream
    has no tokens and carries ``finish_reason`` and ``stats`` (and the text an output that
    ends in the middle of a character held back)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: dict | None = None
    kernel_set: str = ""  # on the last piece: as ``GenerateResult``'s
    kernels_differ_from: int = 0
    # with ``logprobs=``: the tokens' logprobs, one a token (None for a token whose logprob the
    # verifier did not keep: a resumed stream's, committed before the break but not received);
    # None otherwise
    logprobs: list[TokenLogprob | None] | None = None
    # with ``prompt_logprobs=``: on the piece with the first tokens, the prompt's (as
    # ``GenerateResult``'s); None on every other piece
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerateResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    session_id: str
    device_id: str
    prompt_tokens: int
    stats: dict = field(default_factory=dict)
    resumed: int = 0  # how many times the stream was resumed after a break
    seed: int | None = None  # the session's sampling seed (the verifier's choice if none given)
    # the verifier's kernel set fingerprint (what the output is target-only decoding on) and,
    # when > 0, the output position from which another kernel set decoded it (the stream was
    # resumed on a replica with other kernels; see docs/failure-model.md)
    kernel_set: str = ""
    kernels_differ_from: int = 0
    # with ``logprobs=``: each token's logprob (``TokenLogprob``: the token, its logprob under the
    # target, the alternatives asked for), in order (None for a token whose logprob the verifier
    # did not keep: see ``StreamPiece``); None otherwise
    logprobs: list[TokenLogprob | None] | None = None
    # with ``prompt_logprobs=``: each prompt token's logprob after the first, given the tokens
    # before it, with the alternatives asked for (the first token has none: nothing precedes
    # it); None when not asked, when the session ended before its prompt was in (cancelled),
    # and when a stream that broke before it had them was resumed only after the session ended
    # or on a verifier that predates them
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def lossless(self) -> bool:
        """False when the session was verified loosely: the text may differ from the target's."""
        return self.stats.get("lossless", True)


class Resumer:
    """Keeps what a stream needs to be resumed: its session id and how many tokens arrived.

    A stream that breaks with UNAVAILABLE (the verifier died or restarted, it drained, the link
    dropped) is resumed by session id, up to ``max_resumes`` times within the call's deadline;
    the verifier sends only the tokens after those already received, so the caller sees one
    unbroken stream. Before a session id is known, nothing was admitted: the request is sent
    again as it was. A resume answered NOT_FOUND (the cache lost the session: a Redis without
    persistence restarted with the verifier) re-creates the session: the request again, with
    the tokens received as ``committed_ids`` and the seed the verifier reported."""

    def __init__(self, req: pb.GenerateRequest, timeout: float | None, max_resumes: int):
        self.req, self.max_resumes = req, max_resumes
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.session_id: str | None = None
        self.tokens: list[int] = []  # every output token received
        self.seed: int | None = req.sampling.seed if req.sampling.has_seed else None
        self.resumes = 0
        self.last_error: str | None = None  # the last refusal or break, for a deadline's words
        self.recreating = False  # the cache lost the session: send the request again
        self._first = True  # the next response is a stream's first
        self.lineage: Lineage | None = None  # the kernel sets the output was decoded on
        # with ``prompt_logprobs=``: the prompt's, once their pieces came whole; the pieces of
        # the current stream so far; the prompt's length (its first response's)
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self._prompt_pieces: list[TokenLogprob] = []
        self._prompt_tokens = 0
        self._new_session = False  # the current stream's first response: a new session

    @classmethod
    def of_call(cls, client, timeout: float | None, **kw) -> "Resumer":
        """A call's resumer, with ``client``'s defaults (its timeout, its resumes). An option
        the call does not have is a TypeError naming it (and the option it may have meant), not
        one naming the SDK's internal ``build_request``."""
        unknown = sorted(set(kw) - REQUEST_OPTIONS)
        if unknown:
            near = difflib.get_close_matches(unknown[0], sorted(REQUEST_OPTIONS | {"timeout"}), 1)
            raise TypeError(f"unexpected keyword argument {unknown[0]!r} for a generation"
                            + (f" (did you mean {near[0]!r}?)" if near else
                               f"; its options: {', '.join(sorted(REQUEST_OPTIONS))}, timeout"))
        return cls(build_request(**kw), check_timeout(timeout) or client.timeout,
                   client.max_resumes)

    @property
    def received(self) -> int:
        return len(self.tokens)

    def next_request(self) -> pb.GenerateRequest:
        self._first = True
        if self.session_id is None:
            return self.req
        if self.recreating:
            return self.recreate_request()
        resume = pb.GenerateRequest(resume_session_id=self.session_id,
                                    resume_from=self.received)
        if self.req.device_id:  # pinned to its board: not handed to another after the break
            resume.device_id = self.req.device_id
        if self.req.HasField("logprobs"):  # the tokens after the break get theirs
            resume.logprobs = self.req.logprobs
        if self.wants_prompt_logprobs:  # not had yet: the verifier prefilling it scores them
            resume.prompt_logprobs = self.req.prompt_logprobs
        return self._with_lineage(resume)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """The call asked for the prompt's logprobs and no response has carried them yet."""
        return self.req.HasField("prompt_logprobs") and self.prompt_logprobs is None

    def _with_lineage(self, req: pb.GenerateRequest) -> pb.GenerateRequest:
        """``req`` with the kernel sets the output so far was decoded on (a router prefers a
        replica of the same set; a re-created session carries them on)."""
        if self.lineage is not None:
            req.kernel_set = self.lineage.kernels
            req.kernels_differ_from = self.lineage.differs_from
        return req

    def recreate_request(self) -> pb.GenerateRequest:
        req = pb.GenerateRequest()
        req.CopyFrom(self.req)
        req.committed_ids.extend(self.tokens)
        req.lost_session_id = self.session_id or ""
        if not self.wants_prompt_logprobs:
            req.ClearField("prompt_logprobs")
        if self.seed is not None:
            req.sampling.has_seed, req.sampling.seed = True, self.seed
        return self._with_lineage(req)

    def time_left(self) -> float | None:
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            if self.session_id is None:
                why = "before the verifier took the request"
            elif self.resumes:
                why = f"while resuming session {self.session_id}"
            else:
                why = f"during session {self.session_id}"
            last = f" (last answer: {self.last_error})" if self.last_error else ""
            raise DeadlineExceeded(f"DEADLINE_EXCEEDED: the deadline passed {why}{last}",
                                   grpc.StatusCode.DEADLINE_EXCEEDED)
        return left

    def server_gone(self, why: str) -> Unavailable:
        """The error of a resume that gave up waiting for its server (``why``: what was seen)."""
        return Unavailable(f"UNAVAILABLE: {why}, resuming session {self.session_id} (last "
                           f"answer: {self.last_error})")

    def seen(self, r: pb.GenerateResponse) -> None:
        if self._first:
            self._first = False
            if self.recreating and not r.resumed:  # a verifier that predates re-creation
                raise NotFound(f"NOT_FOUND: the verifier lost session {self.session_id} and "
                               "cannot re-create it", grpc.StatusCode.NOT_FOUND)
            self.recreating = False
            self._new_session = not r.resumed
            self._prompt_pieces = []  # a piece of a broken stream's is sent again whole
            if adjusts(self.req.sampling) and not adjusts(r.sampling):
                raise PreconditionFailed(
                    "FAILED_PRECONDITION: the verifier decodes without presence_penalty, "
                    "frequency_penalty and logit_bias (it predates them): upgrade it, or leave "
                    "them out", grpc.StatusCode.FAILED_PRECONDITION)
            if r.sampling.has_seed:
                self.seed = r.sampling.seed
            if r.kernel_set:
                self.lineage = joined(self.lineage, Lineage(r.kernel_set, r.kernels_differ_from),
                                      self.received)
        if r.session_id:
            self.session_id = r.session_id
        if r.prompt_tokens:
            self._prompt_tokens = r.prompt_tokens
        if r.HasField("prompt_logprobs"):
            self._prompt_piece(r.prompt_logprobs)
        elif r.token_ids and self.wants_prompt_logprobs and self._new_session:
            # a new session's pieces all come before its first tokens: a verifier that sends
            # none predates them (proto3 drops the field it does not know)
            raise PreconditionFailed(
                "FAILED_PRECONDITION: the verifier does not score prompts (it predates "
                "prompt_logprobs): upgrade it, or leave them out",
                grpc.StatusCode.FAILED_PRECONDITION)
        if r.token_ids and self.req.prompt_only:  # (the stream's end cancels its session)
            raise PreconditionFailed(
                "FAILED_PRECONDITION: the verifier generates where prompt_only asked for no "
                "output (it predates prompt_only): upgrade it", grpc.StatusCode.FAILED_PRECONDITION)
        self.tokens.extend(r.token_ids)

    def _prompt_piece(self, piece: pb.PromptLogprobs) -> None:
        """A piece of the prompt's logprobs: the next of this stream's, in order; whole once
        they hold every prompt token's after the first (kept: a later stream's are not read)."""
        if self.prompt_logprobs is not None or piece.start != len(self._prompt_pieces):
            return
        self._prompt_pieces.extend(logprobs_from_pb(piece.entries))
        if len(self._prompt_pieces) >= self._prompt_tokens - 1:
            self.prompt_logprobs, self._prompt_pieces = self._prompt_pieces, []

    def retry_after(self, e: grpc.RpcError) -> float:
        """Seconds to wait before resuming; raises the error (as an EdgespecError) to give up.
        A new session refused by a draining verifier fails at once: it would be refused until
        that verifier has stopped."""
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self.deadline is not None:
            self.deadline = min(self.deadline, time.monotonic())  # gRPC's word: it has passed
            self.time_left()  # raises it in words: where it passed, the last answer before it
        self.last_error = f"{e.code().name}: {e.details()}"
        if self.session_id is None and trailing_value(e, REFUSAL_METADATA) == "draining":
            raise Unavailable(f"UNAVAILABLE: {e.details()}", e.code()) from None
        resumable = e.code() in RESUMABLE or (  # a resume that found the server full
            self.session_id is not None and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)
        lost = (self.session_id is not None and not self.recreating
                and e.code() == grpc.StatusCode.NOT_FOUND)  # a resume the cache cannot serve
        if not (resumable or lost) or self.resumes >= self.max_resumes:
            raise translate(e) from None
        self.resumes += 1
        if lost:
            self.recreating = True
            return 0.0
        wait = min(2.0, 0.1 * 2 ** self.resumes)
        left = self.time_left()  # raises DeadlineExceeded once the deadline has passed
        return wait if left is None else min(wait, left)


RESUMABLE = {grpc.StatusCode.UNAVAILABLE}


def adjusts(sampling: pb.SamplingParams) -> bool:
    """Whether sampling settings on the wire move the logits (penalties, a logit bias): a
    verifier's echo of a request that asked for them without them is one that predates them
    (proto3 drops fields a reader does not know)."""
    return bool(sampling.presence_penalty or sampling.frequency_penalty or sampling.logit_bias)


class Collector:
    """A call's output, put together from the responses of its streams (``res``: their
    resumer, which knows the resumes and the kernel sets)."""

    def __init__(self, res: Resumer):
        self.res = res
        self.text: list[str] = []
        self.ids: list[int] = []
        self.meta = pb.GenerateResponse()
        self.final: pb.GenerateResponse | None = None
        self.seed: int | None = None
        self.logprobs: list[TokenLogprob | None] | None = [] if res.req.HasField("logprobs") \
            else None
        self.prompt_sent = False  # the prompt's logprobs given on a piece

    def add(self, r: pb.GenerateResponse) -> StreamPiece | None:
        if r.device_id or r.prompt_tokens:
            self.meta = r
        if r.sampling.has_seed:
            self.seed = r.sampling.seed
        if r.finished:
            self.final = r
            self.text.append(r.text)  # what was held back of an output ending mid-character
            lineage = self.res.lineage or Lineage()
            return StreamPiece([], r.text, r.finish_reason, stats_from_pb(r.stats),
                               lineage.kernels, lineage.differs_from,
                               prompt_logprobs=self._prompt_logprobs_of())
        if r.token_ids:
            self.ids.extend(r.token_ids)
            self.text.append(r.text)
            prompt = self._prompt_logprobs_of()
            if self.logprobs is None:
                return StreamPiece(list(r.token_ids), r.text, prompt_logprobs=prompt)
            # a resumed stream's tokens that the verifier holds no logprobs for (committed before
            # the break, not received then) come in a response of their own: None each
            shown: list[TokenLogprob | None] = [None] * (len(r.token_ids) - len(r.logprobs))
            shown.extend(logprobs_from_pb(r.logprobs))
            self.logprobs.extend(shown)
            return StreamPiece(list(r.token_ids), r.text, logprobs=shown, prompt_logprobs=prompt)
        return None

    def _prompt_logprobs_of(self) -> list[TokenLogprob] | None:
        """The prompt's logprobs, for the first piece made since a response carried them."""
        if not self.prompt_sent and self.res.prompt_logprobs is not None:
            self.prompt_sent = True
            return self.res.prompt_logprobs
        return None

    def result(self) -> GenerateResult:
        if self.final is None:
            raise EdgespecError("the stream ended without a final response")
        lineage = self.res.lineage or Lineage()
        return GenerateResult("".join(self.text), self.ids, self.final.finish_reason,
                              self.final.session_id, self.meta.device_id,
                              self.meta.prompt_tokens, stats_from_pb(self.final.stats),
                              self.res.resumes, self.seed, lineage.kernels,
                              lineage.differs_from, self.logprobs, self.res.prompt_logprobs)
