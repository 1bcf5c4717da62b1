"""A step's commit stage: the verified paths placed, the verdicts committed in the store, each
session's KV cache, stats and output moved on, and the draft lengths taught the step's
acceptance. ``StepCommit`` is a part of ``SpecEngine`` (a base class of it, between
``SessionLifecycle`` and ``StepDrafts``): it reads the engine's target, store, head and session
lists, which the engine sets up.

A failure fails the sessions it concerns, never the step: a path that cannot be placed, a
verdict the store refuses, a token callback that raises. A commit that raises (the store
unreachable) leaves the step's verdicts undelivered for the engine to retry.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..drafters.draft_rates import RowsOf
from .decisions import Decision
from .generation import ActiveSession, SessionFailed
from .proposals import drafter_share
from .session_lifecycle import SessionLifecycle
from .stack_choice import accepted_prefix
from .step_report import StepReport, step_report

log = logging.getLogger("edgespec.engine.spec_engine")


class StepCommit(SessionLifecycle):
    """The commit stage of ``SpecEngine.step`` (``_place``, ``_commit``)."""

    # this step's planned sessions, and their draft-length rows once read (``_rows_of``)
    _step_acts: list[ActiveSession]
    _step_rows: RowsOf | None
    _undelivered: list[Decision]  # verdicts whose commit raised: retried by the next step
    _undelivered_s: tuple[float, float]  # their step's take and forward seconds
    # the head's moves of this step's verified batches, made once their paths are placed
    _head_pending: list[tuple[list[str], Any, list[int], list[list[int]]]]

    def _rows_of(self, acts: Sequence[ActiveSession]) -> RowsOf:
        """The draft-length rows of ``acts``: this step's planned sessions, or those of them
        still in the step (what its take or commit kept, in their order), read once a step
        while none was dropped."""
        planned = self._step_acts
        if len(acts) != len(planned) or not all(map(operator.is_, acts, planned)):
            return RowsOf([a.draft_len for a in acts])
        if self._step_rows is None:
            self._step_rows = RowsOf([a.draft_len for a in acts])
        return self._step_rows

    def _place(self, decided: list[Decision]) -> list[Decision]:
        """The commit stage's first part, right after verification: the accepted tree paths'
        keys and values moved into place, all at once (``TargetRunner.compact_many``), then
        the head's sessions moved on over them (an imitation head drafts from the compacted
        positions). A failure fails the sessions it concerns, not the step; returns the
        decisions still to commit. A step of chains with no head has nothing to place: a
        chain's accepted path is its first nodes, already in place, and ``_apply`` sets each
        slot's length."""
        if self.head is None and not any(d.draft.branches for d in decided):
            return decided
        placed = []
        errors = self.target.compact_many([(d.act.slot, d.path) for d in decided])
        for d, error in zip(decided, errors):
            if error is not None:
                log.error("placing the verified path of session %s failed", d.act.sid,
                          exc_info=error)
                self.fail(d.act, SessionFailed("placing its verified path failed"))
                continue
            placed.append(d)
        pending, self._head_pending = self._head_pending, []
        if self.head is not None:
            for sids, proposal, lengths, drafts in pending:
                try:
                    self.head.after_step(sids, proposal, lengths, drafts)
                except Exception:  # its sessions' head contexts are unknown now
                    log.exception("the head's step over %d session(s) failed", len(sids))
                    failed = set(sids)
                    for act in [a for a in self.active if a.sid in failed]:
                        self.fail(act, SessionFailed("the draft head's step failed"))
                    placed = [d for d in placed if d.act.sid not in failed]
        return placed

    @property
    def commits_undelivered(self) -> bool:
        """A step's verdicts wait for the store (their commit raised): the next step sends
        them first, as they were."""
        return bool(self._undelivered)

    def _commit(self, decided: list[Decision], take_s: float = 0.0, forward_s: float = 0.0
                ) -> list[Decision]:
        """Commit verdicts in the store, then apply the ones it took, each session's stats
        given the step's times; returns those applied."""
        running = set(map(id, self.active))
        decided = [d for d in decided if id(d.draft.act) in running]  # not cancelled meanwhile
        self._undelivered, self._undelivered_s = decided, (take_s, forward_s)
        t0 = time.perf_counter()
        outcomes = self.store.commit_many([d.verdict for d in decided])  # may raise: retried
        self._undelivered = []
        dt = time.perf_counter() - t0
        applied = []
        for d, outcome in zip(decided, outcomes):
            if outcome.error is None:  # ``ok``
                applied.append(d)
                d.draft.act.fixed = outcome.fix is not None
        if len(applied) < len(decided):
            for d, outcome in zip(decided, outcomes):
                if not outcome.ok:
                    self.fail(d.act, SessionFailed(f"the cache refused a commit: "
                                                   f"{outcome.error}"))
        self._learn(applied)
        ended: list[ActiveSession] = []
        try:
            for d in applied:
                act = d.draft.act
                if act.finish is not None:  # ended meanwhile: a callback cancelled it
                    continue
                self._apply(d, take_s, forward_s, dt)
                if act.finish:
                    ended.append(act)
        except BaseException:  # those that ended before the failure end now, told of it
            try:
                self._finish_ended(ended)
            except Exception:  # the apply's error is the one to raise
                log.exception("finishing the sessions that ended before a failed apply")
            raise
        self._finish_ended(ended)
        return applied

    def _finish_ended(self, ended: list[ActiveSession]) -> None:
        """``_finish_many`` of the step's ended sessions still here (a callback may have
        cancelled one: it was finished then)."""
        if not ended:  # most steps: nothing to look up
            return
        running = set(map(id, self.active))
        self._finish_many([a for a in ended if id(a) in running])

    def _learn(self, applied: list[Decision]) -> None:
        """The draft lengths learn the step's verdicts, all sessions in one go: the chain's
        own acceptance, the branches'. A step that verified no draft token (a server serving
        alone, or drafts that did not pay) teaches nothing: its rows are not read."""
        drafted = [len(d.draft.tokens) for d in applied]
        if not any(drafted) and not any(d.draft.branch_tokens for d in applied):
            return
        rows, B = self._rows_of([d.draft.act for d in applied]), len(applied)
        rows.record("update", np.array(drafted, dtype=np.int64),
                    np.array([d.verdict.n_accepted for d in applied], dtype=np.int64))
        # a row verified branch tokens; a fill's are the verifier's, not the drafter's: they
        # teach the drafter's branches nothing
        if any(d.draft.branch_tokens and not d.draft.fill_offer for d in applied):
            rows.record("update_branches",
                        np.fromiter((0 if d.draft.fill_offer else d.draft.branch_tokens
                                     for d in applied), np.int64, B),
                        np.fromiter((0 if d.draft.fill_offer else len(d.verdict.branch)
                                     for d in applied), np.int64, B))

    def _apply(self, d: Decision, take_s: float, forward_s: float, commit_s: float) -> None:
        """A verdict the store took, applied here: the KV cache, the stats, the output (the
        draft length learnt it in ``_learn``)."""
        draft, v, new = d.draft, d.verdict, d.new
        act, n_branch = draft.act, len(v.branch)
        accepted = v.n_accepted + n_branch
        # KV of last + accepted (a tree's accepted path was moved into place: ``_place``)
        self.target.commit(act.slot, v.start + accepted)
        stats = act.stats
        stats.record_step(draft.drafted, accepted, n_branch)
        # the drafter's share: the whole draft where no branch may be the verifier's
        own, own_accepted = drafter_share(draft, v.n_accepted, v.branch) if draft.branches \
            else (draft.drafted, accepted)
        if own:
            stats.drafter_drafts += 1
            stats.drafter_tokens += own
            stats.drafter_accepted += own_accepted
        stats.take_s += take_s
        stats.forward_s += forward_s
        stats.commit_s += commit_s
        offer = draft.head_offer
        if offer and self.head is not None:
            got = accepted_prefix(offer, new[:accepted])
            stats.head_tokens += len(offer)
            stats.head_accepted += got
            self.head.offered(len(offer), got)
        if draft.fill_offer:  # the verifier's own draft for an empty board draft
            stats.fill_drafts += 1
            stats.fill_tokens += len(draft.fill_offer)
            stats.fill_accepted += n_branch
        if act.verify != "exact":  # the path's nodes only a lossy rule kept, as far as the
            stats.lenient_tokens += sum(d.lenient[:len(new)])  # output took them
        if act.logprobs is not None:
            if len(d.logprobs) != len(new):  # a path that read none: failed, never sent short
                log.error("session %s asked for logprobs and its step read %d for %d tokens",
                          act.sid, len(d.logprobs), len(new))
                self.fail(act, SessionFailed("its logprobs were not read with its tokens"))
                return
            act.logprobs.extend(d.logprobs)
        act.output.extend(new)
        act.last_token = v.token
        act.finish = v.finish_reason or None  # the step ends it (``_commit``)
        req = act.req
        if req.on_tokens or req.on_logprobs:
            try:
                if req.on_logprobs is not None:
                    req.on_logprobs(list(d.logprobs))
                if req.on_tokens is not None:
                    req.on_tokens(new)
            except Exception as exc:  # the caller's callback fails its own session alone
                log.exception("the token callback of session %s raised", act.sid)
                failed = SessionFailed(f"its token callback raised: {exc!r}")
                failed.__cause__ = exc  # the caller's own error, for a caller that looks
                self.fail(act, failed)


def report_of(applied: list[Decision], sessions: int, tokens: int, take_s: float,
              forward_s: float, commit_s: float) -> StepReport:
    """The step's ``StepReport`` from the decisions it applied."""
    return step_report([d.verdict.n_accepted + len(d.verdict.branch) for d in applied],
                       [d.draft.drafted for d in applied], sessions,
                       tokens, take_s, forward_s, commit_s, [d.draft.depth for d in applied])
