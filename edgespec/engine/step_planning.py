"""How much each session drafts in a verification step: the draft tokens it verifies (and waits
for) and the branch tokens it may add, planned from the measured acceptance and forward cost
(``draft_planner``) within the step's token budget."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..config import EngineConfig, verifies_trees
from ..drafters.adaptive import Prober
from ..drafters.draft_rates import RowsOf
from ..drafters.draft_lead import lead_cap
from .draft_planner import BatchGains, ForwardCost, allocate, allocate_branches, probe_every
from .generation import ActiveSession

PROBE_TOKENS = 2  # the draft width of a probing step


def session_gains(acts: Sequence[ActiveSession], rows: RowsOf | None = None,
                  betas: bool = True) -> BatchGains:
    """Every session's ``DraftLength.gains`` and ``holds`` up to its cap (and, with ``betas``,
    its branches' ``beta``: a step that can verify none need not read them), read from the
    sessions' rows in one go, once a step: the gains of a shorter draft are their prefix.
    ``rows``: the sessions' ``RowsOf``, when read already."""
    rows = RowsOf([a.draft_len for a in acts]) if rows is None else rows
    caps = rows.values(len(acts), "k")
    return BatchGains(*rows.gains_holds(len(acts), caps), caps,
                      rows.values(len(acts), "beta") if betas else None)


def lead_caps(acts: Sequence[ActiveSession], window: int) -> np.ndarray:
    """[B]: ``draft_lead.lead_cap`` of each session: what its drafter holds ahead after the
    last ask (the whole window when none was made)."""
    return np.array([lead_cap(a.wanted, window) for a in acts], dtype=np.int64)


def output_caps(acts: Sequence[ActiveSession]) -> np.ndarray:
    """[B]: the most chain tokens each exactly verified session can use: one fewer than the
    tokens its output has left (the step's own token is the last, and an accepted draft token
    there would be cut to it), so no step verifies a chain past a request's end. A loosely
    verified session is not capped: its drafts past the end may confirm a mismatch before it
    (``verify.loose``'s window)."""
    return np.array([a.req.max_new_tokens - len(a.output) - 1 if a.verify != "loose"
                     else 1 << 30 for a in acts], dtype=np.int64)


def cap_to_budget(ks: np.ndarray, budget: int) -> np.ndarray:
    """ks cut to sum at most ``budget`` by shortening the longest first, one token at a time,
    the earliest of equals first: every k cut to a level c (the highest whose cut fits), and
    the last of those above c keep c + 1 with what the budget leaves."""
    if ks.sum() <= budget:
        return ks
    levels = np.minimum(ks[None], np.arange(int(ks.max()) + 1)[:, None]).sum(1)  # [max + 1]
    c = int(np.nonzero(levels <= budget)[0][-1])
    out = np.minimum(ks, c)
    above = np.nonzero(ks > c)[0]
    extra = budget - int(levels[c])
    if extra:
        out[above[len(above) - extra:]] += 1
    return out


def plan_drafts(acts: Sequence[ActiveSession], cfg: EngineConfig, cost: ForwardCost,
                prober: Prober, gains: BatchGains | None = None, notice: int = 2) -> list[int]:
    """Draft tokens each session verifies this step: its adaptive length, cut by the planner to
    the width that pays, and to what an exact session's output has room for (``output_caps``),
    then the batch capped at ``max_batch_tokens`` (one own token per session + drafts) by
    shortening the longest drafts first. A step planned without drafts is
    now and then (``prober``, as often as a probe costs at most ``draft_planner.PROBE_SHARE``
    of the steps' time) given a short one for every session, to measure acceptance again: all
    at once, since one row's draft widens every row. ``gains``: ``session_gains(acts)``;
    ``notice``: the steps before a probe that tell the drafters of it (``told_wants``): a probe
    once told of stays where it was, and the probe period shrinks no nearer than that."""
    gains = session_gains(acts) if gains is None else gains
    ks = gains.caps
    if cfg.adaptive:
        planned = np.array(allocate(gains, cost), dtype=np.int64)
        if not (prober.since and prober.due_within(notice)):  # told of: it stays where it is
            prober.every = max(probe_every(cost, len(acts), PROBE_TOKENS),
                               prober.since + 1 + notice)
        width = prober.planned(int(planned.max(initial=0)), PROBE_TOKENS)
        # no more than the session's drafter drafts ahead after the last ask (``lead_cap``):
        # a wider ask grows as the drafter's lead does, a step at a time
        ks = np.minimum(np.minimum(ks, np.maximum(planned, width)), lead_caps(acts, cfg.window))
    ks = np.maximum(np.minimum(ks, output_caps(acts)), 0)
    return cap_to_budget(ks, max(0, cfg.max_batch_tokens - len(ks))).tolist()


def told_wants(ks: Sequence[int], prober: Prober, adaptive: bool, notice: int = 2
               ) -> list[int]:
    """What each session's drafter is told the step asked of it (``draft_lead.lead_cap``
    reads it to size the drafter's lead): its ``ks`` at least 1, so that a session asked none
    in a batch that drafts keeps a short lead (its next ask grows from it); but 0 for every
    session when the adaptive planner wanted no draft this step (``plan_drafts``' ``prober``
    saw none planned and no probe: its count since runs on) and no probe is due within
    ``notice`` steps, which rests the drafters (no token drafted or pushed that no step would
    verify) until the ``notice`` steps before the next probe, which ask again. A board drafts
    for a commit while the next step runs, after that step's take, so it needs 2 (what it
    drafts for the commit two steps before the probe is taken there, kept by the commit
    between wherever its first token is the target's); a drafting thread in process drafts
    for a commit at once, while the step waits for a probe's drafts: 1. A step whose planner
    wanted drafts that the drafters' leads cut to 0 tells 1: their leads grow back."""
    if adaptive and max(ks, default=0) == 0 and prober.since > 0 and \
            not prober.due_within(notice):
        return [0] * len(ks)
    return [k if k > 1 else 1 for k in ks]  # (not max(1, k): a call a session and step)


def plan_branch_budgets(acts: Sequence[ActiveSession], ks: Sequence[int], cfg: EngineConfig,
                        cost: ForwardCost, max_len: int,
                        gains: BatchGains | None = None) -> list[int]:
    """Branch tokens each session may add this step: at most the step's tree budget
    (``tree_budget``), for exactly verified sessions with a chain; the planner keeps those that
    pay. ``gains``: ``session_gains(acts)``."""
    cap = tree_budget(acts, ks, cfg, max_len)
    if not cap:
        return [0] * len(acts)
    caps = [cap if k and verifies_trees(a.verify) else 0 for a, k in zip(acts, ks)]
    if not cfg.adaptive:
        return caps
    gains = session_gains(acts) if gains is None else gains
    assert gains.betas is not None  # session_gains reads them
    budgets = allocate_branches(gains.betas, caps, gains, list(ks), cost)
    return [a.draft_len.probe_branches(b, c) for a, b, c in zip(acts, budgets, caps)]


def tree_budget(acts: Sequence[ActiveSession], ks: Sequence[int], cfg: EngineConfig,
                max_len: int) -> int:
    """Branch tokens each exactly verified drafting session may add to this step's forward:
    an equal share of what ``max_batch_tokens`` leaves after the chains, at most
    ``tree_nodes``, and no more than the fullest KV slot of the batch has room for (the tree
    forward writes 1 + k + branch budget positions for every row)."""
    drafting = sum(1 for a, k in zip(acts, ks) if k and verifies_trees(a.verify))
    if not drafting or not cfg.tree_nodes:
        return 0
    left = cfg.max_batch_tokens - len(ks) - sum(ks)
    room = min(max_len - a.end for a in acts) - 1 - max(ks)
    return max(0, min(cfg.tree_nodes, left // drafting, room))
