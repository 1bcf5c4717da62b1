"""Model drafters: a small causal LM, or the target's own first L layers (layer-skip self-draft).

Both run on a ``TargetRunner`` with their own KV cache: one slot per draft session, rolled back by
its length pointer when the verifier sends a fix. Drafting is ``logits_session``'s loop (greedy
sessions draft the argmax; sampling sessions draw the session's keyed sample from their own
processed distribution, ``token_choice``), stopping early below ``min_confidence``.

In a cascade a model session also ``check``s a cheaper drafter's proposal: one forward over the
proposal, keeping the longest prefix that equals its own choice at each position (its argmax, or
its keyed sample in sampling mode) plus its own next token, so a run of n agreeing tokens costs
one forward instead of n.
"""

from __future__ import annotations

import numpy as np

from ..config import SamplingParams
from ..runner.target_runner import TargetRunner
from .base import Checked, Drafter
from .logits_session import LogitsDraftSession
from .token_choice import choose_token, softmax, top_tokens


class ModelDraftSession(LogitsDraftSession):
    can_check = True
    drafter: ModelDrafter

    def __init__(self, drafter: "ModelDrafter", tokens: list[int], params: SamplingParams):
        super().__init__(tokens, params)
        self.drafter = drafter
        self.runner = drafter.runner
        self.slot: int | None = self.runner.new_slot()  # None once closed
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

    @property
    def _open_slot(self) -> int:
        assert self.slot is not None, "the session is closed"
        return self.slot

    def _max_len(self) -> int:
        return self.runner.max_len

    def _feed(self, feed: list[int]) -> np.ndarray:
        logits = self.runner.forward([self._open_slot], [feed], logits="last")[0]  # [V]
        self.kv_len += len(feed)
        self.runner.commit(self._open_slot, self.kv_len)
        return logits.float().cpu().numpy()

    def _unfeed(self, n: int) -> None:
        self.kv_len -= n
        self.runner.rollback(self._open_slot, self.kv_len)

    def check(self, proposal: list[int], lenient_prob: float | None = None) -> Checked:
        self._settle()  # the last token is fed with the proposal
        greedy = self.params.greedy
        start = len(self.tokens)  # absolute position of proposal[0]
        room = self.runner.max_len - start - 1
        if room < 0:
            return Checked(confident=False)
        proposal = list(proposal[:room])
        for i, tok in enumerate(proposal):  # never feed an id the embedding does not have
            if not 0 <= tok < self.runner.vocab_size:
                del proposal[i:]
                break
        feed = self.tokens[self.kv_len:] + proposal
        logits = self.runner.forward([self._open_slot], [feed], logits="all")[0]  # [len(feed), V]
        # [len(proposal) + 1, V]: row i -> start + i
        rows = logits[len(feed) - len(proposal) - 1:].float().cpu().numpy()
        tokens: list[int] = []
        conf = 0.0
        for i, row in enumerate(rows):
            token, conf, _ = choose_token(row, self.params, start + i)
            agrees = i < len(proposal) and (
                proposal[i] == token
                or (greedy and lenient_prob is not None
                    and _is_likely_second(row, proposal[i], lenient_prob)))
            tokens.append(proposal[i] if agrees else token)
            if not agrees:  # the own token: the first disagreement, or after the proposal
                break
        self.tokens.extend(tokens)
        self.kv_len = start + len(tokens) - 1  # the last token (own) is fed next time
        self.runner.commit(self._open_slot, self.kv_len)
        return Checked(tokens, accepted=len(tokens) - 1,
                       confident=conf >= self.drafter.min_confidence)

    def rollback(self, length: int) -> None:
        super().rollback(length)
        if self._holds_logits():  # the rollback removed nothing
            return
        if self.kv_len > max(0, length - 1):
            self.kv_len = max(0, length - 1)
            self.runner.rollback(self._open_slot, self.kv_len)

    def close(self) -> None:
        self._held = None
        if self.slot is not None:
            self.runner.free_slot(self.slot)
            self.slot = None


def _is_likely_second(logits: np.ndarray, token: int, min_prob: float) -> bool:
    """Whether ``token`` is the second most likely under logits [V], with >= ``min_prob``."""
    (_, _), (second, p) = top_tokens(softmax(logits.astype(np.float64)), 2)
    return second == token and p >= min_prob


class ModelDrafter(Drafter):
    wait_ms = 100.0  # a forward per drafted token

    def __init__(self, runner: TargetRunner, name: str = "model", min_confidence: float = 0.3,
                 branch_min_prob: float = 0.1):
        self.runner = runner
        self.name = name
        self.min_confidence = min_confidence
        self.branch_min_prob = branch_min_prob  # the least probability a tree branch needs

    def open(self, tokens: list[int], params: SamplingParams) -> ModelDraftSession:
        return ModelDraftSession(self, tokens, params)
