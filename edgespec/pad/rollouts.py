"""Continuations decoded many at a time in the target runner's KV slots, and their scores.

A ``Continuation`` is a context (prompt ids, maybe with the start of an answer) continued greedily
or sampled at a temperature from its own seeded generator; the heads' harvester
(``edgespec.heads.harvest``) does the slot work, so a set of continuations is decoded as one
batch, refilling slots as rows end.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..heads.harvest import Harvester, WorkItem
from .tasks import TaskSet


@dataclass(frozen=True)
class Continuation:
    context: list[int]  # prompt ids (chat template applied) + answer tokens so far
    answer_start: int  # where the answer starts in ``context`` (the prompt's length)
    temperature: float  # 0: greedy
    seed: int


def decode_all(runner, stop_ids: set[int], todo: list[Continuation], max_new: int,
               deadline: float | None = None) -> list[list[int]] | None:
    """Each continuation's new tokens (the stop token included when one ended it), in order;
    None when the deadline (a ``time.monotonic`` value) stopped the batch first."""
    items = [WorkItem(c.context, c.temperature, c.seed) for c in todo]
    harvester = Harvester(runner, stop_ids, max_new, top_k=1)
    out: dict[int, list[int]] = {}
    for index, done in harvester.decode(items, 0, deadline):
        out[index] = done.tokens
    if len(out) < len(todo):
        return None
    return [out[i] for i in range(len(todo))]


def answer_text(tokenizer, c: Continuation, new: list[int]) -> str:
    """The whole answer: the context's answer tokens and the continuation, as text."""
    return tokenizer.decode(c.context[c.answer_start:] + new, skip_special_tokens=True)


def greedy_success(runner, tokenizer, stop_ids: set[int], tasks: TaskSet,
                   encode, max_new: int) -> list[bool]:
    """Whether the target's greedy answer to each problem is right. ``encode(problem)``: the
    prompt's ids."""
    todo = []
    for p in tasks.problems:
        ids = encode(p)
        todo.append(Continuation(ids, len(ids), 0.0, 0))
    news = decode_all(runner, stop_ids, todo, max_new)
    assert news is not None  # no deadline
    return [tasks.scorer.correct(answer_text(tokenizer, c, n), p.answer)
            for c, n, p in zip(todo, news, tasks.problems)]
