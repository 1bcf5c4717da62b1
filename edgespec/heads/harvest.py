"""Harvesting the target's own behaviour for distillation: many responses decoded together in the
runner's KV slots, each position's features and top-k distribution recorded into shards
(``heads.dataset``).

The work list is every prompt answered greedily plus ``samples`` sampled answers at
``temperature``, shuffled by the seed; a sampled answer draws from a generator seeded by
(seed, item), so a resumed or repeated run makes the same data.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .dataset import DatasetInfo, Sequences, finished_shards, save_shard


@dataclass(frozen=True)
class WorkItem:
    prompt_ids: list[int]
    temperature: float  # 0: greedy
    seed: int
    tag: str = ""  # where the prompt came from (a Spec-Bench category, a file)


@dataclass
class _Slot:
    item: WorkItem
    index: int  # the item's place in the work list
    slot: int
    last: int  # the token the next forward reads
    gen: torch.Generator | None
    feats: list[torch.Tensor] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    top_ids: list[torch.Tensor] = field(default_factory=list)
    top_probs: list[torch.Tensor] = field(default_factory=list)


def work_list(prompts: list[list[int]], samples: int, temperature: float, seed: int,
              tags: list[str] | None = None) -> list[WorkItem]:
    """Each prompt greedy and ``samples`` times sampled, shorter prompts first (rows decoded
    together attend over the longest one's context), ties in a seeded shuffled order."""
    items = []
    for p, tag in zip(prompts, tags or [""] * len(prompts)):
        items.append(WorkItem(p, 0.0, 0, tag))
        items.extend(WorkItem(p, temperature, 0, tag) for _ in range(samples))
    rng = random.Random(seed)
    rng.shuffle(items)
    items.sort(key=lambda w: len(w.prompt_ids))
    return [WorkItem(w.prompt_ids, w.temperature, seed * 1_000_003 + i, w.tag)
            for i, w in enumerate(items)]


class Harvester:
    """Decodes work items ``slots`` at a time with a ``TargetRunner`` and writes shards."""

    def __init__(self, runner, stop_ids: set[int], max_new_tokens: int, top_k: int = 16):
        self.runner, self.stop_ids = runner, set(stop_ids)
        self.max_new, self.top_k = max_new_tokens, top_k
        self.decoded = 0  # tokens decoded so far (finished or not)

    def run(self, folder: Path, info: DatasetInfo, items: list[WorkItem],
            deadline: float | None = None, say: Callable[[str], None] = print) -> bool:
        """Make the missing shards in order, decoding continuously across them (a shard is
        written once all its items are answered); False when the deadline (a
        ``time.monotonic`` value) stopped it before the last (the finished shards stay)."""
        first = finished_shards(folder, info)
        if first:
            say(f"harvest: resuming after {first} of {info.shards} finished shards")
        per = info.per_shard
        t0, next_shard, ended = time.monotonic(), first, 0
        answered: dict[int, _Slot] = {}
        for index, slot in self.decode(items, first * per, deadline):
            answered[index] = slot
            ended += 1
            while next_shard < info.shards and all(
                    i in answered for i in range(next_shard * per,
                                                 min(len(items), (next_shard + 1) * per))):
                rows = range(next_shard * per, min(len(items), (next_shard + 1) * per))
                seqs = _sequences([answered.pop(i) for i in rows])
                save_shard(folder, next_shard, seqs)
                next_shard += 1
                spent = time.monotonic() - t0
                left = (len(items) - first * per - ended) * spent / ended
                say(f"harvest: shard {next_shard}/{info.shards}, {seqs.n_tokens} tokens, "
                    f"{self.decoded / spent:.0f} tok/s, ETA {left / 60:.1f} min")
        return next_shard == info.shards

    @torch.inference_mode()
    def decode(self, items: list[WorkItem], start: int = 0, deadline: float | None = None
               ) -> Iterator[tuple[int, _Slot]]:
        """Answer items[start:], yielding (index, its answer) as each ends; stops early (the
        slots freed) at the deadline."""
        runner = self.runner
        queue = list(range(start, len(items)))
        queue.reverse()
        active: list[_Slot] = []
        try:
            while queue or active:
                if deadline is not None and time.monotonic() >= deadline:
                    return
                while queue and runner.cache.free_slots:
                    i = queue.pop()
                    active.append(self._open(i, items[i]))
                yield from self._step(active)
        finally:
            for a in active:
                runner.free_slot(a.slot)

    def _step(self, active: list[_Slot]) -> Iterator[tuple[int, _Slot]]:
        """One token for every active answer; yields and drops the ones that end."""
        runner = self.runner
        sc = runner.score([a.slot for a in active], [[a.last] for a in active])
        logits, feats = sc.logits[:, 0], sc.features[:, 0]  # [B, V], [B, H]
        top_p, top_i = logits.softmax(-1).topk(self.top_k, -1)
        greedy = logits.argmax(-1).tolist()
        for b, a in enumerate(list(active)):
            if a.item.temperature > 0:
                p = (logits[b] / a.item.temperature).softmax(-1)
                tok = int(torch.multinomial(p, 1, generator=a.gen))
            else:
                tok = greedy[b]
            a.feats.append(feats[b].clone())
            a.top_ids.append(top_i[b].int())
            a.top_probs.append(top_p[b].half())
            a.tokens.append(tok)
            self.decoded += 1
            length = runner.cache.lengths[a.slot] + 1
            runner.commit(a.slot, length)
            a.last = tok
            if tok in self.stop_ids or len(a.tokens) >= self.max_new or \
                    length + 1 >= runner.max_len:
                runner.free_slot(a.slot)
                active.remove(a)
                yield a.index, a

    def _open(self, index: int, item: WorkItem) -> _Slot:
        slot = self.runner.new_slot()
        ids = item.prompt_ids[-(self.runner.max_len - self.max_new - 2):]
        self.runner.prefill(slot, ids[:-1])
        gen = None
        if item.temperature > 0:
            gen = torch.Generator().manual_seed(item.seed)
        return _Slot(item, index, slot, ids[-1], gen)


def _sequences(slots: list[_Slot]) -> Sequences:
    lens = torch.as_tensor([len(s.tokens) for s in slots], dtype=torch.long)
    return Sequences(
        features=torch.stack([f for s in slots for f in s.feats]),
        next_tokens=torch.as_tensor([t for s in slots for t in s.tokens], dtype=torch.int32),
        top_ids=torch.stack([t for s in slots for t in s.top_ids]),
        top_probs=torch.stack([t for s in slots for t in s.top_probs]),
        starts=torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]))
