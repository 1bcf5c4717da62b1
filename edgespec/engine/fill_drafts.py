"""The verifier's own cheap draft for a board's session whose draft is empty when a step takes it.

A board drafts behind the steps at times: while it reads a session's prompt, and after a fix,
until its redraft reaches the cache (``lateness.EmptyDrafts`` counts these by cause). Such a
step would verify the session's own token alone, one token for a forward whose cost its other
rows and its fixed part set. ``FillDrafts`` proposes a cheap drafter's tokens (MaG: a suffix
match over the session's committed tokens, microseconds on the server's core) for exactly those
rows: a session with a board (``ActiveSession.drafter``), asked for k > 0 tokens by the planner,
whose taken draft holds none. At most k tokens, and at most ``--tree-nodes`` (a fill is branch
tokens; 0: no fill), within what the step's token budget and the fullest slot leave.

The fill joins the row as a ``HeadBranch`` from the committed end, as a draft head's proposal
does: it is verified exactly as a board's draft is (as exact as the session's verification
mode; a session verified loosely, chains only, gets none), and what it gets accepted is committed
as the verifier's own branch, a fix to the board (which keeps a redraft that agrees with it:
``draft_lead.apply_fix``). A board's draft, when it has one, is never replaced.

Each session's draft session follows the session's committed tokens: opened on them the first
time the session needs a fill, then told what was committed since (learnt: ``confirm``) after
its last proposal is taken back (learnt nothing: ``retract``). A drafter that fails on a session
costs that session its fills, never the step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..config import MAX_TREE_NODES, verifies_trees
from ..drafters import Drafter, DraftSession
from .generation import ActiveSession
from .proposals import HeadBranch, StepDraft

log = logging.getLogger("edgespec.engine.fill_drafts")


@dataclass
class _Follower:
    """A session's draft session and the session it follows (an id used again is another
    session); ``synced``: the committed tokens it holds (a proposal may follow them)."""

    act: ActiveSession
    draft: DraftSession | None  # None: its drafter failed on it, no more fills
    synced: int


class FillDrafts:
    """Fills the empty board drafts of a step's rows with ``drafter``'s proposals (``fill``)."""

    def __init__(self, drafter: Drafter, most: int = MAX_TREE_NODES):
        """``most``: the most tokens a fill holds (``EngineConfig.tree_nodes``)."""
        self.drafter, self.most = drafter, min(most, MAX_TREE_NODES)
        self.sessions: dict[str, _Follower] = {}

    def fill(self, rows: Sequence[StepDraft], asks: Sequence[int], room: int,
             fits: int) -> list[StepDraft]:
        """``rows`` with each board session's empty draft filled: at most its ask (``asks[i]``,
        the planner's k), ``room`` draft tokens in all, and no row wider than ``fits`` tokens
        (the fullest slot's room)."""
        out = list(rows)
        for i, (row, k) in enumerate(zip(rows, asks)):
            if room <= 0:
                break
            act = row.act
            if k <= 0 or row.tokens or row.branches or not act.drafter or \
                    not verifies_trees(act.verify):
                continue
            cap = min(k, room, self.most, fits - row.width)
            tokens = self._propose(act, cap) if cap > 0 else ()
            if tokens:
                out[i] = replace(row, branches=(HeadBranch(0, tokens),), fill_offer=tokens)
                room -= len(tokens)
        return out

    def _propose(self, act: ActiveSession, k: int) -> tuple[int, ...]:
        entry = self._follower(act)
        if entry.draft is None:
            return ()
        try:
            self._sync(entry)
            return tuple(entry.draft.propose(k).tokens[:k])
        except Exception as exc:  # a broken drafter costs the session its fills, nothing more
            log.warning("the verifier's fill drafter failed on session %s (%r); its empty "
                        "drafts stay empty", act.sid, exc)
            self._close(entry)
            entry.draft = None
            return ()

    def _follower(self, act: ActiveSession) -> _Follower:
        entry = self.sessions.get(act.sid)
        if entry is not None and entry.act is act:
            return entry
        if entry is not None:
            self._close(entry)
        try:
            draft: DraftSession | None = self.drafter.open(act.req.prompt_ids + act.output,
                                                          act.req.params)
        except Exception as exc:
            log.warning("the verifier's fill drafter cannot open session %s (%r)", act.sid, exc)
            draft = None
        entry = self.sessions[act.sid] = _Follower(act, draft, act.end)
        return entry

    @staticmethod
    def _sync(entry: _Follower) -> None:
        """The draft session holds the session's committed tokens, and nothing past them."""
        s, act = entry.draft, entry.act
        assert s is not None
        s.retract(entry.synced)  # its last proposal, verified or not, taught nothing
        if act.end > entry.synced:
            prompt = len(act.req.prompt_ids)
            s.append(act.output[entry.synced - prompt:])
            s.confirm(act.end)
            entry.synced = act.end

    def forget(self, sid: str) -> None:
        """The session ended here (or moved elsewhere): its draft session is closed."""
        entry = self.sessions.pop(sid, None)
        if entry is not None:
            self._close(entry)

    @staticmethod
    def _close(entry: _Follower) -> None:
        if entry.draft is not None:
            try:
                entry.draft.close()
            except Exception as exc:  # a failing close costs nothing but the log line
                log.warning("closing a fill draft session failed: %r", exc)

    def close(self) -> None:
        for sid in list(self.sessions):
            self.forget(sid)


def resolve_fill(spec: str, serves_boards: bool, head: bool) -> str:
    """``--fill-drafts`` as the engine runs it: "auto" is "mag" for a verifier serving boards
    (a server's store, no drafter in process) with no draft head (nor --auto's), else "none"
    (why on by default: docs/measured/edge-vs-server, "The verifier's own MaG for a board's
    empty draft")."""
    if spec != "auto":
        return spec
    return "mag" if serves_boards and not head else "none"


def fill_drafter(spec: str) -> Drafter | None:
    """The fill's drafter for ``--fill-drafts`` (None: "none"; "auto" resolved first:
    ``resolve_fill``)."""
    if spec == "none":
        return None
    if spec == "mag":
        from ..drafters.mag import MaGDrafter

        return MaGDrafter()
    raise ValueError(f"--fill-drafts must be mag or none once resolved, got {spec!r}")
