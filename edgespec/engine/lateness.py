"""A late drafter costs only its own sessions: which drafters the verifier stops waiting for.

A verification step waits, up to the draft deadline (a session whose board drafts anew after a fix,
up to what its draft is worth, less than a forward), until every session's draft is ready. A board
whose link went silent or slow would make every step of the whole batch wait the full deadline: on a
GPU step of a few milliseconds that multiplies everyone's step time. So the engine learns each
drafter's lateness from the steps, judged by what its drafts were worth: a drafter whose drafts held
nothing (not a token, and not ready) for some session of it at the end of ``MISSES_TO_LATE`` steps
in a row is *late* (a board that holds fewer tokens than asked, as a board slower than the steps
does, still brings tokens: the step waits for it only as long as its draft is worth,
``draft_planner.wait_worth``), and its sessions are then verified with whatever they hold without
being waited for (at worst as target-only decoding: one token a step), except every
``PROBE_EVERY``-th step that asks it for drafts, which waits for it; as soon as its drafts hold
tokens (or are ready) when taken in ``HITS_TO_RECOVER`` steps in a row it is waited for again. Only
speed depends on this, never output: a shorter draft verifies to the same tokens.

The counts per drafter (``DrafterLink``) feed ``/metrics`` and ``edgespec status``, so an
operator sees which board's link is bad (``/metrics`` alone: each session step asked for a draft
that held none, counted by what came before it, ``EmptyDrafts``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

MISSES_TO_LATE = 3
HITS_TO_RECOVER = 2
PROBE_EVERY = 8  # a late drafter is waited for again on every 8th step (its drafts may come)
MAX_TRACKED = 4096  # drafters remembered (ids come from devices: keep the table bounded)


@dataclass(frozen=True)
class EmptyDrafts:
    """A step's session steps of one drafter asked for a draft and given none, by what came
    before: ``opening``, no draft of the session's from it held tokens yet (it is reading the
    prompt); ``again``, the session's step before that asked for one got none either (a run
    of empty drafts: it has not caught up since); ``after_fix``, the last step that asked got
    tokens and the last commit sent a fix (a draft token rejected, or the step's own token
    past the draft not the board's next): it drafts anew from there; ``other``, none of these
    (it had not drafted as far as its draft was taken)."""

    opening: int = 0
    after_fix: int = 0
    again: int = 0
    other: int = 0


@dataclass
class DrafterLink:
    """One drafter as the verifier's steps saw it."""

    late: bool = False
    missed: int = 0  # steps whose deadline its drafts missed
    unwaited: int = 0  # steps that did not wait for it (it was late)
    marked_late: int = 0  # times it became late
    run: int = 0  # consecutive misses (on time: consecutive hits while late)
    since_probe: int = 0  # steps since a late drafter was last waited for
    # per session and step: its sessions verified, those whose draft was ready when taken,
    # and those whose draft held tokens (verified drafts)
    session_steps: int = 0
    ready_drafts: int = 0
    verified_drafts: int = 0
    waited_s: float = 0.0  # seconds of the steps' waits while a draft of it was waited for
    # session steps asked for a draft that held none (``EmptyDrafts``)
    empty_opening: int = 0
    empty_after_fix: int = 0
    empty_again: int = 0
    empty_other: int = 0


class Lateness:
    """Fed by the engine's thread once a step; read by status and metrics from other threads.
    ``misses_to_late``: consecutive missed deadlines that make a drafter late (0: never)."""

    def __init__(self, misses_to_late: int = MISSES_TO_LATE) -> None:
        self.misses_to_late = misses_to_late
        self._links: dict[str, DrafterLink] = {}
        self._lock = threading.Lock()

    def late(self, drafter: str) -> bool:
        with self._lock:
            link = self._links.get(drafter)
            return link is not None and link.late

    def not_waited_for(self, drafters: set[str]) -> set[str]:
        """The drafters this step does not wait for, of ``drafters``, those it asks for drafts: the
        late ones, except on every PROBE_EVERY-th step that asks each (then its drafts are waited
        for as long as they are worth, so that a drafter whose drafts need the wait can show it
        is back; a step asking it nothing could not). Call once a step."""
        out = set()
        with self._lock:
            for d in drafters:
                link = self._links.get(d)
                if link is None or not link.late:
                    continue
                link.since_probe += 1
                if link.since_probe >= PROBE_EVERY:
                    link.since_probe = 0
                else:
                    out.add(d)
        return out

    def record(self, drafter: str, ready: bool, waited: bool,
               sessions: tuple[int, int, int] = (0, 0, 0), useful: bool | None = None,
               waited_s: float = 0.0, empty: EmptyDrafts = EmptyDrafts()) -> None:
        """One step's outcome for a drafter: whether its drafts were ready when taken, and
        whether the step waited for them; ``sessions``: (its sessions in the step, those whose
        draft was ready, those whose draft held tokens); ``useful``: whether every draft of it
        was ready or held tokens (what lateness judges; None: ``ready``); ``waited_s``: the
        step's wait, where it waited for a draft of this drafter (else 0); ``empty``: its
        sessions' empty drafts, by what came before."""
        on_time = ready if useful is None else useful
        with self._lock:
            link = self._links.get(drafter)
            if link is None:
                if len(self._links) >= MAX_TRACKED:
                    self._links.pop(next(iter(self._links)))
                link = self._links[drafter] = DrafterLink()
            link.session_steps += sessions[0]
            link.ready_drafts += sessions[1]
            link.verified_drafts += sessions[2]
            link.waited_s += waited_s
            link.empty_opening += empty.opening
            link.empty_after_fix += empty.after_fix
            link.empty_again += empty.again
            link.empty_other += empty.other
            if not waited:
                link.unwaited += 1
            if not ready:
                link.missed += 1
            if link.late:
                # on time counts wherever it is seen; a miss only where the step waited for it
                # (not waiting for a drafter whose drafts need the wait proves nothing)
                if on_time:
                    link.run += 1
                elif waited:
                    link.run = 0
                if link.run >= HITS_TO_RECOVER:
                    link.late, link.run = False, 0
            else:
                link.run = 0 if on_time else link.run + 1
                if self.misses_to_late and link.run >= self.misses_to_late:
                    link.late, link.run = True, 0
                    link.marked_late += 1

    def snapshot(self) -> dict[str, DrafterLink]:
        with self._lock:
            return {d: DrafterLink(**vars(link)) for d, link in self._links.items()}
