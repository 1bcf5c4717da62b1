"""Turning a generation request into a running ticket, whatever transport it came by.

Both front doors of the verifier, the gRPC ``Verifier`` service and the OpenAI-compatible HTTP
API, describe a request as a ``GenerationRequest`` and go through ``Admission``: the prompt is
checked and tokenized (a prompt that cannot fit is refused before the tokenizer spends seconds
on it), a drafter is picked, and the ticket is queued; or, with ``resume_session_id``, the
session is found running here or re-admitted from what the cache holds (a session with images
only while it runs here: the cache keeps no images, so elsewhere it is answered as lost, and the
SDK re-creates it with its images). ``follow`` counts a reader of a ticket and cancels the
session when its last reader goes away."""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field

from edgespec.config import ConfigError, EmptyPrompt, SamplingParams, is_lossy
from edgespec.engine.session_lifecycle import output_room
from edgespec.engine.spec_engine import Request, Result
from edgespec.protocol.ids import check_device_id, check_session_id, shown
from edgespec.protocol.lineage import Lineage, checked_lineage, continued_on
from edgespec.protocol.request_stats import Stats
from edgespec.models.images import ImageRefused, decode_images
from edgespec.models.loading import encode_prompt
from edgespec.models.vision import ImageInput
from edgespec.verify.keyed_noise import with_session_seed

from .scheduler import Scheduler
from .tickets import QueueFull, Ticket

log = logging.getLogger("edgespec.verifier")

# A prompt longer than this many characters per context token cannot fit: refused before the
# tokenizer spends seconds on it.
MAX_CHARS_PER_TOKEN = 64
VISION_ENCODES = 2  # prompts with images encoded at once (``Admission``)


@dataclass
class GenerationRequest:
    """Exactly one of ``prompt`` (one user message through the chat template, or as is with
    ``raw``; "" is a prompt), ``messages`` and ``prompt_ids`` (``[]`` is a prompt, of zero
    tokens); or ``resume_session_id`` alone. None: not given."""

    prompt: str | None = None
    raw: bool = False
    messages: list[dict] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    max_new_tokens: int = 0  # 0: the server's default
    params: SamplingParams = field(default_factory=SamplingParams)
    device_id: str = ""
    resume_session_id: str = ""
    verify: str = ""  # "" (the verifier's mode), "exact", "loose" or "pad" (lossy; opt-in)
    # re-creating a session the cache lost: the output the client already has (the session
    # continues after it) and the id it held (a pinned drafter that is gone is then passed over)
    committed: list[int] = field(default_factory=list)
    lost_session_id: str = ""
    # encoded image files for a vision-language target, in the order of the text's <image>
    # marks (without marks: before the text); refused by a text-only target and with prompt_ids
    images: list[bytes] = field(default_factory=list)
    # with ``committed``: the kernel set fingerprint whose decoding those tokens are, and the
    # position from which another set decoded them (0: none), as the first stream reported them
    kernel_set: str = ""
    kernels_differ_from: int = 0
    # each emitted token's logprob under the target, with this many alternatives (0-20); None:
    # none (``edgespec.verify.token_logprobs``)
    logprobs: int | None = None
    # the prompt's logprobs (each token's after the first) with this many alternatives; None:
    # none (``Request.prompt_logprobs``)
    prompt_logprobs: int | None = None
    # no new tokens: the prompt prefilled alone (scored with ``prompt_logprobs``) and the
    # session ended (the completions' ``echo`` with ``max_tokens`` 0); ``max_new_tokens`` unread
    prompt_only: bool = False
    # the prompt as ``Admission.prompt_ids`` gives it, already (a request's n choices: their
    # prompt encoded and its images decoded once); None: encoded at admission
    encoded: tuple[list[int], ImageInput | None] | None = None


class SessionNotFound(Exception):
    pass


class DrafterMissing(Exception):
    """A pinned drafter that is not attached."""


class Admission:
    def __init__(self, scheduler: Scheduler, store, tokenizer, vocab_size: int,
                 default_max_new_tokens: int = 128):
        self.scheduler, self.store, self.tokenizer = scheduler, store, tokenizer
        self.vocab_size = vocab_size
        self.default_max_new = default_max_new_tokens
        self.max_len = scheduler.engine.target.max_len
        self.vision = scheduler.engine.vision  # a vision-language target's VLM, else None
        self.kernels = scheduler.engine.target.kernel_set.fingerprint
        # prompts with images encoded at once, at most: their decoding and the processor's
        # work, not every worker thread's (eight requests at the image limits held 9 GB)
        self._vision_encodes = threading.BoundedSemaphore(VISION_ENCODES)

    def prompt_ids(self, g: GenerationRequest) -> tuple[list[int], ImageInput | None]:
        """The request's prompt as token ids, with its images as the vision encoder takes them
        (None without images); one of zero tokens is refused (EmptyPrompt), an empty message
        through the chat template is not zero tokens."""
        if g.encoded is not None:  # encoded once for several sessions: each its own list
            return list(g.encoded[0]), g.encoded[1]
        ids, images = self._encode(g)
        if not ids:
            raise EmptyPrompt()
        return ids, images

    def _encode(self, g: GenerationRequest) -> tuple[list[int], ImageInput | None]:
        given = [g.prompt is not None, bool(g.messages), g.prompt_ids is not None]
        if sum(given) != 1:
            raise ConfigError("give exactly one of prompt, messages, prompt_ids")
        if g.images and self.vision is None:
            raise ImageRefused("this model is text-only: it takes no images (serve a "
                               "vision-language model, SmolVLM say, for images)")
        if g.images and g.prompt_ids is not None:
            raise ImageRefused("images go with a prompt or messages, not prompt token ids (the "
                               "processor places their tokens)")
        if g.prompt_ids is not None:
            if len(g.prompt_ids) > self.max_len:
                raise ConfigError(f"the prompt ({len(g.prompt_ids)} tokens) exceeds the "
                                  f"context limit ({self.max_len})")
            if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in g.prompt_ids):
                raise ConfigError(f"prompt token ids must be integers in [0, {self.vocab_size})")
            return list(g.prompt_ids), None
        chars = len(g.prompt or "") + sum(len(str(m.get("content", "")))
                                          + len(str(m.get("role", ""))) for m in g.messages)
        if chars > MAX_CHARS_PER_TOKEN * self.max_len:
            raise ConfigError(f"the prompt ({chars} characters) exceeds the context limit "
                              f"({self.max_len} tokens)")
        try:
            if self.vision is not None:  # through the processor: image marks expanded
                with self._vision_encodes:  # each up to ~0.5 GB and a second of CPU
                    pictures = decode_images(g.images)
                    if g.messages:
                        return self.vision.encode(messages=g.messages, images=pictures)
                    return self.vision.encode(g.prompt or "", raw=g.raw, images=pictures)
            if g.messages:
                return encode_prompt(self.tokenizer, messages=g.messages), None
            return encode_prompt(self.tokenizer, g.prompt or "", raw=g.raw), None
        except ConfigError:
            raise
        except Exception as e:  # the chat template refused the conversation (turns out of order)
            raise ConfigError(f"the prompt cannot be encoded: {str(e)[:200]}") from None

    def checked_prompt(self, g: GenerationRequest) -> list[int]:
        """``g``'s prompt as token ids, once the checks a new session's admission makes pass
        (its tokens, the context limit with its output's room, its settings): a completions
        batch's prompts are checked so before any of them is admitted. Raises ConfigError."""
        ids, images = self.prompt_ids(g)
        self.scheduler.engine.validate(self._request(g, ids, images))
        return ids

    def _request(self, g: GenerationRequest, ids: list[int], images) -> Request:
        """The engine's request for a new session of ``g`` (its prompt as ``ids``)."""
        new = 0 if g.prompt_only else g.max_new_tokens or self._default_max_new(len(ids))
        return Request(ids, new, g.params,
                       committed=list(g.committed), verify=g.verify, images=images,
                       logprobs=g.logprobs, prompt_logprobs=g.prompt_logprobs)

    def admit(self, g: GenerationRequest, deadline_s: float | None = None) -> Ticket:
        """A queued (or running, or already finished) ticket. Raises ConfigError, SessionNotFound,
        DrafterMissing, or the scheduler's QueueFull (TooSlowForDeadline: a new session the
        measured pace would not finish within ``deadline_s``) / ShuttingDown. A resumed or
        re-created session is never refused for its deadline: it already counts."""
        resumed = bool(g.resume_session_id or g.lost_session_id)  # already counted
        ticket = self._resume_ticket(g) if g.resume_session_id else self._new_ticket(g)
        if ticket.ended:
            return ticket
        if not ticket.submitted:  # new here, not the running ticket a resume found: pinned
            # where its device_id took (the SDK's resume names it again)
            ticket.pinned = bool(g.device_id) and ticket.device == g.device_id
        got: Ticket | None = None  # stays None if the scheduler refuses it
        try:
            got = self.scheduler.submit(ticket, None if resumed else deadline_s)
            if got is ticket and ticket.kernels_switched:  # admitted: said once (a resume of
                ticket.kernels_switched = False  # the running ticket is the same one)
                self._say_switched(ticket)
            return got
        finally:
            if got is not ticket and ticket.release_pick is not None:  # refused, or running
                ticket.release_pick()
                ticket.release_pick = None

    def _ticket(self, request: Request, device: str | None, **kw) -> Ticket:
        if device is None and request.max_new_tokens > 0:  # a prompt alone drafts nothing
            picked = self.store.devices.pick()
            release = (lambda: self.store.devices.release(picked)) if picked else None
            return Ticket(request, picked, release_pick=release, **kw)
        return Ticket(request, device, **kw)

    def _new_ticket(self, g: GenerationRequest) -> Ticket:
        if g.images and g.encoded is None and self.scheduler.room() < 1:
            # refused before its images are decoded (asked again when it is queued)
            raise QueueFull(f"{self.scheduler.capacity} sessions are running and waiting (its "
                            "images were not decoded)")
        ids, images = self.prompt_ids(g)
        if g.max_new_tokens < 0:
            raise ConfigError("max_new_tokens must be >= 0 (0: the server's default)")
        device = check_device_id(g.device_id) if g.device_id else None
        lost = check_session_id(g.lost_session_id) if g.lost_session_id else ""
        if g.prompt_only:  # a prompt alone drafts nothing: a pinned drafter is not asked
            device = None
        if device and not self.store.devices.is_alive(device):
            if not lost:
                raise DrafterMissing(f"drafter {device!r} is not attached")
            device = None  # a re-created session, like a resumed one, goes on without it
        # the seed is chosen here, not at prefill, so that the first response can report it
        request = self._request(g, ids, images)
        request.params = with_session_seed(g.params)
        if lost:
            if len(ids) + len(g.committed) > self.max_len:  # before any work on them (a
                # client holding its whole output is answered without the engine's checks)
                raise ConfigError(f"the prompt ({len(ids)} tokens) and committed_ids "
                                  f"({len(g.committed)}) exceed the context limit "
                                  f"({self.max_len})")
            if g.max_new_tokens and len(g.committed) > g.max_new_tokens:
                raise ConfigError(f"committed_ids ({len(g.committed)}) are more than the "
                                  f"max_new_tokens ({g.max_new_tokens}) of the session they "
                                  f"re-create")
            try:
                held = checked_lineage(g.kernel_set, g.kernels_differ_from, len(g.committed))
            except ValueError as e:
                raise ConfigError(str(e)) from None
            stops = self.scheduler.engine.stop_ids
            early = next((i for i, t in enumerate(g.committed[:-1]) if t in stops), None)
            if early is not None:  # the output it re-creates ended there: no session does so
                raise ConfigError(f"committed_ids hold a stop token at {early}, before their "
                                  f"end: the session they re-create ended there")
            log.info("re-creating session %s (lost by the cache) from %d tokens the client "
                     "holds", shown(lost), len(g.committed))
            request.lineage = held  # a client holding its whole output: nothing decoded here
            done = self._already_done(request)
            if done is not None:
                return done
            request.lineage, switched = self._continued(held, len(g.committed))
            return self._ticket(request, device, kernels_switched=switched)
        return self._ticket(request, device)

    def _default_max_new(self, prompt_len: int) -> int:
        """A request that sets no limit gets the server's default, cut to the room its prompt
        leaves in a KV slot (as OpenAI's default is the context left): a long prompt is served,
        not refused for a limit its client never asked for."""
        room = output_room(self.max_len, prompt_len, self.scheduler.engine.cfg.max_draft)
        return max(1, min(self.default_max_new, room))  # none left: refused, saying why

    def _already_done(self, request: Request) -> Ticket | None:
        """A re-created session whose client already holds its whole output (only the last
        response was lost): a finished ticket, nothing to generate. A prompt alone has no
        output to hold: it is run again (its prompt scored when asked)."""
        out = request.committed
        if request.max_new_tokens == 0:
            return None
        if len(out) >= request.max_new_tokens:
            reason = "length"
        elif out and out[-1] in self.scheduler.engine.stop_ids:
            reason = "stop"
        else:
            return None
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in out):
            raise ConfigError(f"committed token ids must be integers in [0, {self.vocab_size})")
        done = Ticket(request, None)
        mode = request.verify or self.scheduler.engine.cfg.verify
        done.finish(Result(out, Stats(lossy=is_lossy(mode), verify=mode), reason))
        return done

    def _resume_ticket(self, g: GenerationRequest) -> Ticket:
        sid = check_session_id(g.resume_session_id)
        if g.prompt is not None or g.messages or g.prompt_ids or g.committed or g.images:
            raise ConfigError("a resumed session takes its prompt and output from the cache: "
                              "send none")
        running = self.scheduler.ticket(sid)
        if running is not None:
            return running
        rec = self.store.load(sid)
        if rec is None:
            raise SessionNotFound(f"no session {shown(sid)} in the cache (it finished long ago or "
                           "expired)")
        if rec.max_new_tokens < 1 and (rec.finish_reason not in ("stop", "length")
                                       or g.prompt_logprobs is not None):
            # a record that says no output limit (one older than the limits), a prompt alone
            # that did not end, or one that ended whose scores are asked (the cache keeps
            # none, and they are its whole output): nothing a resume can give, so answered as
            # a session the cache lost (the SDK re-creates it from its own request: a prompt
            # alone prefilled and scored again)
            raise SessionNotFound(f"session {shown(sid)} cannot be resumed from its record (it "
                                  "keeps no output limit or scores): send the request again "
                                  "(the SDK re-creates it)")
        # a resumed session keeps its verification mode: a lossy one is refused by a verifier
        # not started in that mode (validate), an exact one stays exact on a lossy verifier
        request = Request(rec.prompt, rec.max_new_tokens, rec.params, committed=rec.committed,
                          verify=rec.verify, lineage=rec.lineage, logprobs=g.logprobs,
                          prompt_logprobs=g.prompt_logprobs)
        if rec.finish_reason in ("stop", "length"):
            done = Ticket(request, rec.device, session_id=sid)
            mode = rec.verify or "exact"
            done.finish(Result(rec.committed, Stats(tokens=len(rec.committed),
                                                    lossy=is_lossy(mode), verify=mode),
                               rec.finish_reason))
            return done
        if self.vision is not None and self.vision.image_token_id in rec.prompt:
            # the cache keeps token ids, not images: answered as a session the cache lost, so
            # that the SDK re-creates it with the images it holds (and the tokens it received)
            raise SessionNotFound(f"session {shown(sid)} has images, which the cache does not "
                                  "keep: send the request again with its images (the SDK "
                                  "re-creates it)")
        device = rec.device if rec.device and self.store.devices.is_alive(rec.device) else None
        request.lineage, switched = self._continued(rec.lineage, len(rec.committed))
        return self._ticket(request, device, session_id=sid, kernels_switched=switched)

    def _continued(self, lineage: Lineage | None, committed: int) -> tuple[Lineage, bool]:
        """The lineage of a session continuing here after ``committed`` output tokens, and
        whether it changes kernel sets here (said once it is admitted: ``_say_switched``)."""
        out = continued_on(lineage, self.kernels, committed)
        return out, out.mixed and (lineage is None or not lineage.mixed)

    def _say_switched(self, ticket: Ticket) -> None:
        """Another kernel set's decoding is not continued silently: logged and counted."""
        lineage = ticket.request.lineage
        assert lineage is not None
        log.warning("session %s continues on kernel set %s after %d tokens decoded on %s: its "
                    "output differs from target-only decoding on either from there",
                    shown(ticket.session_id), self.kernels, lineage.differs_from,
                    lineage.kernels)
        if self.scheduler.metrics is not None:
            self.scheduler.metrics.kernels_switched.inc()

    @contextlib.contextmanager
    def follow(self, ticket: Ticket):
        """Count a reader of ``ticket`` for the block; when the last reader leaves before the
        session ended (a client that gave up), the session is cancelled, freeing its slot."""
        with ticket.cond:
            ticket.followers += 1
            ticket.claims = max(0, ticket.claims - 1)  # a resume's claim, taken up
        try:
            yield ticket
        finally:
            with ticket.cond:
                ticket.followers -= 1
                orphaned = ticket.followers == 0 and ticket.claims == 0 and not ticket.ended
            if orphaned:
                self.scheduler.cancel(ticket.session_id, orphaned=True)
