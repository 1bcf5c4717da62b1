"""A step's drafts: what each running session is asked for (``_plan``: the draft length and
branch tokens that pay, and whether its draft is worth a wait), what the store gives
(``_take``: it waits up to the deadline; each drafter's lateness recorded), and each session's
row of the forward (``_propose``: the drafter's draft, the verifier's own fill for a board's
empty one, a draft head's offer within the batch's token budget). ``StepDrafts`` is a part of
``SpecEngine`` (its base class, after ``StepCommit``): it reads the engine's store, drafters,
cost model and lateness rule, which the engine sets up.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

from ..config import MAX_TREE_NODES, verifies_trees
from ..drafters.adaptive import Prober
from ..protocol.contract import DraftWant, Proposal, Proposer, TakenDraft
from .draft_planner import ForwardCost, wait_worth
from .drafting_worth import REST, DraftingWorth
from .generation import ActiveSession, SessionFailed
from .inline_drafts import InlineDrafts
from .lateness import EmptyDrafts, Lateness
from .proposals import StepDraft, drafter_row, taken_row, with_head
from .stack_choice import SOURCES
from .step_commit import StepCommit
from .step_planning import plan_branch_budgets, plan_drafts, session_gains, told_wants


class StepDrafts(StepCommit):
    """The draft stages of ``SpecEngine.step`` (``_plan``, ``_take``, ``_propose``)."""

    cost: ForwardCost  # the measured cost of the verification forward
    prober: Prober  # a step planned without drafts verifies some now and then
    inline: InlineDrafts | None  # a cheap drafter drafting in the step's thread
    wait_ms: float  # the deadline for drafts on their way
    lateness: Lateness  # drafters not waited for
    proposers: list[Proposer]  # the sources of each step's drafts
    _asks: list[int]  # each taken draft's ask (``_take``), in their order
    worth: DraftingWorth | None  # rests a batch whose drafting measures slower than resting
    _regime: str | None  # this step's regime (``DraftingWorth.choose``; None: not chosen)

    def _plan(self) -> list[DraftWant]:
        """What to ask of each active session's draft: its length, and its share of branch
        tokens. Sessions with nothing to draft for them (no drafter in process, no head, no
        board: a server serving alone) are asked for nothing, without planning."""
        acts = self._step_acts = list(self.active)
        self._step_rows, self._regime = None, None
        if self.drafter is None and self.head is None and not any(a.drafter for a in acts):
            return self._rest(acts)
        if self.worth is not None:
            model = self.cost.model()
            plain = None if model is None else len(acts) / model.seconds(len(acts), 1)
            self._regime = self.worth.choose(len(acts), plain)
            if self._regime == REST:  # no probe either: the window of drafting measures again
                self.prober.probing = False
                return self._rest(acts)
        chains = self.drafter is not None and self.cfg.tree_width <= 1  # its drafts are chains
        gains = session_gains(acts, self._rows_of(acts), betas=not chains)
        # a probe's notice to the drafters: the drafter in process (its thread, or inline) drafts
        # for a commit at once, a board during the next step (``told_wants``)
        notice = 1 if self.drafter is not None else 2
        ks = plan_drafts(acts, self.cfg, self.cost, self.prober, gains, notice)
        # chains drafted here right before the take (``InlineDrafts``; an engine drafting in
        # process has no board): nothing is waited for (every draft is ready when taken, or
        # its drafter failed) and no branch planned
        settled = chains and self.inline is not None
        if not settled:  # what the branches and the waits weigh: the drafts as planned
            gains = gains.cut(ks)
        if chains:
            budgets = [0] * len(acts)
        else:
            budgets = plan_branch_budgets(acts, ks, self.cfg, self.cost, self.target.max_len,
                                          gains)
        # settled drafts are never waited for (each is ready when taken): their asks say no
        # wait, so that the take looks at none of them and no drafter's lateness counts one
        wait_s = 0.0 if settled else self.wait_ms / 1000
        # a probe is waited for (it measures); no wait (0 s) is worth weighing
        if self.cfg.adaptive and not self.prober.probing and wait_s > 0:
            # a board drafting anew after a fix holds nothing yet: without a wait its session
            # decodes one token this step; its draft is worth the wait the planner weighs
            # (less than a forward, once the forward's cost is fitted), however short the
            # deadline for drafts on their way
            fitted = self.cost.model() is not None
            caps = [math.inf if fitted and a.fixed and a.board_drafted else wait_s for a in acts]
            worth = wait_worth(gains, ks, self.cost, caps)
        else:
            worth = [wait_s] * len(acts)
        # a late drafter's turn to be waited for comes on a step that would wait for its
        # drafts: one that asks it for some, worth a wait (none without a deadline: every
        # worth is then 0)
        skip = self.lateness.not_waited_for({a.drafter for a, k, w in zip(acts, ks, worth)
                                             if a.drafter and k > 0 and w > 0}) \
            if wait_s > 0 else set()
        for a, told in zip(acts, told_wants(ks, self.prober, self.cfg.adaptive, notice)):
            a.wanted = told
        # (wait, wait_s) positional: a session's ask is made every step
        return [DraftWant(a.sid, k, b, k > 0 and w > 0 and a.drafter not in skip, w)
                for a, k, b, w in zip(acts, ks, budgets, worth)]

    @staticmethod
    def _rest(acts: list[ActiveSession]) -> list[DraftWant]:
        """Ask no session for a draft, and tell every drafter to rest (``Commit.wanted`` 0)."""
        for a in acts:
            a.wanted = 0
        return [DraftWant(a.sid, 0, 0, False) for a in acts]  # (branch_budget, wait)

    def _record_lateness(self, wants: list[DraftWant], taken: list,
                         acts: list[ActiveSession], wait_s: float) -> None:
        """Each drafter's step: were all its sessions' drafts ready when taken? And how many
        of its sessions had a ready draft, and a draft at all, and why the others held none
        (``EmptyDrafts``); ``wait_s``: the take's time, counted for each drafter a draft of
        which the step waited for."""
        # drafter -> [sessions, ready, with tokens, ready or with tokens, waited for, empty
        # drafts: at a session's opening, after a fix, again, otherwise]; a session asked no
        # draft says nothing of its drafter (its empty draft is trivially ready), nor one whose
        # drafter is not there (gone: its draft is ready, as waiting would give nothing)
        counts: dict[str, list] = {}
        for act, want, t in zip(acts, wants, taken):
            if want.k <= 0 or not isinstance(t, TakenDraft) or not t.drafting:
                continue
            drafter = act.drafter
            if not drafter:
                continue
            c = counts.get(drafter)
            if c is None:
                c = counts[drafter] = [0, 0, 0, 0, False, 0, 0, 0, 0]
            c[0] += 1
            c[1] += t.ready
            if t.tokens:  # a draft: useful, ready or not
                c[2] += 1
                c[3] += 1
                act.board_drafted, act.board_empty = True, False
            else:
                c[3] += t.ready
                c[5 if not act.board_drafted else 7 if act.board_empty else
                  6 if act.fixed else 8] += 1
                act.board_empty = True
            if want.wait:
                c[4] = True
        for drafter, (n, n_ready, n_drafts, n_useful, waited, *empty) in counts.items():
            self.lateness.record(drafter, n_ready == n, waited, (n, n_ready, n_drafts),
                                 useful=n_useful == n, waited_s=wait_s if waited else 0.0,
                                 empty=EmptyDrafts(*empty))

    def _take(self, wants: list[DraftWant]) -> list[tuple[ActiveSession, TakenDraft]]:
        """The store's drafts (it waits up to the deadline); a session the store lost, or
        holds at another position, fails alone. ``wants``: ``_plan``'s, one a planned
        session (``_step_acts``), in their order."""
        acts = self._step_acts
        if self.inline is not None:  # drafted here, now: the take finds them ready
            self.inline.draft(wants)
        t0 = time.perf_counter()  # the take's wait, as a drafter's lateness counts it
        # the deadline for drafts on their way, or longer for a draft worth more (a fix's)
        deadline = max([self.wait_ms / 1000, *(w.wait_s or 0.0 for w in wants if w.wait)])
        taken = self.store.take_when_ready(wants, deadline)
        if self.inline is None:  # drafted here, each draft ready when taken: nothing to learn
            self._record_lateness(wants, taken, acts, time.perf_counter() - t0)
        out, asked = [], []
        for act, want, t in zip(acts, wants, taken):
            if isinstance(t, Exception):
                self.fail(act, SessionFailed(str(t)))
            elif t.start != act.end:
                self.fail(act, SessionFailed(f"the cache holds {t.start} tokens of session "
                                             f"{act.sid}, the verifier {act.end}"))
            else:
                out.append((act, t))
                asked.append(want.k)
        self._asks = asked
        # what each draft held, as taken; not a probe's, told of only a step or two ahead (its
        # drafter rested before): what it finds measures acceptance, not a steady ask's supply
        if out and not self.prober.probing and any(asked):  # a row asked nothing says nothing
            self._rows_of([a for a, _ in out]).record(
                "supplied", np.array(asked, dtype=np.int64),
                np.array([len(t.tokens) for _, t in out], dtype=np.int64))
        return out

    def _propose(self, taken: list[tuple[ActiveSession, TakenDraft]]) -> list[StepDraft]:
        """Each session's row: every proposer's draft, the sources ``--auto`` leaves out
        dropped, the head's within what the batch's token budget leaves."""
        if self.head is None and not self.cfg.auto:  # the drafter's drafts alone: no offers
            rows = [taken_row(act, t) for act, t in taken]
            if self.fill is not None and rows:  # the boards' empty drafts, filled here
                rows = self.fill.fill(rows, self._asks, *self._room(rows))
            return rows
        asked = [{p.name: p.propose(act.sid, t) for p in self.proposers} for act, t in taken]
        offers: list[dict[str, tuple[int, ...] | None] | None] = [None] * len(taken)
        if self.cfg.auto:  # every source's proposal, verified or not
            offers = [{**dict.fromkeys(SOURCES), **{n: None if p is None else p.tokens
                                                     for n, p in props.items()}}
                      for props in asked]
            asked = [self._choose_sources(act, props, len(taken))
                     for (act, _), props in zip(taken, asked)]
        rows = [drafter_row(act, t, props.get("drafter"), o)
                for (act, t), props, o in zip(taken, asked, offers)]
        if self.head is None or not rows:  # no head's drafts to add: the drafter's rows
            return rows
        room, fits = self._room(rows)
        for i, props in enumerate(asked):  # the head's drafts, within the batch's token budget
            cap = min(room, MAX_TREE_NODES - rows[i].drafted, fits - rows[i].width)
            row = with_head(rows[i], props.get("head"), cap)
            room -= row.branch_tokens - rows[i].branch_tokens
            rows[i] = row
        return rows

    def _room(self, rows: Sequence[StepDraft]) -> tuple[int, int]:
        """What the rows leave for more draft tokens: the batch's token budget left, and the
        widest a row may be (every row of the forward is as wide as the widest: the fullest
        slot bounds them all)."""
        return (self.cfg.max_batch_tokens - sum(r.width for r in rows),
                min(self.target.max_len - r.start for r in rows))

    def _choose_sources(self, act: ActiveSession, proposals: dict[str, Proposal | None],
                        batch: int) -> dict[str, Proposal | None]:
        """--auto: the proposals of the sources this session's chooser keeps this step."""
        fixed, per_token = self.cost.fit() or (1.0, 0.05)
        costs = {"head": self.head.cost_s / batch} if self.head is not None else {}
        offered = {name: len(p.tokens) if p is not None else 0
                   for name, p in proposals.items()}
        if not verifies_trees(act.verify):
            offered["head"] = 0
        stack = act.chooser.choose(offered, fixed, per_token, costs)
        return {name: p for name, p in proposals.items() if name in stack}
