"""Running sessions handed to a drafter that can draft for them: a session admitted while no
board had room (the server decodes it alone), and a session whose board has been gone for
``after_s`` (``serve --handover-after``, ``HANDOVER_AFTER_S`` by default: it would stay assigned
to a board that may never come back; 0 turns the hand-over off), are handed
to the attached drafter with the fewest sessions below its limit, once a second at most, by
the scheduler's thread between steps.

The hand-over (``RedisSessionStore.hand_over``) moves the session's owner in the cache in one
transaction: the new board is assigned it (it drafts from the committed end, as for a new
session), the old one, if any, is told it closed, and the old board's chunks are refused from
then on. The engine then asks the new board for drafts (``ActiveSession.hand_to``). The output
is the same either way: drafts only decide how many tokens a step verifies. A session pinned to
a board (``device_id``) is never handed over, nor one with fewer than ``MIN_TOKENS_LEFT``
tokens to go. The store of a server without boards (in process) has no hand-over: nothing to do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edgespec.engine.generation import ActiveSession
from edgespec.engine.spec_engine import SpecEngine

from .metrics import board_share
from .tickets import Ticket

log = logging.getLogger("edgespec.verifier")

HANDOVER_EVERY_S = 1.0  # how often the running sessions are looked over
HANDOVER_AFTER_S = 30.0  # a board gone this long no longer drafts for its sessions
MIN_TOKENS_LEFT = 16  # a session closer to its end than this stays as it is
MAX_PER_RUN = 16  # sessions handed over at once: a pause of the loop of a few milliseconds


@dataclass
class Candidate:
    """A running session to hand over, and why: "no_board" or "board_gone"."""

    act: ActiveSession
    ticket: Ticket
    reason: str


class Handover:
    """Hands the scheduler's running sessions over to attached drafters (``run``, between
    steps; the caller's thread owns the engine)."""

    def __init__(self, engine: SpecEngine, tickets: Callable[[], dict[str, Ticket]],
                 metrics=None, after_s: float = HANDOVER_AFTER_S,
                 every_s: float = HANDOVER_EVERY_S):
        self.engine = engine
        self.store: Any = engine.store  # a cache's (``possible``): its drafters, its hand-over
        self.tickets, self.metrics = tickets, metrics
        self.after_s, self.every_s = after_s, every_s
        self._next_at = 0.0
        self._gone_since: dict[str, float] = {}  # drafter -> when it was first seen gone
        self._said_down = False

    @staticmethod
    def possible(engine: SpecEngine) -> bool:
        """Whether ``engine`` can hand sessions over: its store a cache boards attach to, and
        no drafter of its own."""
        store = engine.store
        return engine.drafter is None and callable(getattr(store, "hand_over", None)) and \
            hasattr(store, "devices")

    def run(self, now: float | None = None) -> int:
        """Hand the engine's running sessions over where due, at most once every ``every_s``
        and ``MAX_PER_RUN`` at a time; returns how many were. Nothing while a step's verdicts
        wait for the store (a hand-over drops the draft a kept verdict accepted). A failure here
        fails no session: it is logged (once while it lasts) and tried again later."""
        now = time.monotonic() if now is None else now
        if now < self._next_at or self.engine.commits_undelivered:
            return 0
        self._next_at = now + self.every_s
        try:
            found = self.candidates(list(self.engine.sessions), now)
            done = self._hand_over(found[:MAX_PER_RUN]) if found else 0
        except Exception as e:  # the cache unreachable (the step says it), or a bug of its own
            if not self._said_down:
                log.warning("cannot hand sessions over to drafters now: %r", e)
            self._said_down = True
            return 0
        self._said_down = False
        return done

    def candidates(self, sessions: list[ActiveSession], now: float) -> list[Candidate]:
        """The running sessions to hand over: those without a drafter first, in admission
        order, then those whose drafter has been gone for ``after_s``."""
        tickets = self.tickets()
        boardless: list[Candidate] = []
        boarded: list[Candidate] = []
        for act in sessions:
            t = tickets.get(act.sid)
            if t is None or t.pinned or act.finish is not None or act.req.max_new_tokens - \
                    len(act.output) < MIN_TOKENS_LEFT:
                continue
            if act.drafter:
                boarded.append(Candidate(act, t, "board_gone"))
            else:
                boardless.append(Candidate(act, t, "no_board"))
        return boardless + self._orphans(boarded, now)

    def _orphans(self, boarded: list[Candidate], now: float) -> list[Candidate]:
        """Of ``boarded``, those whose drafter has not been attached for ``after_s``."""
        drafters = sorted({c.act.drafter for c in boarded})
        alive = self.store.devices.alive_many(drafters) if drafters else []
        since: dict[str, float] = {}
        for d, up in zip(drafters, alive):
            if not up:
                since[d] = self._gone_since.get(d, now)
        self._gone_since = since  # drafters back, or with no session here, forgotten
        return [c for c in boarded
                if c.act.drafter in since and now - since[c.act.drafter] >= self.after_s]

    def _hand_over(self, found: list[Candidate]) -> int:
        """``found`` handed to the drafters one reading of the fleet picks (no room: the rest
        wait for a later run)."""
        picked = self.store.devices.pick_many(len(found))  # each reserved until given back
        done = 0
        try:
            for c, device in zip(found, picked):
                act, previous = c.act, c.act.drafter
                if device == previous:  # its own board is back
                    continue
                got = self.store.hand_over(act.sid, device, previous)
                if got.owner is None or got.owner == previous:  # ended, or unsure, or the
                    continue  # board full: looked at again a second later
                # ``device``, or a drafter another replica, or this one's hand-over whose
                # reply was lost, gave it: the engine follows the cache, and the board it had
                # keeps its share of the drafts so far (credited if the session finishes)
                c.ticket.earlier_boards.append(
                    (previous, board_share(act.stats, c.ticket.earlier_boards)))
                act.hand_to(got.owner)
                c.ticket.device = got.owner
                if not got.moved:
                    continue
                done += 1
                if self.metrics is not None:
                    self.metrics.handed_over.labels(c.reason).inc()
                log.info("session %s handed to drafter %s (%s)", act.sid, device,
                         "it had none" if not previous else
                         f"drafter {previous} gone for {self.after_s:.0f} s or more")
        finally:
            for device in picked:  # the session sets count those handed over now
                self.store.devices.release(device)
        return done
