"""A verification step's first half, scoring: the step's rows built once, one forward over
them, and the verification's inputs (vLLM's one metadata record a step). The second half,
judging (``SpecEngine._judge``: ``edgespec.verify.verify_step`` over the scores), yields one
``Decision`` per row, each verdict cut where its output ends in the same pass
(``row_decisions``); nothing here or there changes the KV cache's committed state (so a
batch that fails can be verified again row by row): a tree's accepted path is moved into place
in the commit stage (``StepCommit._place``)."""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Sequence, Set
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..protocol.contract import Verdict
from ..protocol.frozen_value import frozen_value
from ..protocol.token_logprob import TokenLogprob
from ..runner.step_rows import DraftShape, Scored, StepRows
from ..verify.logit_adjust import step_adjust
from ..verify.token_logprobs import LogprobPick, emitted_columns, read_logprobs
from ..verify.verify_step import VerifyBatch, VerifyOutcome
from .decisions import Decision, decide
from .proposals import StepDraft

if TYPE_CHECKING:
    from ..pad.verify_rule import PadVerifier
    from ..runner.target_runner import TargetRunner

log = logging.getLogger("edgespec.engine")


@frozen_value
class ScoredStep:
    """A step's forward and what judging it reads."""

    drafts: list[StepDraft]  # as verified: a row whose draft held an id past the vocabulary
    # goes without it
    rows: StepRows
    scored: Scored  # logits [B, 1 + N, V] float32, features [B, 1 + N, H]
    batch: VerifyBatch
    pad: "PadVerifier | None"  # the PAD rule, when a row of the step verifies with it


def score_step(target: "TargetRunner", drafts: list[StepDraft], pad: "PadVerifier | None"
               ) -> ScoredStep:
    """One forward over the batch: as trees when a row branches, else as chains."""
    shape = _shape(drafts)
    outside = shape.rows_outside(target.vocab_size)
    if outside:  # a store let an id past: that row is verified without its draft
        log.warning("drafts of %d session(s) held token ids outside the vocabulary: "
                    "verified without them", len(outside))
        drafts = [replace(d, tokens=(), branches=(), head_offer=(), fill_offer=()) if i in outside
                  else d
                  for i, d in enumerate(drafts)]
        shape = _shape(drafts)
    acts = [d.act for d in drafts]
    slots = [a.slot for a in acts]
    lengths = target.cache.lengths
    rows = StepRows.build(slots=slots, starts=[lengths[s] for s in slots],
                          roots=[a.last_token for a in acts], shape=shape,
                          device=target.device)
    modes = [a.verify for a in acts]
    if pad is not None and "pad" not in modes:
        pad = None
    scored = target.score_rows(rows, tap=pad.tap if pad else None)
    params = [a.req.params for a in acts]
    batch = VerifyBatch.of_rows(rows, [d.start for d in drafts], params, modes)
    if any(p.adjusts_logits for p in params):  # penalties, logit bias: at every position
        batch.adjust = step_adjust([a.output for a in acts], [d.nodes() for d in drafts],
                                   params, target.device)
    return ScoredStep(drafts, rows, scored, batch, pad)


def _shape(drafts: list[StepDraft]) -> DraftShape:
    """The step's ``DraftShape`` of its rows' drafts: laid out as chains, from their tokens,
    when no row branches, else as trees from each row's (tokens, parents)."""
    if any(d.branches for d in drafts):
        return DraftShape.of([d.nodes() for d in drafts])
    return DraftShape.of_chains([d.tokens for d in drafts])


def row_decisions(drafts: Sequence[StepDraft], out: VerifyOutcome, stop_ids: Set[int]
                  ) -> list[Decision]:
    """Each row's verdict from the verification's outcome, decided in the same pass: the
    accepted path's chain tokens, then its branch, then the target's token, cut where the
    session's output ends (``decisions.decide``), the path and its lossy-kept flags beside it
    (the outcome's tuples, kept as they are)."""
    decided = []
    for d, path, token, kept in zip(drafts, out.paths, out.tokens, out.lenient):
        act = d.act
        room = act.req.max_new_tokens - len(act.output)
        if not d.branches:  # a chain: its path is its first nodes, all the drafter's
            # positional to ``wanted`` (no finish reason, branch or own branch): keywords
            # cost a verdict a quarter more, made for every row of every step
            verdict = Verdict(act.sid, d.epoch, d.start, len(path), token, "", (), False,
                              act.wanted)
            new = [*d.tokens[:len(path)], token]
            if len(new) < room and (not stop_ids or stop_ids.isdisjoint(new)):
                # nothing to cut (most rows): ``decide``'s answer, without its checks
                decided.append(Decision(d, verdict, path, kept, new))
                continue
        else:  # a branch's nodes (even one that extends the chain) follow the chain's
            n = bisect_left(path, len(d.tokens))  # the path's chain nodes come first
            tokens = d.nodes()[0]
            branch = tuple(tokens[i] for i in path[n:])
            verdict = Verdict(act.sid, d.epoch, d.start, n, token, branch=branch,
                              own_branch=bool(branch) and not d.kept_branch(n, branch),
                              wanted=act.wanted)
        decided.append(decide(d, verdict, room, stop_ids, path, kept))
    return decided


def with_logprobs(logits: torch.Tensor, decided: list[Decision]) -> list[Decision]:
    """``decided`` with each row whose session asked for logprobs (``Request.logprobs``)
    given its emitted tokens' (``verify.token_logprobs``), read in one call from the step's
    logits [B, T, V]; the rest as they are. A step with no such row returns at once."""
    asked = [i for i, d in enumerate(decided) if d.draft.act.logprobs is not None]
    if not asked:
        return decided
    picks = [LogprobPick(i, emitted_columns(decided[i].path, len(decided[i].new)),
                         decided[i].new, decided[i].act.req.logprobs or 0) for i in asked]
    out = list(decided)
    for i, entries in zip(asked, read_logprobs(logits, picks)):
        out[i] = replace(decided[i], logprobs=entries)
    return out


# the most positions of a prompt's part whose logits are read at once (``PromptScorer``): they
# are [T, V] float32, read once (a gather, a log-softmax: a few copies of them at the peak)
SCORED_CHUNK = 128


class PromptScorer:
    """A prompt's logprobs (``Request.prompt_logprobs``) read from its prefill's parts as the
    prefill queue writes them (``prefill_queue.PartReader``): position p's logits score
    ``prompt[p + 1]``, with ``top`` alternatives. The parts end at multiples of ``chunk`` (the
    keys, values and logits are the same bits however a prompt is cut: the kernels are
    batch-invariant); a resumed session's committed tokens, prefilled after its prompt, are
    read nothing."""

    def __init__(self, prompt: list[int], top: int, chunk: int):
        self.prompt, self.top, self.chunk = prompt, top, chunk
        self._parts: dict[int, list[TokenLogprob]] = {}  # a part's first position -> its own

    def reads(self, start: int) -> bool:
        return start + 1 < len(self.prompt)

    def read(self, start: int, logits: torch.Tensor) -> None:  # logits [1, T, V]
        cols = [c for c in range(logits.shape[1]) if start + c + 1 < len(self.prompt)]
        if cols:  # by its start: a part written again (a shared forward retried) replaces it
            pick = LogprobPick(0, cols, [self.prompt[start + c + 1] for c in cols], self.top)
            self._parts[start] = list(read_logprobs(logits, [pick])[0])

    def entries(self) -> list[TokenLogprob]:
        """Every prompt token's after the first, in order (once the whole prompt is in)."""
        return [e for start in sorted(self._parts) for e in self._parts[start]]
