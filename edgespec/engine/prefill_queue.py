"""Sessions admitted and not yet prefilled: their prompts prefilled a budget of tokens a step,
beside the running sessions (chunked prefill), several prompts in shared forwards.

``SpecEngine.admit`` puts a session here with its KV slot; each step, before verifying,
``advance`` spends up to the step's prefill budget: the waiting prompts in order of arrival,
each cut at fixed positions (multiples of the chunk, counted from the prompt's start, so that
where a prompt is cut does not depend on what else was waiting; the bits do not either: the
kernels are batch-invariant, ``tests/test_batch_invariance.py``), in passes: every waiting
prompt's next part in one shared write (``TargetRunner.prefill_parts``), pass after pass while
the budget lasts. A session whose prompt is all in joins the running
batch at that step. So a burst of arrivals costs each running stream at most one budget of
prefill a step, and a long prompt no longer stalls every stream for its whole prefill.

A prompt whose logprobs are asked for (the completions' ``echo``) waits here too, with a
``PartReader``: its parts end at multiples of the reader's own chunk (a part's logits are
[T, V] float32, so they are kept short), and the runner hands each part's logits to it as the
shared forward computes them (``TargetRunner.prefill_parts``' ``reads``). So a burst of
scoring requests is prefilled together, within the step's budget, like any other.

A shared forward that raises is retried one part at a time, so that a failure fails only the
session it concerns (a reader keeps a part's logprobs by its first position: a part read
twice is read the same).

A prompt identical to one already waiting (the ``n`` choices of a request, the same prompt sent
twice at once) is not prefilled again: it waits for the first, and when that one's prompt is
all in, its keys and values are copied into the other's slot (``copy_prompt``: one device copy
a layer, no forward). They are the bits its own prefill would write, since a token's keys and
values depend only on the tokens before it (the kernels are batch-invariant and the parts cut
at fixed positions). If the first fails or is cancelled, the next of its copies is prefilled
in its place; a cancelled first hands it what it had prefilled (copied from its slot before
the slot is freed), so its prefill goes on from there: a client that leaves during a long
prompt's prefill costs the others waiting for the same prompt nothing. A prompt identical to
one this queue put in whose session still runs (choices that reached the engine a step apart)
is copied from that session's slot at the next ``advance``: a running session's prompt
positions are never written again. A writer without ``copy_prompt`` prefills every prompt; a
prompt whose logits are read is always prefilled itself (its parts are cut at its reader's
chunk) and is no source either.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from .generation import ActiveSession

if TYPE_CHECKING:
    import torch

log = logging.getLogger("edgespec.engine.prefill_queue")

SOURCES_SWEPT = 256  # prompts remembered as sources before the ended sessions' are swept out


class PromptWriter(Protocol):
    """What the queue needs of the target runner."""

    def prefill_parts(self, slots: Sequence[int], parts: Sequence[list[int]],
                      reads: Sequence[Callable[["torch.Tensor"], None] | None] | None = None
                      ) -> None: ...

    def rollback(self, slot: int, length: int) -> None: ...


class PromptCopier(Protocol):
    """What a writer that can share a prompt's prefill offers besides (``TargetRunner``)."""

    def copy_prompt(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst`` holds the first ``length`` positions of slot ``src``'s keys and
        values, and that length."""
        ...


class PartReader(Protocol):
    """What reads a waiting prompt's logits as its parts are written
    (``scoring.PromptScorer``)."""

    chunk: int  # its prompt's parts end at multiples of this

    def reads(self, start: int) -> bool:
        """Whether the part from position ``start`` holds a position it reads."""
        ...

    def read(self, start: int, logits: "torch.Tensor") -> None:
        """The logits [1, T, V] float32 of the T positions of the part from ``start``."""
        ...


@dataclass(eq=False)
class WaitingPrompt:
    act: ActiveSession
    tokens: list[int]  # what to prefill: prompt + committed, but the last token
    done: int = 0  # prefilled so far
    began: float = 0.0  # perf_counter when admitted
    reader: PartReader | None = None
    # an earlier waiting prompt of the same tokens: this one's keys and values are copied from
    # its slot once its prompt is all in (None: prefilled itself)
    leader: "WaitingPrompt | None" = None
    copies: "list[WaitingPrompt]" = field(default_factory=list)  # those it leads, in order
    key: tuple[int, ...] | None = None  # its tokens, where its prefill may be shared
    # a running session whose slot holds these tokens' keys and values: copied at the next
    # ``advance`` (None: not so)
    source: ActiveSession | None = None


@dataclass
class PrefillProgress:
    """What one ``advance`` did."""

    ready: list[ActiveSession]  # prompts all in: to run from this step on
    failed: list[tuple[ActiveSession, Exception]]
    tokens: int = 0  # prompt tokens prefilled
    copied: int = 0  # prompt tokens copied from an identical prompt's slot, not prefilled
    # the ready sessions' readers (those whose prompt's logits were read), by id(act)
    readers: dict[int, PartReader] = field(default_factory=dict)


class PrefillQueue:
    def __init__(self, target: PromptWriter, chunk: int):
        self.target, self.chunk = target, chunk
        self.waiting: list[WaitingPrompt] = []
        # identical prompts share one prefill where the writer can copy a slot's prompt
        self.copier: PromptCopier | None = target if callable(
            getattr(target, "copy_prompt", None)) else None  # type: ignore[assignment]
        self._firsts: dict[tuple[int, ...], WaitingPrompt] = {}  # tokens -> the one prefilled
        # tokens -> a session whose prompt this queue put in (prefilled or copied), while it
        # runs (an ended one's entry is dropped when met, and in a sweep past SOURCES_SWEPT)
        self._sources: dict[tuple[int, ...], ActiveSession] = {}
        self._sourced: list[WaitingPrompt] = []  # waiting prompts with a ``source``

    def __len__(self) -> int:
        return len(self.waiting)

    @property
    def sessions(self) -> list[ActiveSession]:
        return [w.act for w in self.waiting]

    @property
    def tokens_left(self) -> int:
        """Prompt tokens still to prefill: the waiting prompts' that will be prefilled, not
        those to be copied from another's slot (an estimate for admission pacing, read by
        other threads: from a copy of the list)."""
        return sum(len(w.tokens) - w.done for w in list(self.waiting)
                   if w.leader is None and w.source is None)

    def shared_keys(self) -> set[tuple[int, ...]]:
        """The prompts (as ``add`` is given them) a newcomer would copy rather than prefill:
        those waiting to be prefilled, and those of running sessions this queue put in (none
        where the writer cannot copy). Read by other threads: from copies, as the
        interpreter makes them whole."""
        if self.copier is None:
            return set()
        running = dict(self._sources)
        return set(self._firsts) | {k for k, act in running.items() if act.finish is None}

    def add(self, act: ActiveSession, tokens: list[int], reader: PartReader | None = None
            ) -> None:
        """Queue a session's prompt; ``reader``: what reads its logits (its parts then end at
        multiples of ``reader.chunk``, not of the queue's). A prompt read by no reader and the
        same as one waiting (itself prefilled) waits for that one's, to be copied."""
        w = WaitingPrompt(act, tokens, began=time.perf_counter(), reader=reader)
        if reader is None and self.copier is not None and tokens:
            key = w.key = tuple(tokens)
            source = self._sources.get(key) if key not in self._firsts else None
            if source is not None and source.finish is None:
                w.source = source
                self._sourced.append(w)
            else:
                self._lead_or_follow(w, key)
        self.waiting.append(w)

    def _lead_or_follow(self, w: WaitingPrompt, key: tuple[int, ...]) -> None:
        """``w`` copies the waiting prompt of its tokens prefilled itself, or is that one."""
        first = self._firsts.get(key)
        if first is None:
            w.key, self._firsts[key] = key, w
        else:
            w.leader = first
            first.copies.append(w)

    def remove(self, act: ActiveSession) -> bool:
        """Forget a waiting session (cancelled, failed); False if it is not here. Its copies
        wait for the first of them instead, which is prefilled itself."""
        for i, w in enumerate(self.waiting):
            if w.act is act:
                del self.waiting[i]
                if w.leader is not None:
                    w.leader.copies.remove(w)
                if w.source is not None:
                    self._sourced.remove(w)
                self._promote(w)
                self._hand_over(w)
                return True
        return False

    def _hand_over(self, gone: WaitingPrompt) -> None:
        """``gone`` left with part of its prompt in (``remove``: its slot is freed after
        this): the copy prefilled in its place (``_promote``) takes those positions from its
        slot and goes on from there. They end at a multiple of the chunk, where that copy's
        own parts would be cut, so they are the bits its own prefill would write. A failed
        copy is logged; the copy is then prefilled from the start."""
        if not gone.done or not gone.copies or self.copier is None:
            return
        first = gone.copies[0]
        try:
            self.copier.copy_prompt(gone.act.slot, first.act.slot, gone.done)
        except Exception:
            log.exception("copying the prefilled part of session %s's prompt into session "
                          "%s failed; prefilling it from the start", gone.act.sid,
                          first.act.sid)
            return
        first.done = gone.done

    def _promote(self, gone: WaitingPrompt) -> None:
        """``gone`` left the queue without its prompt in: the first of its copies is
        prefilled itself instead, and the others copy that one's."""
        if gone.key is not None and self._firsts.get(gone.key) is gone:
            del self._firsts[gone.key]
        if not gone.copies:
            return
        first, *rest = gone.copies
        first.leader, first.copies, first.key = None, rest, gone.key
        for w in rest:
            w.leader = first
        if gone.key is not None:
            self._firsts[gone.key] = first

    def advance(self, budget: int | None) -> PrefillProgress:
        """Prefill up to ``budget`` prompt tokens (None: every waiting prompt to its end), the
        oldest first, in passes: each waiting prompt's next part (ending at a multiple of the
        chunk or at its prompt's end) a pass, one shared write a pass, until a part does not
        fit what is left; at least one part whatever the budget."""
        out = PrefillProgress([], [])
        if self._sourced:
            self._copy_from_running(out)
        left = budget
        moved = False  # a part was taken this step: the next must fit the budget
        while self.waiting:
            parts: list[tuple[WaitingPrompt, int]] = []  # (prompt, its part's end)
            for w in self.waiting:
                if w.leader is not None:  # copied from its leader's slot once that is in
                    continue
                chunk = self.chunk if w.reader is None else w.reader.chunk
                end = min(len(w.tokens), (w.done // chunk + 1) * chunk)
                if left is not None and moved and end - w.done > left:
                    break
                parts.append((w, end))
                moved = True
                if left is not None:
                    left -= end - w.done
            if not parts:
                break
            failed = self._write(parts)
            for w, end in parts:
                if w in failed:
                    self.waiting.remove(w)
                    out.failed.append((w.act, RuntimeError("its prompt's prefill failed")))
                    self._promote(w)
                    continue
                out.tokens += end - w.done
                w.done = end
                if w.done >= len(w.tokens):
                    self.waiting.remove(w)
                    w.act.stats.prefill_s = time.perf_counter() - w.began
                    out.ready.append(w.act)
                    if w.reader is not None:
                        out.readers[id(w.act)] = w.reader
                    else:
                        self._copy_to_copies(w, out)
            if left is not None and left <= 0:
                break
        return out

    def _copy_to_copies(self, w: WaitingPrompt, out: PrefillProgress) -> None:
        """``w``'s prompt is all in: the prompts waiting for it take its keys and values and
        are ready; one whose copy fails is prefilled itself. It is a source from now on."""
        if w.key is not None and self._firsts.get(w.key) is w:
            del self._firsts[w.key]
        copies, w.copies = w.copies, []
        if self.copier is None:
            return
        key = w.key or tuple(w.tokens)
        self._add_source(key, w.act)
        for c in copies:
            c.leader = None
            self._copied(c, w.act, key, out)

    def _copy_from_running(self, out: PrefillProgress) -> None:
        """The prompts whose tokens a running session's slot holds, copied from it; one
        whose source ended meanwhile, or whose copy fails, is prefilled (or copies the
        waiting prompt of its tokens that is)."""
        sourced, self._sourced = self._sourced, []
        for w in sourced:
            source, w.source, key = w.source, None, w.key
            assert source is not None and key is not None  # listed in ``_sourced`` only then
            if source.finish is None and self._copied(w, source, key, out):
                continue
            if self._sources.get(key) is source:
                del self._sources[key]
            self._lead_or_follow(w, key)

    def _copied(self, c: WaitingPrompt, source: ActiveSession, key: tuple[int, ...],
                out: PrefillProgress) -> bool:
        """``c`` given ``source``'s slot's first positions (``c``'s tokens): ready, or False
        where the copy failed (logged)."""
        try:
            assert self.copier is not None  # a prompt copies another's only then (``add``)
            self.copier.copy_prompt(source.slot, c.act.slot, len(c.tokens))
        except Exception:
            log.exception("copying the prompt of session %s into session %s failed; "
                          "prefilling it", source.sid, c.act.sid)
            return False
        self.waiting.remove(c)
        out.copied += len(c.tokens)
        c.done = len(c.tokens)
        c.act.stats.prefill_s = time.perf_counter() - c.began
        out.ready.append(c.act)
        self._add_source(key, c.act)
        return True

    def _add_source(self, key: tuple[int, ...], act: ActiveSession) -> None:
        """``act``'s slot holds ``key``'s prompt: a source while it runs (one a prompt: a
        running one is kept). Ended sessions' entries are swept once there are many."""
        held = self._sources.get(key)
        if held is None or held.finish is not None:
            self._sources[key] = act
        if len(self._sources) > SOURCES_SWEPT:
            self._sources = {k: a for k, a in self._sources.items() if a.finish is None}

    def _write(self, parts: list[tuple[WaitingPrompt, int]]) -> list[WaitingPrompt]:
        """One shared write of the parts; if it raises, each part alone, from where its slot
        stood (a shared write may have landed some rows). Returns the prompts whose part
        failed alone."""
        todo = [(w, end) for w, end in parts if end > w.done]
        if not todo:
            return []
        try:
            self._prefill(todo)
            return []
        except Exception:
            log.exception("prefilling %d prompt(s) together failed; each alone",
                          len(todo))
        failed = []
        for w, end in todo:
            try:
                self.target.rollback(w.act.slot, w.done)
                self._prefill([(w, end)])
            except Exception:
                log.exception("prefilling session %s failed", w.act.sid)
                failed.append(w)
        return failed

    def _prefill(self, todo: list[tuple[WaitingPrompt, int]]) -> None:
        """One ``prefill_parts`` of the parts, the read ones' logits to their readers (the
        keyword left out where none is read: a writer that reads none need not take it)."""
        reads = [None if w.reader is None or not w.reader.reads(w.done)
                 else partial(w.reader.read, w.done) for w, _ in todo]
        slots, parts = [w.act.slot for w, _ in todo], [w.tokens[w.done:end] for w, end in todo]
        if any(reads):
            self.target.prefill_parts(slots, parts, reads=reads)
        else:
            self.target.prefill_parts(slots, parts)
