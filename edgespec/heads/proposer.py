"""A draft head as a proposer inside the verifier (``edgespec.engine.spec_engine``).

Each step, the verification forward's features of every session's accepted path extend that
session's context and the head drafts the next step's tokens, on the device, before the step's
one host sync (``edgespec.verify.verify_step``'s ``propose``). The next step verifies the head's
draft as a branch of the session's draft tree beside whatever a drafter sent (the branch starts
where the two first differ; with no draft it is the whole chain). A head draft is only a
proposal: verification decides, so outputs are the target's whatever the head says.
"""

from __future__ import annotations

import time
from itertools import takewhile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..protocol.contract import Proposal, TakenDraft
from .drafting import HeadContext, draft, next_context
from .modules import DraftHead

if TYPE_CHECKING:
    from .online import LearnSettings


PROBE_EVERY = 8  # --auto: steps between two drafts of a head no session chooses


class VerifierHead(Protocol):
    """What ``SpecEngine`` drives of a drafter inside the verifier: a draft head
    (``HeadProposer``) or imitation drafting (``heads.imitation_proposer``). Each step
    ``for_step`` gives ``verify_step``'s ``propose`` hook; once the accepted paths are in place
    ``after_step`` keeps each session's next draft, which ``propose`` hands to the next step."""

    name: str
    head: Any  # the network (status reports its cfg.kind)
    source: str
    version: int
    held_out: float
    depth: int
    cost_s: float
    learner: Any

    def start(self, sid: str, device, slot: int | None = None) -> None: ...

    def propose(self, session_id: str, taken: TakenDraft) -> Proposal | None: ...

    def for_step(self, sids: list[str], features: torch.Tensor, node_tokens: torch.Tensor,
                 depths: torch.Tensor, wanted: bool = True) -> Any: ...

    def after_step(self, sids: list[str], step: Any, path_lengths: list[int],
                   drafts: list[list[int]]) -> None: ...

    def offered(self, proposed: int, accepted: int) -> None: ...

    def finish(self, sid: str) -> None: ...

    def close(self) -> None: ...


@dataclass
class StepProposal:
    """One step's proposer: the sessions' contexts before it, and after it once run."""

    head: DraftHead
    contexts: list[HeadContext]
    features: torch.Tensor  # [B, 1 + N, H]: the step forward's rows
    node_tokens: torch.Tensor  # [B, N]
    depths: torch.Tensor  # [B, 1 + N]
    depth: int  # K: tokens drafted per session
    drafting: bool = True  # False: only the contexts move on (no session wants the head)
    after: list[HeadContext] = field(default_factory=list)
    seconds: float = 0.0  # what drafting took (host time: the device's on a CPU)

    def __call__(self, accepted: torch.Tensor, emitted: torch.Tensor) -> torch.Tensor:
        """``verify_step``'s ``propose``: [B, N] bool, [B] long -> [B, K] long (K = 0 when not
        drafting)."""
        N = accepted.shape[1]
        feats, toks, vis = next_context(
            torch.stack([c.features for c in self.contexts]),
            torch.stack([c.tokens for c in self.contexts]),
            torch.stack([c.visible for c in self.contexts]),
            self.features[:, :1 + N], self.node_tokens[:, :N].clamp_min(0),
            self.depths[:, :1 + N], accepted, emitted)
        self.after = [HeadContext(f, t, v) for f, t, v in zip(feats, toks, vis)]
        if not self.drafting:
            return torch.zeros(len(toks), 0, dtype=torch.long, device=toks.device)
        t0 = time.perf_counter()
        out = draft(self.head, feats, toks, vis, self.depth)
        self.seconds = time.perf_counter() - t0
        return out


class HeadProposer:
    """The verifier's head, a ``Proposer`` (``edgespec.protocol.contract``): each session's
    context and its draft for the next step, a ``StepProposal`` a step, and (with ``learn``) an
    ``OnlineLearner`` fed with every session's accepted pairs, which may swap in a better head
    (``version`` counts the swaps)."""

    name = "head"

    def __init__(self, head: DraftHead, depth: int | None = None, source: str = "",
                 learn: "bool | LearnSettings" = False):
        self.head = head
        self.max_depth = depth or head.cfg.depth
        self.depth = self.max_depth
        self._accepted = 1.0  # recent head tokens accepted per offer (decayed), optimistic
        self.cost_s = 0.0  # recent seconds a drafting step takes (decayed)
        self._idle_steps = 0  # steps since it last drafted
        self.source = source
        self.version = 0
        self.held_out = head.held_out
        self._contexts: dict[str, HeadContext] = {}  # session -> its accepted pairs so far
        # session -> the head's draft for its next step (None: the head did not draft)
        self._drafts: dict[str, tuple[int, ...] | None] = {}
        self.learner = None
        if learn:
            from .online import OnlineLearner

            self.learner = OnlineLearner(self, None if learn is True else learn)

    def start(self, sid: str, device, slot: int | None = None) -> None:
        """A new session: an empty context, no draft yet (``slot``: its KV slot, unused)."""
        self._contexts[sid] = HeadContext.empty(self.head.cfg.context, self.head.cfg.hidden,
                                                device)
        self._drafts[sid] = None

    def propose(self, session_id: str, taken: TakenDraft) -> Proposal | None:
        """The draft the head made for this session during the previous step (None: it did
        not draft then); each draft is proposed once."""
        tokens = self._drafts.get(session_id)
        self._drafts[session_id] = None
        return None if tokens is None else Proposal(tokens)

    def for_step(self, sids: list[str], features: torch.Tensor, node_tokens: torch.Tensor,
                 depths: torch.Tensor, wanted: bool = True) -> StepProposal:
        """The step's proposer over the batch's sessions ``sids`` (features [B, 1 + N, H],
        node_tokens [B, N], depths [B, 1 + N]). ``wanted``: some session of the batch chose
        the head's drafts (--auto); when none did, the head drafts only every PROBE_EVERY-th
        step, so that its acceptance keeps being measured while its cost is not paid."""
        self._idle_steps = 0 if wanted else self._idle_steps + 1
        drafting = wanted or self._idle_steps % PROBE_EVERY == 0
        return StepProposal(self.head, [self._contexts[s] for s in sids], features,
                            node_tokens, depths, self.depth, drafting)

    def after_step(self, sids: list[str], step: StepProposal, path_lengths: list[int],
                   drafts: list[list[int]]) -> None:
        """A step ran ``step``: each session's context moves on by its accepted path
        (``path_lengths[b]`` nodes, and the emitted token) and keeps the head's next draft
        (``drafts[b]``, -1 padded)."""
        if step.drafting:  # the drafting time, for --auto's cost model
            self.cost_s = step.seconds if self.cost_s == 0 else \
                0.9 * self.cost_s + 0.1 * step.seconds
        for sid, ctx, n, drafted in zip(sids, step.after, path_lengths, drafts):
            self._contexts[sid] = ctx
            self.observe(sid, ctx, n + 1)
            self._drafts[sid] = tuple(takewhile(lambda x: x >= 0, drafted)) \
                if step.drafting else None

    def offered(self, proposed: int, accepted: int) -> None:
        """A session's step took ``accepted`` of the head's ``proposed`` tokens: the depth the
        head drafts adapts to what lands (an autoregressive head pays per token it drafts:
        about 3 ms each for eagle on 2 CPU cores, so the 5th and 6th rarely pay)."""
        if proposed <= 0:
            return
        self._accepted = 0.95 * self._accepted + 0.05 * accepted
        self.depth = max(2, min(self.max_depth, round(2 * self._accepted) + 2))

    # -- learning ------------------------------------------------------------------------------
    def observe(self, sid: str, context: HeadContext, new_pairs: int) -> None:
        """A session's context after a step that added ``new_pairs`` accepted pairs."""
        if self.learner is not None and new_pairs > 0:
            self.learner.record(sid, context.features[-new_pairs:],
                                context.tokens[-new_pairs:])

    def finish(self, sid: str) -> None:
        self._contexts.pop(sid, None)
        self._drafts.pop(sid, None)
        if self.learner is not None:
            self.learner.finish(sid)

    def swap(self, head: DraftHead, held_out: float) -> None:
        """Serve ``head`` from the next step on (the learner found it better)."""
        self.head = head
        self.version += 1
        self.held_out = held_out

    def measured(self, held_out: float) -> None:
        self.held_out = held_out

    def close(self) -> None:
        if self.learner is not None:
            self.learner.close()
