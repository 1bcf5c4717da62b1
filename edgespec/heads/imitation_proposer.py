"""Imitation drafting inside the verifier (``--drafter imitation:DIR``): the target drafts for
itself through its first L layers, the imitation network (``heads.imitation``) and its own final
norm and LM head, in its own KV cache. No other process and no other cache.

After a verification step has compacted every session's accepted path into place (each slot's
length at the emitted token's position), the proposer feeds the emitted token through layers
1..L of the target, in the target's KV slots, then each drafted token after it: one L-layer
forward per draft token for the whole batch (greedy; a session's chain goes no deeper once
its token's probability falls below ``min_prob``), with, where ``widths`` asks, the forward's
next likeliest tokens as alternatives beside each chain token. The next step verifies the
draft as the head's branches (``engine.proposals.with_head``), so outputs are the target's
whatever the network says.

KV: drafting reads the layers 1..L keys/values the verification forward wrote for the committed
context (no draft cache to keep in step, no catch-up feeding of accepted tokens as a separate
``layers:L`` drafter pays) and writes those layers' keys/values for its own tokens past the
committed length. Verification does not reuse them: its forward runs all layers over the root
and the draft again and overwrites them (the same bits where the tokens are the same, since the
kernels are batch-invariant). LayerSkip's saving (verification starting at layer L + 1 for
drafted tokens) is not taken; on a CPU a forward over a few more rows costs little more than
over one, so it would save little of a step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..protocol.contract import Branch, Proposal, TakenDraft
from .imitation import ImitationNet

MIN_PROB = 0.3  # a session's chain stops after a token the network gives less than this
# alternatives verified beside the chain token at each depth (the last repeats). None by
# default: on this CPU a tree's branch nodes cost the verification forward 1.5-2.5 ms each
# (their decoding-order attention tail), more than the acceptance they add (docs/heads.md)
WIDTHS = (0,)


class ImitationStep:
    """One verification step's hook (``verify_step``'s ``propose``): it only keeps the emitted
    tokens; drafting waits until the accepted paths are compacted (``after_step``)."""

    def __init__(self, drafting: bool):
        self.drafting = drafting
        self.emitted: torch.Tensor | None = None  # [B] long

    def __call__(self, accepted: torch.Tensor, emitted: torch.Tensor) -> torch.Tensor:
        """[B, N] bool, [B] long -> [B, 0]: no draft inside the step."""
        self.emitted = emitted
        return torch.zeros(len(emitted), 0, dtype=torch.long, device=emitted.device)


@torch.no_grad()
def imitation_draft(net: ImitationNet, runner, slots: list[int], first: list[int],
                    starts: list[int], depth: int, min_prob: float = MIN_PROB,
                    widths: Sequence[int] = WIDTHS) -> list[Proposal]:
    """Each session's draft after token ``first[b]`` at position ``starts[b]`` of slot
    ``slots[b]``: a greedy chain of up to ``depth`` target token ids, one L-layer forward per
    chain token, and at chain position j the next ``widths[j]`` most likely tokens of the same
    forward (the last width repeats) as one-token branches beside it. The chain goes one
    forward deeper only while its last token's probability is at least ``min_prob``. Writes
    layers 1..L's keys/values at positions starts[b].. (past the committed length:
    verification overwrites them)."""
    L = net.cfg.exit_layer
    chains: list[list[int]] = [[] for _ in slots]
    branches: list[list[Branch]] = [[] for _ in slots]
    live = [b for b in range(len(slots)) if starts[b] + 1 < runner.max_len]
    last = list(first)
    for j in range(depth):
        live = [b for b in live if starts[b] + j + 1 < runner.max_len]
        if not live:
            break
        tokens = torch.as_tensor([[last[b]] for b in live], dtype=torch.long,
                                 device=runner.device)  # [b, 1]
        h = runner.early_hidden([slots[b] for b in live], tokens,
                                [starts[b] + j for b in live], L)  # [b, 1, H]
        probs = net.logits(net.features(h[:, 0].float())).softmax(-1)  # [b, Vd]
        width = widths[min(j, len(widths) - 1)] if widths else 0
        top = probs.topk(min(1 + width, probs.shape[-1]), dim=-1)
        ids = net.target.vocab_ids[top.indices].tolist()  # [b, 1 + width] target ids
        confident = (top.values[:, 0] >= min_prob).tolist()
        keep = []
        for b, row, sure in zip(live, ids, confident):
            chains[b].append(row[0])
            branches[b].extend(Branch(j, (t,)) for t in row[1:])
            last[b] = row[0]
            if sure:
                keep.append(b)
        live = keep
    return [Proposal(tuple(c), tuple(br)) for c, br in zip(chains, branches)]


class ImitationProposer:
    """The verifier's imitation drafter, a ``Proposer`` (``edgespec.protocol.contract``) with
    the head surface ``SpecEngine`` drives (``heads.proposer.VerifierHead``)."""

    name = "head"

    def __init__(self, net: ImitationNet, runner, depth: int | None = None, source: str = "",
                 min_prob: float = MIN_PROB, widths: Sequence[int] = WIDTHS):
        self.head = net  # what status reports (its cfg.kind)
        self.runner = runner
        self.max_depth = depth or net.cfg.depth
        self.depth = self.max_depth
        self.min_prob = min_prob
        if any(w < 0 for w in widths):
            raise ValueError(f"widths are alternatives per depth, >= 0: got {tuple(widths)}")
        self.widths = tuple(widths)
        self._accepted = 1.0
        self.cost_s = 0.0  # recent seconds a drafting step takes (decayed)
        self._idle_steps = 0
        self.source = source
        self.version = 0
        self.held_out = net.held_out
        self.learner = None  # never learns online
        self._slots: dict[str, int] = {}
        self._drafts: dict[str, Proposal | None] = {}

    def start(self, sid: str, device, slot: int | None = None) -> None:
        if slot is None:
            raise ValueError("imitation drafting needs the session's KV slot")
        self._slots[sid] = slot
        self._drafts[sid] = None

    def propose(self, session_id: str, taken: TakenDraft) -> Proposal | None:
        draft = self._drafts.get(session_id)
        self._drafts[session_id] = None
        return draft

    def for_step(self, sids: list[str], features: torch.Tensor, node_tokens: torch.Tensor,
                 depths: torch.Tensor, wanted: bool = True) -> ImitationStep:
        """The step's hook; when no session of the batch wants the drafts (--auto) it drafts
        only every 8th step, to keep measuring them."""
        self._idle_steps = 0 if wanted else self._idle_steps + 1
        return ImitationStep(wanted or self._idle_steps % 8 == 0)

    def after_step(self, sids: list[str], step: ImitationStep, path_lengths: list[int],
                   drafts: list[list[int]]) -> None:
        """The step's accepted paths are in place: draft every session's next tokens."""
        if not step.drafting or step.emitted is None:
            for sid in sids:
                self._drafts[sid] = None
            return
        t0 = time.perf_counter()
        slots = [self._slots[s] for s in sids]
        starts = [self.runner.cache.lengths[s] for s in slots]
        made = imitation_draft(self.head, self.runner, slots, step.emitted.tolist(), starts,
                               self.depth, self.min_prob, self.widths)
        seconds = time.perf_counter() - t0
        self.cost_s = seconds if self.cost_s == 0 else 0.9 * self.cost_s + 0.1 * seconds
        for sid, tokens in zip(sids, made):
            self._drafts[sid] = tokens if tokens.tokens else None

    def offered(self, proposed: int, accepted: int) -> None:
        """The depth follows what lands (each draft token costs an L-layer forward)."""
        if proposed <= 0:
            return
        self._accepted = 0.95 * self._accepted + 0.05 * accepted
        self.depth = max(2, min(self.max_depth, round(2 * self._accepted) + 2))

    def finish(self, sid: str) -> None:
        self._slots.pop(sid, None)
        self._drafts.pop(sid, None)

    def measured(self, held_out: float) -> None:
        self.held_out = held_out

    def close(self) -> None:
        pass
