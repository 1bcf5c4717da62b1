"""Making PAD's labels with the target runner (``labels`` describes what is saved).

For each train problem, shard by shard:

1. the target answers greedily and ``rollouts`` times sampled (all problems of the shard decoded
   together in the runner's slots); a problem the samples get right at most ``skip_at`` of the
   time is skipped (PAD: the target mostly fails it, so no token of it can be blamed);
2. one forward of the target over prompt + greedy answer, tapped, gives every answer position's
   hidden state, entropy and distribution; one forward of the drafter over the same tokens its
   greedy token at each position; positions where they differ are candidates (at most
   ``max_candidates`` a problem, chosen by the seed);
3. for each candidate, ``rollouts`` continuations are sampled from prefix + draft token and as
   many from prefix + target token (every candidate of the shard in one batch) and scored.

Every sampled continuation draws from its own generator seeded by (seed, problem, position,
side, draw), so a resumed or repeated run makes the same labels.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .classifier import position_inputs
from .labels import Candidates, LabelInfo, finished_shards, save_shard
from .rollouts import Continuation, answer_text, decode_all
from .tasks import TaskSet


@dataclass(frozen=True)
class _Candidate:
    problem: int  # index in the task set
    position: int  # answer token index
    prefix: list[int]  # the greedy answer's tokens before it
    draft_token: int
    target_token: int
    features: torch.Tensor  # [H] float32
    entropy: float
    token_prob: float


def _seed(*parts: int) -> int:
    """A generator seed from integers (stable across runs and platforms)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFF)) * 1099511628211) % (1 << 61)
    return h


class Labeller:
    """Labels a task set's problems with a target runner and a drafter runner (a
    ``TargetRunner`` over the first L layers, or over a draft model with the same tokenizer)."""

    def __init__(self, runner, drafter, tokenizer, stop_ids: set[int], tasks: TaskSet,
                 encode: Callable[[str], list[int]], info: LabelInfo):
        self.runner, self.drafter, self.tokenizer = runner, drafter, tokenizer
        self.stop_ids, self.tasks, self.encode, self.info = set(stop_ids), tasks, encode, info
        self.prompts = [encode(p.prompt) for p in tasks.problems]

    def run(self, folder: Path, deadline: float | None = None,
            say: Callable[[str], None] = print) -> bool:
        """Make the missing shards in order; False when the deadline stopped it first."""
        info = self.info
        first = finished_shards(folder, info)
        if first:
            say(f"labels: resuming after {first} of {info.shards} finished shards")
        t0 = time.monotonic()
        for n in range(first, info.shards):
            problems = list(range(n * info.per_shard,
                                  min(info.problems, (n + 1) * info.per_shard)))
            made = self.label_shard(problems, deadline)
            if made is None:
                return False
            cands, success = made
            save_shard(folder, n, cands, problems, success)
            spent = time.monotonic() - t0
            left = (info.shards - n - 1) * spent / (n + 1 - first)
            say(f"labels: shard {n + 1}/{info.shards}, {len(cands)} candidates, success "
                f"{sum(success) / len(success):.2f}, ETA {left / 60:.1f} min")
        return True

    @torch.inference_mode()
    def label_shard(self, problems: list[int], deadline: float | None
                    ) -> tuple[Candidates, list[float]] | None:
        """The shard's candidates and the target's success rate on each problem; None at the
        deadline."""
        info = self.info
        R, T = info.rollouts, info.temperature
        todo = []
        for i in problems:
            ids = self.prompts[i]
            todo.append(Continuation(ids, len(ids), 0.0, 0))
            todo += [Continuation(ids, len(ids), T, _seed(info.seed, i, r)) for r in range(R)]
        news = decode_all(self.runner, self.stop_ids, todo, info.max_new_tokens, deadline)
        if news is None:
            return None
        found: list[_Candidate] = []
        success = []
        for k, i in enumerate(problems):
            base = k * (R + 1)
            rate = self._success(i, todo[base + 1:base + 1 + R], news[base + 1:base + 1 + R])
            success.append(rate)
            if rate > info.skip_at:
                answer = [t for t in news[base] if t not in self.stop_ids]
                found += self._candidates(i, answer)
        cands = self._utilities(found, deadline)
        return None if cands is None else (cands, success)

    def _success(self, i: int, todo: list[Continuation], news: list[list[int]]) -> float:
        if not todo:
            return 0.0
        problem = self.tasks.problems[i]
        right = [self.tasks.scorer.correct(answer_text(self.tokenizer, c, n), problem.answer)
                 for c, n in zip(todo, news)]
        return sum(right) / len(right)

    def _candidates(self, i: int, answer: list[int]) -> list[_Candidate]:
        """Positions of the greedy ``answer`` where the drafter's greedy token differs."""
        if not answer:
            return []
        prompt = self.prompts[i]
        row = prompt + answer[:-1]  # position len(prompt) - 1 + j scores answer[j]
        target = _score_once(self.runner, row, self.info.tap)
        drafted = _score_once(self.drafter, row, None).logits[0].argmax(-1)  # [T]
        first = len(prompt) - 1
        mismatch = [j for j in range(len(answer)) if int(drafted[first + j]) != answer[j]]
        rng = random.Random(_seed(self.info.seed, i, 1 << 30))
        if len(mismatch) > self.info.max_candidates:
            mismatch = sorted(rng.sample(mismatch, self.info.max_candidates))
        assert target.tapped is not None  # asked for
        logits = target.logits[0]  # [T, V]
        out = []
        for j in mismatch:
            pos = first + j
            logp, entropy = position_inputs(logits[pos])  # [V], []
            d = int(drafted[pos])
            feats = target.tapped[0, pos].float().clone()  # [H]
            out.append(_Candidate(i, j, answer[:j], d, answer[j], feats,
                                  float(entropy), float(logp[d].exp())))
        return out

    def _utilities(self, found: list[_Candidate], deadline: float | None) -> Candidates | None:
        """Sample both sides of every candidate; the candidates with their success shares."""
        info = self.info
        if not found:
            return Candidates.empty(info.hidden)
        todo = []
        for c in found:
            prompt = self.prompts[c.problem]
            for side, token in ((0, c.draft_token), (1, c.target_token)):
                ctx = prompt + c.prefix + [token]
                todo += [Continuation(ctx, len(prompt), info.temperature,
                                      _seed(info.seed, c.problem, c.position, side, r))
                         for r in range(info.rollouts)]
        news = decode_all(self.runner, self.stop_ids, todo, info.max_new_tokens, deadline)
        if news is None:
            return None
        u = []
        R = info.rollouts
        for k, c in enumerate(found):
            base = 2 * R * k
            u.append((self._success(c.problem, todo[base:base + R], news[base:base + R]),
                      self._success(c.problem, todo[base + R:base + 2 * R],
                                    news[base + R:base + 2 * R])))
        return Candidates(
            torch.stack([c.features for c in found]),
            torch.tensor([c.entropy for c in found]), torch.tensor([c.token_prob for c in found]),
            torch.tensor([d for d, _ in u]), torch.tensor([t for _, t in u]),
            *[torch.tensor([getattr(c, a) for c in found], dtype=torch.long)
              for a in ("problem", "position", "draft_token", "target_token")])


def _score_once(runner, row: list[int], tap: int | None):
    """``runner.score`` of one row in a fresh slot (freed after)."""
    slot = runner.new_slot()
    try:
        return runner.score([slot], [row], tap=tap) if tap is not None else \
            runner.score([slot], [row])
    finally:
        runner.free_slot(slot)


def drafter_runner(spec: str, target, runner, max_len: int, dtype: str = "float32"):
    """A runner giving the drafter's greedy tokens: ``layers:L`` (the target's first L layers,
    sharing ``runner``'s weights) or ``model:PATH`` (a draft model with the target's tokenizer).
    ``target``: the target's ``LoadedModel``."""
    from ..drafters import parse_drafter_spec
    from ..models.loading import check_same_tokenizer, load_model
    from ..runner.target_runner import TargetRunner

    parsed = parse_drafter_spec(spec, allowed=("layers", "model"))
    if parsed.kind == "layers":
        return TargetRunner(target.model, n_slots=1, max_len=max_len, n_layers=int(parsed.arg),
                            share_weights=runner, exact=False)
    draft = load_model(parsed.arg, device=str(runner.device), dtype=dtype, exact=False)
    check_same_tokenizer(target.tokenizer, draft.tokenizer, parsed.arg)
    return TargetRunner(draft.model, n_slots=1, max_len=max_len, exact=False)
