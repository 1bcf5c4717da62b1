"""Model drafters: a small causal LM, or the target's own first L layers (layer-skip self-draft).

Both run on a ``TargetRunner`` with their own KV cache: one slot per draft session, rolled back by
its length pointer when the verifier sends a fix. Greedy sessions draft the argmax; sampling
sessions sample from their own processed distribution with the session seed's position-keyed
noise (``sampling.sample_sparse``), the same noise the verifier samples the target with, so a
drafted token is the target's own sample wherever the two distributions are close. The
top-``q_top_k`` truncated, renormalised q' still travels with each token (wire compatibility);
acceptance does not use it. Drafting stops early when the drafter's top q' probability falls
below ``min_confidence``.
"""

from __future__ import annotations

import torch

from ..config import SamplingParams
from ..runner import TargetRunner
from ..sampling import SparseQ, sample_sparse
from .base import Draft, Drafter, DraftSession


class ModelDraftSession(DraftSession):
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

    def propose(self, k: int) -> Draft:
        out: list[int] = []
        qs: list[SparseQ] = []
        min_conf = self.drafter.min_confidence
        for _ in range(k):
            if len(self.tokens) + 1 > self.runner.max_len:
                break
            feed = self.tokens[self.kv_len:]
            logits = self.runner.forward([self.slot], [feed], logits="last")[0]  # [V]
            self.kv_len += len(feed)
            self.runner.commit(self.slot, self.kv_len)
            if self.params.greedy:
                probs = logits.softmax(-1)
                conf, tok = torch.max(probs, -1)
                token, conf = int(tok), float(conf)
            else:
                # keyed by the absolute position the token will take: len(self.tokens)
                token, q = sample_sparse(logits, self.params, self.drafter.q_top_k,
                                         len(self.tokens))
                conf = max(q.probs)
            if out and conf < min_conf:  # the first token is always offered
                # forget the last fed position so the next proposal re-feeds the last token
                self.kv_len -= len(feed)
                self.runner.rollback(self.slot, self.kv_len)
                break
            out.append(token)
            self.tokens.append(token)
            if not self.params.greedy:
                qs.append(q)
        return Draft(tokens=out, q=None if self.params.greedy else qs)

    def rollback(self, length: int) -> None:
        super().rollback(length)
        if self.kv_len > max(0, length - 1):
            self.kv_len = max(0, length - 1)
            self.runner.rollback(self.slot, self.kv_len)

    def close(self) -> None:
        if self.slot is not None:
            self.runner.free_slot(self.slot)
            self.slot = None


class ModelDrafter(Drafter):
    wait_ms = 100.0  # a forward per drafted token
    def __init__(self, runner: TargetRunner, name: str = "model", q_top_k: int = 8,
                 min_confidence: float = 0.3):
        self.runner = runner
        self.name = name
        self.q_top_k = q_top_k
        self.min_confidence = min_confidence

    def open(self, tokens: list[int], params: SamplingParams) -> ModelDraftSession:
        return ModelDraftSession(self, tokens, params)
