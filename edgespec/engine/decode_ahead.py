"""Decode steps launched one step ahead: the host's work of a step overlapped with the device's
forward of the next, where nothing that forward reads waits for the host.

A step whose every row is a session's last token alone (no draft, no head, exact verification:
a server serving without boards, or a batch whose drafters rest because drafting measured
slower, ``drafting_worth``) commits exactly one token a session, the target's choice after its
root. The next step's rows are then known but for their tokens: the same slots, each one
position on, each root this step's choice, which the device holds before the host reads it. So
the engine queues that next forward right after this step's choices and their copy to the host,
before it waits for them (``launch``): the device runs it while the host reads this step's
verdicts, commits them, streams them and plans the next step, whose take then finds its forward
run (``claim``) and waits only for its choices. No token goes through the host on the way: the
roots are copied from the choices to the forward's inputs by the device (``StepRows.
with_device_roots``; a graph bucket copies them after its host copy). vLLM's asynchronous
scheduling and SGLang's overlap scheduler do the same for plain decoding.

The forward run ahead holds every row of the step that launched it. The next step claims the rows
of its sessions still where the launch put them (same slot, same positions); a session that
ended, failed or was cancelled meanwhile is dropped (its row's work is wasted, its slot written
one position past its end, which the slot's next owner writes before it reads there: its prefill,
or its forwards at their own positions, queued after this one). A session admitted meanwhile is
not in it: it waits for the next step, which is not launched ahead, so that it joins. Where the
next step verifies drafts after all (a resting batch's window of drafting begins), the forward is
dropped and the step runs its own. A claimed
step is a step like any other for what it emits: the same kernels over the same rows (graph
buckets, batch-invariant kernels), the same choices (greedy the argmax, sampled the keyed
sample at the row's position).

On a CPU a forward runs as it is called: there is nothing to overlap, and
``EngineConfig.decode_ahead`` (None: on CUDA) leaves it off there; tests turn it on to hold its
outputs to target-only decoding.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..runner.host_transfers import longs_to_device
from ..runner.step_rows import DraftShape, StepRows
from ..verify.verify_step import VerifyBatch, decode_choices
from .proposals import StepDraft

if TYPE_CHECKING:
    from ..runner.target_runner import TargetRunner
    from .generation import ActiveSession

log = logging.getLogger("edgespec.engine.decode_ahead")

FAILED_LAUNCHES_OFF = 3  # launches failing in a row turn decode-ahead off (logged once)


@dataclass(frozen=True)
class AheadStep:
    """A decode step's forward, launched before the host read the roots it decodes from."""

    # each row's session (the object: an id used again is another session) -> its row
    row_of: dict["ActiveSession", int]
    starts: list[int]  # each row's position: its session's committed end when it runs
    kv_starts: list[int]  # each slot's KV length then: where the forward stored the root
    choices: torch.Tensor  # [B] long on the device: each row's token, queued
    rows: StepRows  # the forward's inputs (kept until its choices are read)


@dataclass(frozen=True)
class Claim:
    """What a step takes of the forward run ahead: the rows of ``covered`` (in their order),
    and the drafts it does not cover, which wait for the next step."""

    ahead: AheadStep
    covered: list[StepDraft]
    index: list[int]  # each covered draft's row in ``ahead``
    waiting: list[StepDraft]

    def choices(self) -> torch.Tensor:
        """[len(covered)] long on the device: the covered rows' tokens (all of them in their
        order: the queued tensor itself)."""
        if self.index == list(range(len(self.ahead.row_of))):
            return self.ahead.choices
        [index] = longs_to_device([self.index], self.ahead.choices.device)  # no wait
        return self.ahead.choices.index_select(0, index)


class DecodeAhead:
    """The engine's forward run ahead (``pending``), launched and claimed step by step."""

    def __init__(self, target: "TargetRunner", enabled: bool):
        self.target, self.enabled = target, enabled
        self.pending: AheadStep | None = None
        # steps launched ahead, claimed by the next step, and dropped unclaimed
        self.launched = self.claimed = self.dropped = 0
        self._failed = 0  # launches failed in a row

    def launch(self, drafts: Sequence[StepDraft], roots: torch.Tensor) -> None:
        """Queue the forward of the decode step after ``drafts`` (a decode step's rows, not yet
        committed: their slots' KV lengths are where this step stored its roots), its roots
        ``roots`` [B] long on the device (this step's choices, queued), and its choices after
        it. A row that would pass its slot's
        end launches nothing (its session decodes in the next step as usual); a launch that
        raises is dropped (logged): the next step runs its own forward. A session this step
        ends by its length has no row (a step whose every session ends so launches nothing)."""
        self.drop()
        target = self.target
        keep = [i for i, d in enumerate(drafts)
                if d.act.req.max_new_tokens - len(d.act.output) > 1]
        if len(keep) < len(drafts):
            if not keep:
                return
            drafts = [drafts[i] for i in keep]
            [index] = longs_to_device([keep], roots.device)  # no wait
            roots = roots.index_select(0, index)
        acts = [d.act for d in drafts]
        slots = [a.slot for a in acts]
        kv_starts = [target.cache.lengths[s] + 1 for s in slots]  # one token on
        if max(kv_starts) + 1 > target.cache.max_len:
            return
        starts = [d.start + 1 for d in drafts]
        try:
            rows = StepRows.build(slots, kv_starts, [0] * len(acts),
                                  DraftShape.of_chains([()] * len(acts)), target.device)
            rows = rows.with_device_roots(roots)
            scored = target.score_rows(rows)
            batch = VerifyBatch.of_rows(rows, starts, [a.req.params for a in acts],
                                        ["exact"] * len(acts))
            choices = decode_choices(scored.logits, batch)
        except Exception:  # costs the overlap of one step, never a session
            self._failed += 1
            if self._failed < FAILED_LAUNCHES_OFF:
                log.exception("launching a decode step ahead failed: the next step runs its "
                              "own")
            else:
                self.enabled = False
                log.exception("launching a decode step ahead failed %d times in a row: "
                              "decode-ahead is off (each step runs its own forward)",
                              self._failed)
            return
        self._failed = 0
        self.pending = AheadStep({a: i for i, a in enumerate(acts)}, starts, kv_starts,
                                 choices, rows)
        self.launched += 1

    def claim(self, drafts: Sequence[StepDraft]) -> Claim | None:
        """The forward run ahead for this step's ``drafts``: the rows of the drafts it holds
        as they stand (the session's row, slot and positions, no draft token); None, dropping
        it, when it holds none of them, or when a row of the step verifies a draft (the
        drafters' rest ended: the step runs its own forward). Either way it is no longer
        pending."""
        ahead, self.pending = self.pending, None
        if ahead is None:
            return None
        if any(d.width > 1 for d in drafts):
            self.dropped += 1
            return None
        lengths = self.target.cache.lengths
        covered, index, waiting = [], [], []
        for d in drafts:
            i = ahead.row_of.get(d.act)
            if i is not None and d.start == ahead.starts[i] and \
                    lengths[d.act.slot] == ahead.kv_starts[i]:
                covered.append(d)
                index.append(i)
            else:
                waiting.append(d)
        if not covered:
            self.dropped += 1
            return None
        self.claimed += 1
        return Claim(ahead, covered, index, waiting)

    def drop(self) -> None:
        """Forget the forward run ahead (its work is wasted, nothing else)."""
        if self.pending is not None:
            self.pending = None
            self.dropped += 1
