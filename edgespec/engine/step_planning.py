"""How much each session drafts in a verification step: the draft tokens it verifies (and waits
for) and the branch tokens it may add, planned from the measured acceptance and forward cost
(``draft_planner``) within the step's token budget."""

from __future__ import annotations

from typing import Sequence

from ..config import EngineConfig, verifies_trees
from ..drafters.adaptive import Prober
from ..drafters.drafting_loop import lead_cap
from .draft_planner import ForwardCost, allocate, allocate_branches, probe_every
from .generation import ActiveSession

PROBE_TOKENS = 2  # the draft width of a probing step


def session_gains(acts: Sequence[ActiveSession]) -> list[list[float]]:
    """Each session's ``DraftLength.gains`` up to its cap, once a step: the gains of a shorter
    draft are their prefix."""
    return [a.draft_len.gains(a.draft_len.k) for a in acts]


def plan_drafts(acts: Sequence[ActiveSession], cfg: EngineConfig, cost: ForwardCost,
                prober: Prober, gains: Sequence[Sequence[float]] | None = None) -> list[int]:
    """Draft tokens each session verifies this step: its adaptive length, cut by the planner to
    the width that pays, then the batch capped at ``max_batch_tokens`` (one own token per
    session + drafts) by shortening the longest drafts first. A step planned without drafts is
    now and then (``prober``, as often as a probe costs at most ``draft_planner.PROBE_SHARE``
    of the steps' time) given a short one for every session, to measure acceptance again: all
    at once, since one row's draft widens every row. ``gains``: ``session_gains(acts)``."""
    ks = [a.draft_len.k for a in acts]
    if cfg.adaptive:
        gains = session_gains(acts) if gains is None else gains
        planned = allocate(gains, cost, [a.draft_len.holds(k) for a, k in zip(acts, ks)])
        prober.every = probe_every(cost, len(acts), PROBE_TOKENS)
        width = prober.planned(max(planned, default=0), PROBE_TOKENS)
        # no more than the session's drafter drafts ahead after the last ask (``lead_cap``):
        # a wider ask grows as the drafter's lead does, a step at a time
        ks = [min(k, max(p, width), lead_cap(a.wanted, cfg.window))
              for a, k, p in zip(acts, ks, planned)]
    budget = max(0, cfg.max_batch_tokens - len(ks))
    while sum(ks) > budget:
        ks[ks.index(max(ks))] -= 1
    return ks


def plan_branch_budgets(acts: Sequence[ActiveSession], ks: Sequence[int], cfg: EngineConfig,
                        cost: ForwardCost, max_len: int,
                        gains: Sequence[Sequence[float]] | None = None) -> list[int]:
    """Branch tokens each session may add this step: at most the step's tree budget
    (``tree_budget``), for exactly verified sessions with a chain; the planner keeps those that
    pay. ``gains``: ``session_gains(acts)``."""
    cap = tree_budget(acts, ks, cfg, max_len)
    caps = [cap if k and verifies_trees(a.verify) else 0 for a, k in zip(acts, ks)]
    if not cap or not cfg.adaptive:
        return caps
    gains = session_gains(acts) if gains is None else gains
    budgets = allocate_branches([a.draft_len.beta for a in acts], caps,
                                [g[:k] for g, k in zip(gains, ks)], list(ks), cost)
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
