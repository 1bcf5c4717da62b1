"""Cascades of drafters (CS Drafting's vertical and horizontal cascades, HSD's hierarchies).

``cascade:A,B,C``: A drafts for the target, B drafts for A, C for B (cheapest last, e.g. MaG).
Every member keeps its own session; after each step all of them hold the cascade's tokens.

Vertical: a member that can ``check`` (a model drafter) does not draft token by token. It asks
the members below it for a proposal and verifies it in one forward, keeping the prefix it agrees
with plus its own next token, so n agreeing tokens cost it one forward instead of n. In greedy
sessions that check may be lenient (``lenient_prob``: also keep a proposed token that is the
member's second choice with at least that probability). This is allowed between drafters only:
the target still verifies every token exactly, so leniency trades target acceptance for fewer
drafter forwards, never output. Sampled sessions check exactly against the member's keyed
sample (``token_choice.choose_token`` at the token's absolute position), the member's best guess at
the target's keyed sample.

Horizontal: past ``top_depth`` positions of a proposal, or once a checking member's own next
token falls below its confidence cut-off, the members below draft the rest of the proposal
unchecked: later positions are less likely to be accepted, so the cheaper drafter takes them.
A member that cannot check (mag, cacheback) drafts what it can; the members below fill the
remaining positions.

``level_stats`` reports, per adjacent pair of members, how much the lower one's proposals were
worth to the upper one, over the drafter's life.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..config import SamplingParams
from .base import Draft, Drafter, DraftSession


@dataclass
class _LevelCounts:
    proposed: int = 0  # tokens the lower member proposed to the upper one's checks
    accepted: int = 0  # of those, tokens the upper one kept
    checks: int = 0  # forwards the upper member ran to check
    filled: int = 0  # tokens the lower member drafted in the upper one's place (horizontal)


class CascadeSession(DraftSession):
    def __init__(self, drafter: "CascadeDrafter", sessions: list[DraftSession],
                 tokens: list[int], params: SamplingParams):
        super().__init__(tokens, params)
        self.drafter = drafter
        self.sessions = sessions  # one per member, top first

    def propose(self, k: int) -> Draft:
        draft = self._draft(0, k)
        self.tokens.extend(draft.tokens)
        return draft

    def _draft(self, level: int, k: int) -> Draft:
        """Up to k tokens drafted by the members from ``level`` down; every session from
        ``level`` down has them appended."""
        top = self.sessions[level]
        if k <= 0:
            return self._joined([])
        if level == len(self.sessions) - 1:
            return self._joined([top.propose(k)])
        if not top.can_check:
            own = top.propose(k)
            self._append_below(level, own.tokens)
            fill = self._fill(level, k - len(own))
            return self._joined([own, fill])

        d = self.drafter
        vertical = k if d.top_depth is None else min(k, d.top_depth)
        pieces: list[Draft] = []
        drafted = 0
        while drafted < vertical:
            # leave room for the checker's own token after a fully accepted proposal
            proposal = self._draft(level + 1, vertical - drafted - 1)
            checked = top.check(proposal.tokens, d.lenient_prob)
            n = checked.accepted
            kept = Draft(checked.tokens)
            if kept.tokens and not checked.confident and (drafted or n):
                # a doubtful own token is dropped, unless it is the only token of the proposal
                top.retract(len(top.tokens) - 1)
                kept = Draft(kept.tokens[:-1])
            below = len(self.sessions[level + 1].tokens) - len(proposal)
            self._retract_below(level, below + n)
            self._append_below(level, kept.tokens[n:])
            self.drafter.record(level, proposed=len(proposal), accepted=n, checks=1)
            pieces.append(kept)
            drafted += len(kept)
            if not checked.tokens:  # the member's context is full: nothing can follow
                return self._joined(pieces)
            if not checked.confident:
                break
        pieces.append(self._fill(level, k - drafted))
        return self._joined(pieces)

    def _fill(self, level: int, k: int) -> Draft:
        """The members below ``level`` draft k positions in its place (appended to it too)."""
        fill = self._draft(level + 1, k)
        self.sessions[level].append(fill.tokens)
        if fill.tokens:
            self.drafter.record(level, filled=len(fill))
        return fill

    def _append_below(self, level: int, tokens: list[int]) -> None:
        if tokens:
            for s in self.sessions[level + 1:]:
                s.append(tokens)

    def _retract_below(self, level: int, length: int) -> None:
        for s in self.sessions[level + 1:]:
            s.retract(length)

    def _joined(self, pieces: list[Draft]) -> Draft:
        """One draft of the pieces' tokens."""
        return Draft([t for p in pieces for t in p.tokens])

    def rollback(self, length: int) -> None:
        super().rollback(length)
        for s in self.sessions:
            s.rollback(length)

    def confirm(self, length: int) -> None:
        for s in self.sessions:
            s.confirm(length)

    def retract(self, length: int) -> None:
        super().rollback(length)
        for s in self.sessions:
            s.retract(length)

    def append(self, tokens: list[int]) -> None:
        super().append(tokens)
        for s in self.sessions:
            s.append(tokens)

    def close(self) -> None:
        errors = []
        for s in self.sessions:  # every member releases what it holds, whatever the others do
            try:
                s.close()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


class CascadeDrafter(Drafter):
    """Members top first: the first drafts for the target, each next one for the one before.
    ``lenient_prob``: lenient checks between members (greedy sessions; None: exact).
    ``top_depth``: positions of a proposal a checking member drafts before the members below
    take over (None: as long as it is confident)."""

    def __init__(self, members: list[Drafter], lenient_prob: float | None = None,
                 top_depth: int | None = None):
        if len(members) < 2 or any(m is None for m in members):
            raise ValueError("a cascade needs at least two drafters")
        if top_depth is not None and top_depth < 1:
            raise ValueError(f"top_depth must be >= 1, got {top_depth}")
        self.members = list(members)
        self.name = "cascade:" + ",".join(m.name for m in self.members)
        self.wait_ms = self.members[0].wait_ms
        self.uses_fleet = any(m.uses_fleet for m in self.members)
        self.cheap = all(m.cheap for m in self.members)
        self.lenient_prob, self.top_depth = lenient_prob, top_depth
        self._lock = threading.Lock()
        self._counts = [_LevelCounts() for _ in self.members[1:]]

    def open(self, tokens: list[int], params: SamplingParams) -> CascadeSession:
        sessions: list[DraftSession] = []
        try:
            for m in self.members:
                sessions.append(m.open(tokens, params))
        except BaseException:
            for s in sessions:
                s.close()
            raise
        return CascadeSession(self, sessions, tokens, params)

    def record(self, level: int, proposed: int = 0, accepted: int = 0, checks: int = 0,
               filled: int = 0) -> None:
        """Count what members ``level`` (upper) and ``level + 1`` (lower) did in one step."""
        with self._lock:
            c = self._counts[level]
            c.proposed += proposed
            c.accepted += accepted
            c.checks += checks
            c.filled += filled

    def level_stats(self) -> list[dict]:
        """Per adjacent pair, top first: ``upper``, ``lower`` (member names), ``proposed``
        (tokens the lower proposed to the upper's checks), ``accepted`` (kept by the upper),
        ``rate`` (accepted / proposed, 0 when nothing was proposed), ``checks`` (forwards the
        upper ran to check), ``saved_forwards`` (forwards the upper would have run to draft the
        accepted tokens itself), ``filled`` (tokens the lower drafted in the upper's place)."""
        with self._lock:
            counts = [_LevelCounts(**vars(c)) for c in self._counts]
        return [{"upper": up.name, "lower": low.name, "proposed": c.proposed,
                 "accepted": c.accepted, "rate": c.accepted / c.proposed if c.proposed else 0.0,
                 "checks": c.checks, "saved_forwards": c.accepted, "filled": c.filled}
                for up, low, c in zip(self.members, self.members[1:], counts)]

    def snapshot(self):
        return [m.snapshot() for m in self.members]

    def restore(self, state) -> None:
        for m, s in zip(self.members, state):
            m.restore(s)

    def use_fleet(self, table) -> None:
        for m in self.members:
            m.use_fleet(table)
