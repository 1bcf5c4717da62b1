"""A session's life in the engine, apart from its steps: validated, admitted (a KV slot, the
store's record, the prefill queue), started once its prompt is in, and ended (finished,
cancelled, failed, or abandoned when the verifier stops). ``SessionLifecycle`` is a part of
``SpecEngine`` (the base of its commit stage, ``StepCommit``): it reads the engine's target,
store, in-process drafter, head and session lists, which the engine sets up."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..config import ConfigError, EngineConfig, is_lossy, session_verify_mode
from ..drafters import DraftLength
from ..drafters.draft_rates import DraftRates
from ..protocol.contract import (SessionStore, StoreUnavailable, is_token_id,
                                 plain_ids_in_range)
from ..protocol.lineage import Lineage
from ..runner.host_transfers import DeviceSpan
from ..runner.target_runner import TargetRunner
from ..verify.keyed_noise import with_session_seed
from ..protocol.token_logprob import check_top_logprobs
from .generation import ActiveSession, Admission, Request, Result, SessionFailed
from .prefill_queue import PrefillQueue
from .scoring import SCORED_CHUNK, PromptScorer
from .stack_choice import StackChooser

log = logging.getLogger("edgespec.engine.spec_engine")


def output_room(max_len: int, prompt_len: int, max_draft: int) -> int:
    """The most tokens a session of ``prompt_len`` prompt tokens may ask for in a KV slot of
    ``max_len``: a step writes the session's last token and up to ``max_draft`` draft tokens
    past its output, so that much of the slot stays free however far the output has come (a
    step's rows are all as wide as its widest)."""
    return max_len - prompt_len - max_draft - 1


def prefill_ids(req: Request) -> list[int]:
    """The tokens a session's prefill writes: its prompt and committed tokens but the last
    (the first step's own)."""
    return (req.prompt_ids + req.committed)[:-1]


def check_id_kinds(req: Request, vocab: int) -> None:
    """A request's prompt and committed ids, id by id (``plain_ids_in_range`` said no): each
    a token id (``contract.is_token_id``: an integer in [0, vocab)), else ConfigError naming
    the part that holds it (a re-created session's output is the client's); integers of other
    kinds (NumPy's) made plain ints here, so that no later part (a drafter copying the prompt,
    an output) holds another kind."""
    for part, what in ((req.prompt_ids, "prompt"), (req.committed, "committed (output)")):
        for t in part:
            if not is_token_id(t, vocab):
                raise ConfigError(f"{what} token ids must be in [0, {vocab}), integers, got "
                                  f"{type(t).__name__} {str(t)[:20]!r}")
    req.prompt_ids = [int(t) for t in req.prompt_ids]
    req.committed = [int(t) for t in req.committed]


class SessionLifecycle:
    """Admission and ending of the engine's sessions (``SpecEngine`` sets these up)."""

    target: TargetRunner
    cfg: EngineConfig
    store: SessionStore
    vision: Any  # a ``VisionModel`` or None
    drafter: Any  # the in-process ``Drafter`` (its thread's or inline) or None
    head: Any  # a ``VerifierHead`` or None
    fill: Any  # ``FillDrafts`` (the verifier's own drafts for boards' empty ones) or None
    active: list[ActiveSession]  # running: verified every step
    prefilling: PrefillQueue  # admitted, waiting for their prompts' prefill
    on_prefill: Callable[[int, float], None] | None
    prefill_s: float  # this step's prefill, as the device took it (``_settle_prefill``)
    # prefills whose device seconds are not read yet: (tokens, span), on CUDA until a wait
    _unwaited_prefill: list[tuple[int, DeviceSpan]]
    rates: DraftRates  # the sessions' draft-length state, a row a KV slot
    _ids: itertools.count
    # this step's verification forwards that ran, and its forwards (prefill included) that
    # raised (``SpecEngine.faulted``)
    _forwards_ok: int
    _forwards_failed: int

    def validate(self, req: Request) -> str:
        """Refuse a request that cannot be served, before any work; returns the session's
        verification mode ("exact" or "loose")."""
        n = len(req.prompt_ids)
        if n == 0:
            raise ConfigError("the prompt is empty")
        if req.max_new_tokens < 0 or (req.max_new_tokens == 0 and req.committed):
            raise ConfigError(f"max_new_tokens must be >= 1 (0: the prompt prefilled alone, "
                              f"scored if asked, and no output), got {req.max_new_tokens}")
        room = output_room(self.target.max_len, n, self.cfg.max_draft)
        draft_room = f"a step's draft room ({self.cfg.max_draft + 1}: --max-draft + 1)"
        if req.max_new_tokens == 0:  # its prompt alone: no step, no output's or draft's room
            if n > self.target.max_len:  # as every prompt's limit, though it prefills n - 1
                raise ConfigError(f"the prompt ({n} tokens) exceeds the context limit "
                                  f"({self.target.max_len})")
            if req.images is not None:
                raise ConfigError("max_new_tokens 0 (the prompt alone) is for a text prompt")
        elif room < 1:  # whatever the limit asked (or given by default): said without it
            raise ConfigError(f"prompt ({n} tokens) + {draft_room} leaves no room for output "
                              f"within the context limit ({self.target.max_len})")
        elif req.max_new_tokens > room:
            raise ConfigError(
                f"prompt ({n} tokens) + max_new_tokens ({req.max_new_tokens}) + {draft_room} "
                f"exceeds the context limit ({self.target.max_len}): at most {room} new tokens "
                f"fit")
        vocab = self.target.vocab_size
        if not plain_ids_in_range(req.prompt_ids + req.committed, vocab):
            check_id_kinds(req, vocab)
        if any(t >= vocab for t, _ in req.params.logit_bias):
            raise ConfigError(f"logit_bias token ids must be in [0, {vocab})")
        if req.committed and len(req.committed) >= req.max_new_tokens:
            raise ConfigError("the resumed session has already produced max_new_tokens")
        check_top_logprobs(req.logprobs)
        check_top_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if req.prompt_logprobs is not None and req.images is not None:
            raise ConfigError("prompt logprobs are not given for a prompt with images")
        if self.vision is not None:
            self.vision.check_prompt(req.prompt_ids, req.images)
        elif req.images is not None:
            raise ConfigError("this model is text-only: it takes no images")
        return session_verify_mode(req.verify, self.cfg.verify)

    def add(self, req: Request, session_id: str | None = None, device: str | None = None
            ) -> ActiveSession:
        """Prefill a request into a KV slot, now, and register its session. ``device``: the
        drafter to ask for (distributed store); the local store drafts with its own drafter.
        A request with ``committed`` output resumes a session: prompt + committed are
        prefilled. One of ``max_new_tokens`` 0 (its prompt alone) comes back ended, its
        ``on_finish`` called already."""
        [out] = self.add_many([Admission(req, session_id, device)])
        if isinstance(out, BaseException):
            raise out
        return out

    def add_many(self, entries: Sequence[Admission]) -> list[ActiveSession | Exception]:
        """``add`` for several requests at once (``admit``), their prompts prefilled together
        now, to their ends. Returns, in order, each entry's session or what refused it."""
        got = self.admit(entries)
        failed = {id(act): exc for act, exc in self._advance_prefill(None)}
        return [failed.get(id(g), g) for g in got]

    def admit(self, entries: Sequence[Admission]) -> list[ActiveSession | Exception]:
        """Take requests in: each validated, given a KV slot and created in the store, then
        queued for prefill (``prefill_queue``: each step prefills up to ``prefill_budget``
        prompt tokens of the queue before it verifies; a session runs from the step its prompt
        is all in, its prompt's logprobs, where asked for, read as it is prefilled and handed
        over then). A prompt with images is prefilled alone, now. Returns, in order, each
        entry's session or what refused it (its slot freed): a failure fails only the entry it
        concerns."""
        out: list[ActiveSession | Exception] = []
        down: Exception | None = None  # the store unreachable: the rest are not tried
        for e in entries:
            if down is not None:
                out.append(StoreUnavailable(f"not admitted: {down}"))
                continue
            try:
                out.append(self._admit_one(e))
            except Exception as exc:
                out.append(exc)
                if isinstance(exc, (StoreUnavailable, OSError)):
                    down = exc
        return out

    def _admit_one(self, e: Admission) -> ActiveSession:
        req = e.request
        req.params = with_session_seed(req.params)
        verify = self.validate(req)
        slot = self.target.new_slot()
        t0 = time.perf_counter()
        ids = prefill_ids(req)
        sid = e.session_id or f"local-{next(self._ids)}"
        drafter = e.device if self.drafter is None else self.drafter.name
        if req.max_new_tokens == 0:  # its prompt alone: nothing to draft for
            drafter = None
        try:
            if req.images is not None:
                assert self.vision is not None  # validate refused images without it
                embeds = self.vision.prompt_embeds(ids, req.images, self.target.embed)  # [n, H]
                span = DeviceSpan(self.target.device)
                self.target.prefill(slot, ids, embeds=embeds)
                self._prefilled(len(ids), span.stop())
            lineage = req.lineage or Lineage(self.target.kernel_set.fingerprint)
            self.store.create(sid, req.prompt_ids, req.params, drafter, req.max_new_tokens,
                              committed=req.committed, verify=verify, lineage=lineage)
        except BaseException:
            self.target.free_slot(slot)
            raise  # a request the scheduler retries (the store unavailable) keeps its images
        act = ActiveSession(sid, req, slot, DraftLength.of_row(self.rates, slot))
        act.verify = verify
        act.drafter = drafter or ""
        if self.cfg.auto:
            act.chooser = StackChooser()
            act.stats.stacks = act.chooser.chosen
        act.stats.start = t0
        act.stats.lossy = is_lossy(verify)
        act.stats.verify = verify
        if req.images is not None:
            req.images = req.images.spent()  # in the KV now: the pixels are not kept
            act.stats.prefill_s = time.perf_counter() - t0
            try:
                self._start(act)
            except BaseException:  # refused alone: its slot and its store keys given back
                self.target.free_slot(slot)
                self.store.close(sid, "error")  # never raises
                raise
        else:  # prefilled with the others waiting, its logits read if asked for
            scorer = None if req.prompt_logprobs is None else PromptScorer(
                req.prompt_ids, req.prompt_logprobs, min(self.prefilling.chunk, SCORED_CHUNK))
            self.prefilling.add(act, ids, scorer)
        return act

    def prefill_key(self, req: Request) -> tuple[int, ...] | None:
        """What the prefill queue would know ``req``'s prompt by, to share its prefill with
        an identical one's (``PrefillQueue.shared_keys``), or None where it would prefill it
        alone: a writer that cannot copy, an image prompt (prefilled at admission), its
        logits read, nothing to prefill."""
        if self.prefilling.copier is None or req.images is not None or \
                req.prompt_logprobs is not None:
            return None
        return tuple(prefill_ids(req)) or None

    def _start(self, act: ActiveSession) -> None:
        """A session whose prompt is all in joins the running batch."""
        if self.head is not None:
            self.head.start(act.sid, self.target.device, slot=act.slot)
        self.active.append(act)

    def _advance_prefill(self, budget: int | None) -> list[tuple[ActiveSession, Exception]]:
        """Prefill up to ``budget`` tokens of the waiting prompts (None: all); start the
        sessions whose prompts are in, fail those whose prefill failed (returned)."""
        if not self.prefilling:
            return []
        span = DeviceSpan(self.target.device)
        progress = self.prefilling.advance(budget)
        span.stop()
        if progress.failed:
            self._forwards_failed += 1
        failed = list(progress.failed)
        done: list[ActiveSession] = []  # prompts alone (no new tokens): ended once they are in
        for act in progress.ready:  # out of the queue already: each started, or failed alone
            scorer = progress.readers.get(id(act))
            if isinstance(scorer, PromptScorer):  # its prompt's logprobs, before any token
                act.prompt_logprobs = scorer.entries()
                try:
                    if act.req.on_prompt_logprobs is not None:
                        act.req.on_prompt_logprobs(list(act.prompt_logprobs))
                except Exception as e:  # the caller's: it fails this session alone, as it is
                    failed.append((act, e))
                    continue
            if act.req.max_new_tokens == 0:
                done.append(act)
                continue
            try:
                self._start(act)
            except Exception as e:  # the head's state for it, say (a device out of memory)
                failed.append((act, SessionFailed(f"starting the session failed: {e!r}")))
        for act, why in failed:  # their slots freed here
            try:
                self.target.free_slot(act.slot)
            except Exception:  # one slot's bookkeeping costs no other session its end
                log.exception("freeing the KV slot of session %s failed", act.sid)
            self.fail(act, why if isinstance(why, SessionFailed) else SessionFailed(str(why)))
        self._end_prompts_alone(done)
        if progress.tokens:
            self._prefilled(progress.tokens, span)
        return failed

    def _end_prompts_alone(self, acts: list[ActiveSession]) -> None:
        """Sessions of no new tokens (``max_new_tokens`` 0: a prompt scored alone, the
        completions' ``echo`` with ``max_tokens`` 0) end once their prompts are in, never run:
        their slots freed here, finished "length" with no output."""
        for act in acts:
            try:
                self.target.free_slot(act.slot)
            except Exception:  # one slot's bookkeeping costs no other session its end
                log.exception("freeing the KV slot of session %s failed", act.sid)
            act.finish = "length"
        try:
            self._finish_many(acts)
        except Exception:  # a caller's callback: every one was closed and told all the same
            log.exception("finishing %d prompt-only session(s) raised", len(acts))

    def _prefilled(self, tokens: int, span: DeviceSpan) -> None:
        """A prefill queued: on a CPU it has run, and is reported now; on CUDA its kernels run
        while the host goes on (no wait), and it is reported once the step has waited
        (``_settle_prefill``)."""
        self._unwaited_prefill.append((tokens, span))
        if not span.on_cuda:
            self.prefill_s += self._settle_prefill()

    def _settle_prefill(self) -> float:
        """The prefills queued since the last settle reported (``on_prefill``) with the
        device's seconds for each (read without a wait after the step's verdicts; before
        them, waiting for the prefill); returns their sum. Each is taken before it is
        reported: one whose report raises is not reported again at every later step."""
        total, pending, self._unwaited_prefill = 0.0, self._unwaited_prefill, []
        for tokens, span in pending:
            seconds = span.seconds()
            total += seconds
            if self.on_prefill is not None:
                self.on_prefill(tokens, seconds)
        return total

    @property
    def sessions(self) -> list[ActiveSession]:
        """Every session here: running, and waiting for its prompt's prefill."""
        return self.active + self.prefilling.sessions

    def cancel(self, sid: str, reason: str = "cancelled") -> bool:
        """Stop a session now (finish reason ``reason``: "cancelled", or "stop" for a stop
        string found by a front door); False if it is neither running nor waiting for its
        prefill."""
        for act in self.sessions:
            if act.sid == sid:
                act.finish = act.finish or reason  # one that just ended keeps its reason
                self._finish(act)
                return True
        return False

    def _drop(self, act: ActiveSession) -> None:
        """Forget a session here and free its KV slot (the store is not told)."""
        if act in self.active:
            self.active.remove(act)
            if self.fill is not None:  # never raises
                self.fill.forget(act.sid)
            self.target.free_slot(act.slot)
            if self.head is not None:
                self.head.finish(act.sid)
        elif self.prefilling.remove(act):  # the head starts a session once it runs
            self.target.free_slot(act.slot)

    def _release(self, act: ActiveSession, finish: str) -> None:
        self._end_here(act)
        self.store.close(act.sid, finish)  # never raises

    def _end_here(self, act: ActiveSession) -> None:
        """A session's last stats, its slot freed; the store not told."""
        act.stats.tokens = len(act.output) - len(act.req.committed)
        act.stats.elapsed_s = time.perf_counter() - act.stats.start
        act.stats.settle()
        self._drop(act)

    def _finish(self, act: ActiveSession) -> None:
        self._finish_many([act])

    def _finish_many(self, acts: Sequence[ActiveSession]) -> None:
        """Sessions that ended (``finish`` set), the store told of all in one call (a step's
        sessions often end together: one round trip to Redis, not one each), then each one's
        ``on_finish``. One that fails here (its slot's release, its callback) does not keep
        the others from being closed and told: the first such error is raised after them."""
        finished: dict[str, str] = {}
        errors: list[Exception] = []
        for act in acts:
            assert act.finish is not None  # called once the session has ended
            try:
                self._end_here(act)
            except Exception as exc:  # its output is final: closed and told all the same
                errors.append(exc)
            finished[act.sid] = act.finish
        if finished:
            try:
                self.store.close_many(finished)
            except Exception:  # the store's keys expire by themselves: only logged
                log.exception("closing %d ended session(s) in the store failed", len(finished))
        for act in acts:
            if act.on_finish:
                try:
                    act.on_finish(Result(act.output, act.stats, finished[act.sid],
                                         act.logprobs, act.prompt_logprobs))
                except Exception as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]

    def abandon(self, act: ActiveSession, exc: Exception) -> None:
        """Drop a session here but leave it in the store as it is, so that it can be resumed
        (this verifier is stopping)."""
        self._drop(act)
        if act.on_error:
            act.on_error(exc)

    def fail(self, act: ActiveSession, exc: Exception) -> None:
        """End one session with an error; the others go on. Its caller is told whatever its
        release raises, and nothing of either reaches the step (the loop would fail every
        session in flight)."""
        log.warning("session %s failed: %s", act.sid, exc)
        try:
            self._release(act, "error")
        except Exception:
            log.exception("releasing failed session %s failed", act.sid)
        if act.on_error:
            try:
                act.on_error(exc)
            except Exception:
                log.exception("telling session %s of its failure failed", act.sid)
