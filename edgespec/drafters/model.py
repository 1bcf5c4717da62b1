"""Model drafters: a small causal LM, or the target's own first L layers (layer-skip self-draft).

Both run on a ``TargetRunner`` with their own KV cache: one slot per draft session, rolled back by
its length pointer when the verifier sends a fix. Greedy sessions draft the argmax; sampling
sessions sample from their own processed distribution with the session seed's position-keyed
noise (``sampling.sample_sparse``), the same noise the verifier samples the target with, so a
drafted token is the target's own sample wherever the two distributions are close. The
top-``q_top_k`` truncated, renormalised q' still travels with each token (wire compatibility);
acceptance does not use it. Drafting stops early when the drafter's top q' probability falls
below ``min_confidence``.

In a cascade a model session also ``check``s a cheaper drafter's proposal: one forward over the
proposal, keeping the longest prefix that equals its own choice at each position (its argmax, or
its keyed sample in sampling mode) plus its own next token, so a run of n agreeing tokens costs
one forward instead of n.

Token trees (``propose_tree``): the chain is ``propose``'s, token for token (the same
``choose_token``), and the branches come from the logits its forwards already computed, with no
forward of their own: at each drafted position the drafter's next most likely tokens (greedy:
its softmax; sampling: the q' the token was drawn from), each a one-token branch when its
probability is at least ``branch_min_prob``. Of those, the ``width`` - 1 with the highest path
probability (the chain's token probabilities before the position times the alternative's) are
kept, best first; so early positions, which are the likelier to be reached, are preferred.
"""

from __future__ import annotations

import torch

from ..config import SamplingParams
from ..runner import TargetRunner
from ..sampling import SparseQ, sample_sparse
from .base import Branch, Checked, Draft, Drafter, DraftSession


def choose_token(logits: torch.Tensor, params: SamplingParams, q_top_k: int, pos: int
                 ) -> tuple[int, float, SparseQ | None]:
    """A language-model drafter's token at absolute position ``pos`` from its logits [V], its
    top probability, and (sampling) the q' it was drawn from: the argmax when greedy, else the
    session's keyed sample (``sample_sparse``)."""
    if params.greedy:
        conf, tok = torch.max(logits.softmax(-1), -1)
        return int(tok), float(conf), None
    token, q = sample_sparse(logits, params, q_top_k, pos)
    return token, max(q.probs), q


class BranchPicker:
    """Collects a model draft's one-token alternatives position by position (``add``) and keeps
    the ``max_branches`` most likely to be on the target's path (``branches``)."""

    def __init__(self, max_branches: int, min_prob: float):
        self.max_branches, self.min_prob = max_branches, min_prob
        self.reach = 1.0  # the drafter's probability of the chain so far
        self.candidates: list[tuple[float, int, int]] = []  # (path probability, at, token)

    def add(self, at: int, logits: torch.Tensor, q: SparseQ | None, token: int) -> None:
        """Draft position ``at`` chose ``token`` from ``logits`` [V] (greedy, q None) or from
        the sampled q'."""
        n = self.max_branches + 1
        if q is None:
            probs = logits.float().softmax(-1)
            top = torch.topk(probs, min(n, probs.shape[-1]))
            pairs = list(zip(top.indices.tolist(), top.values.tolist()))
            p_token = float(probs[token])
        else:
            pairs = sorted(zip(q.ids, q.probs), key=lambda x: -x[1])[:n]
            p_token = dict(zip(q.ids, q.probs)).get(token, 0.0)
        for alt, p in pairs:
            if alt != token and p >= self.min_prob:
                self.candidates.append((self.reach * p, at, alt))
        self.reach *= p_token

    def branches(self) -> list[Branch]:
        best = sorted(self.candidates, key=lambda c: (-c[0], c[1]))[: self.max_branches]
        return [Branch(at, (token,)) for _, at, token in best]


class LogitsDraftSession(DraftSession):
    """The drafting loop of drafters that choose each token from their own logits (the torch
    model drafter, llama.cpp's): feed the tokens not yet cached, choose the next token
    (``choose_token``), stop at low confidence, and collect one-token branches for trees.
    Subclasses keep ``kv_len`` and provide ``_max_len``, ``_feed`` and ``_unfeed``; their
    ``drafter`` has ``min_confidence``, ``q_top_k`` and ``branch_min_prob``."""

    kv_len: int  # positions of self.tokens[:kv_len] are cached; the last token is fed next

    def _max_len(self) -> int:
        """The most tokens a session holds."""
        raise NotImplementedError

    def _feed(self, feed: list[int]) -> torch.Tensor:
        """Run ``feed`` after the cached positions and cache it; the logits [V] after it."""
        raise NotImplementedError

    def _unfeed(self, n: int) -> None:
        """Forget the last ``n`` cached positions."""
        raise NotImplementedError

    def propose(self, k: int) -> Draft:
        return self._propose(k, 1)

    def propose_tree(self, k: int, width: int) -> Draft:
        return self._propose(k, width)

    def _propose(self, k: int, width: int) -> Draft:
        out: list[int] = []
        qs: list[SparseQ] = []
        min_conf = self.drafter.min_confidence
        picker = BranchPicker(width - 1, self.drafter.branch_min_prob) if width > 1 else None
        for _ in range(k):
            if len(self.tokens) + 1 > self._max_len():
                break
            feed = self.tokens[self.kv_len:]
            logits = self._feed(feed)
            # keyed by the absolute position the token will take: len(self.tokens)
            token, conf, q = choose_token(logits, self.params, self.drafter.q_top_k,
                                          len(self.tokens))
            if out and conf < min_conf:  # the first token is always offered
                # forget the last fed position so the next proposal re-feeds the last token
                self._unfeed(len(feed))
                break
            if picker is not None:
                picker.add(len(out), logits, q, token)
            out.append(token)
            self.tokens.append(token)
            if not self.params.greedy:
                qs.append(q)
        return Draft(tokens=out, q=None if self.params.greedy else qs,
                     branches=picker.branches() if picker is not None else [])


class ModelDraftSession(LogitsDraftSession):
    can_check = True

    def __init__(self, drafter: "ModelDrafter", tokens: list[int], params: SamplingParams):
        super().__init__(tokens, params)
        self.drafter = drafter
        self.runner = drafter.runner
        self.slot = self.runner.new_slot()
        # positions of self.tokens[:kv_len] are in the cache; the last token is always fed next
        self.kv_len = 0
        if len(tokens) > 1:
            try:
                self.runner.prefill(self.slot, tokens[:-1])
            except BaseException:  # e.g. a prompt longer than the drafter's context
                self.runner.free_slot(self.slot)
                self.slot = None
                raise
            self.kv_len = len(tokens) - 1

    def _max_len(self) -> int:
        return self.runner.max_len

    def _feed(self, feed: list[int]) -> torch.Tensor:
        logits = self.runner.forward([self.slot], [feed], logits="last")[0]  # [V]
        self.kv_len += len(feed)
        self.runner.commit(self.slot, self.kv_len)
        return logits

    def _unfeed(self, n: int) -> None:
        self.kv_len -= n
        self.runner.rollback(self.slot, self.kv_len)

    def check(self, proposal: list[int], lenient_prob: float | None = None) -> Checked:
        greedy = self.params.greedy
        start = len(self.tokens)  # absolute position of proposal[0]
        room = self.runner.max_len - start - 1
        if room < 0:
            return Checked(q=None if greedy else [], confident=False)
        proposal = list(proposal[:room])
        for i, tok in enumerate(proposal):  # never feed an id the embedding does not have
            if not 0 <= tok < self.runner.vocab_size:
                del proposal[i:]
                break
        feed = self.tokens[self.kv_len:] + proposal
        logits = self.runner.forward([self.slot], [feed], logits="all")[0]  # [len(feed), V]
        rows = logits[len(feed) - len(proposal) - 1:]  # [len(proposal) + 1, V]: row i -> start + i
        tokens: list[int] = []
        qs: list[SparseQ] = []
        conf = 0.0
        for i, row in enumerate(rows):
            token, conf, q = choose_token(row, self.params, self.drafter.q_top_k, start + i)
            qs.append(q)
            agrees = i < len(proposal) and (
                proposal[i] == token
                or (greedy and lenient_prob is not None
                    and _is_likely_second(row, proposal[i], lenient_prob)))
            tokens.append(proposal[i] if agrees else token)
            if not agrees:  # the own token: the first disagreement, or after the proposal
                break
        self.tokens.extend(tokens)
        self.kv_len = start + len(tokens) - 1  # the last token (own) is fed next time
        self.runner.commit(self.slot, self.kv_len)
        return Checked(tokens, None if greedy else qs, accepted=len(tokens) - 1,
                       confident=conf >= self.drafter.min_confidence)

    def rollback(self, length: int) -> None:
        super().rollback(length)
        if self.kv_len > max(0, length - 1):
            self.kv_len = max(0, length - 1)
            self.runner.rollback(self.slot, self.kv_len)

    def close(self) -> None:
        if self.slot is not None:
            self.runner.free_slot(self.slot)
            self.slot = None


def _is_likely_second(logits: torch.Tensor, token: int, min_prob: float) -> bool:
    """Whether ``token`` is the second most likely under logits [V], with >= ``min_prob``."""
    top = torch.topk(logits.softmax(-1), 2)
    return int(top.indices[1]) == token and float(top.values[1]) >= min_prob


class ModelDrafter(Drafter):
    wait_ms = 100.0  # a forward per drafted token
    def __init__(self, runner: TargetRunner, name: str = "model", q_top_k: int = 8,
                 min_confidence: float = 0.3, branch_min_prob: float = 0.1):
        self.runner = runner
        self.name = name
        self.q_top_k = q_top_k
        self.min_confidence = min_confidence
        self.branch_min_prob = branch_min_prob  # the least probability a tree branch needs

    def open(self, tokens: list[int], params: SamplingParams) -> ModelDraftSession:
        return ModelDraftSession(self, tokens, params)
