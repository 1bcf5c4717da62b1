"""A drafting loop's turn, done outside the channel's lock (``drafting_loop``): the sessions to
open, one by one, then the chunks, in one ``propose_many`` where the drafter drafts several
sessions a forward (``Drafter.batch_jobs``: llama.cpp's sequences), else one by one.

A call of several sessions that fails costs no session its drafts by itself: each of its
sessions is taken back to where it stood before the call (``retract``: what the call appended,
and a model drafter's cache past it) and drafted alone, so that only a session that fails alone
is refused. A call that failed where each alone drafted makes the loop draft one by one for
ALONE_TURNS turns, rather than pay a failing call every turn.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from . import Drafter, DraftSession
from .draft_book import DraftTarget

log = logging.getLogger("edgespec.drafting")


@dataclass
class Job:
    """One job of a turn: open a session's draft session, or draft its chunk of ``n`` tokens from
    ``start`` under ``epoch``."""

    sid: str
    target: DraftTarget
    opening: bool  # open the draft session (else draft a chunk)
    epoch: int
    start: int = 0
    n: int = 0
    ran_s: tuple[float, float] | None = None  # when it began and ended (monotonic)


ALONE_TURNS = 64  # after a call of several sessions failed where each alone did not


def do_turn(jobs: list[Job], tree_width: int, drafter: Drafter, together: bool = True):
    """Outside the lock: a turn's jobs, the sessions to open one by one, then the chunks, all
    in one ``propose_many`` where the drafter drafts several sessions a forward
    (``Drafter.batch_jobs``) and ``together`` allows, else one by one. Returns (job, result,
    error) for each; (seconds, tokens) for the pace, each drafting call's time and its longest
    chunk; and whether a call of several sessions failed where each alone drafted."""
    done: list[tuple[Job, Any, Exception | None]] = []
    paced: list[tuple[float, int]] = []
    chunks = [job for job in jobs if not job.opening]
    batched = together and drafter.batch_jobs > 1 and len(chunks) > 1
    for job in jobs:
        if job.opening or not batched:  # a batched turn's chunks go in one call, below
            _do_alone(job, tree_width, drafter, done, paced)
    if not batched:
        return done, paced, False
    began = time.monotonic()
    before = [len(_opened(job).tokens) for job in chunks]
    try:
        outcomes = list(drafter.propose_many([(_opened(job), job.n) for job in chunks],
                                             tree_width))
        if len(outcomes) != len(chunks):  # a drafter's broken promise
            raise RuntimeError(f"propose_many gave {len(outcomes)} drafts for "
                               f"{len(chunks)} sessions")
    except Exception as exc:  # a broken call costs speed: each session drafted alone
        log.warning("drafting %d sessions together failed (%r); each is drafted alone",
                    len(chunks), exc)
        alone = len(done)
        for job, length in zip(chunks, before):
            try:  # what the call appended taken back (a model drafter's cache with it)
                _opened(job).retract(length)
            except Exception as gone:  # its draft session cannot be trusted: its drafts end
                done.append((job, None, gone))
                continue
            _do_alone(job, tree_width, drafter, done, paced)
        return done, paced, all(error is None for _, _, error in done[alone:])
    ended = time.monotonic()
    for job, outcome in zip(chunks, outcomes):
        job.ran_s = (began, ended)
        done.append((job, outcome, None))
    paced.append((ended - began, max(len(o) for o in outcomes)))
    return done, paced, False


def _do_alone(job: Job, tree_width: int, drafter: Drafter,
              done: list[tuple[Job, Any, Exception | None]], paced: list[tuple[float, int]]
              ) -> None:
    """One job by itself, timed: its (job, result, error) onto ``done``, a chunk's time onto
    ``paced``."""
    began = time.monotonic()
    outcome, error = _do(job, tree_width, drafter)
    job.ran_s = (began, time.monotonic())
    done.append((job, outcome, error))
    if not job.opening and error is None:
        paced.append((job.ran_s[1] - began, len(outcome)))


def _opened(job: Job) -> DraftSession:
    draft = job.target.draft
    assert draft is not None  # a chunk is drafted only for an opened session
    return draft


def _do(job: Job, tree_width: int, drafter: Drafter):
    """Outside the lock: open the session or draft its chunk; (result, error)."""
    try:
        if job.opening:
            return drafter.open(list(job.target.opening or ()), job.target.params), None
        # a width of 1 is propose's chain
        return _opened(job).propose_tree(job.n, tree_width), None
    except Exception as exc:  # a broken drafter costs speed, never the session
        return None, exc
