"""The distillation dataset on disk: the target's own responses, with the features a head reads
and the target's next-token distributions, in shards.

A dataset folder holds ``dataset.json`` (what made it: the target's fingerprint, the features'
dtype, the prompts' source, the work list's seed) and ``shard-NNNNN.safetensors`` files. Work is
a deterministic list of (prompt, mode) items; shard n holds the sequences of items
[n * per_shard, (n + 1) * per_shard), so a run that stops resumes at its first missing shard.

A sequence of n response tokens stores, for position i = 0..n-1 (position 0 is the prompt's
last token):

- ``features`` [N, H]: the target's final-norm output at position i (what its LM head reads);
- ``next_tokens`` [N] int32: the token at position i + 1 (the response token the target chose);
- ``top_ids`` / ``top_probs`` [N, K]: the target's K most likely tokens after position i and
  their probabilities (at temperature 1, before any sampling filter);

and ``starts`` [S + 1] int64 the sequences' offsets in those rows.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import ConfigError

MANIFEST = "dataset.json"


@dataclass(frozen=True)
class DatasetInfo:
    """``dataset.json``: what the shards were made from."""

    target: str  # the target's fingerprint (heads.fingerprint.target_fingerprint)
    hidden: int  # H
    vocab: int
    feature_dtype: str  # "bfloat16" or "float32": the target's dtype when harvested
    top_k: int
    per_shard: int  # work items per shard
    items: int  # work items in all
    seed: int
    max_new_tokens: int
    sources: list[str]  # where the prompts came from
    command: str

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, folder: Path) -> "DatasetInfo":
        path = folder / MANIFEST
        if not path.exists():
            raise ConfigError(f"{folder} is not a distillation dataset (no {MANIFEST})")
        return cls(**json.loads(path.read_text()))

    @property
    def shards(self) -> int:
        return -(-self.items // self.per_shard)


@dataclass
class Sequences:
    """Rows of many sequences (see the module docstring for the layout)."""

    features: torch.Tensor  # [N, H]
    next_tokens: torch.Tensor  # [N] int32
    top_ids: torch.Tensor  # [N, K] int32
    top_probs: torch.Tensor  # [N, K] float16
    starts: torch.Tensor  # [S + 1] int64

    @property
    def n_sequences(self) -> int:
        return len(self.starts) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.starts[-1])

    @classmethod
    def concat(cls, parts: list["Sequences"]) -> "Sequences":
        if not parts:
            raise ConfigError("the dataset has no shards yet")
        offsets, total = [torch.zeros(1, dtype=torch.long)], 0
        for p in parts:
            offsets.append(p.starts[1:] + total)
            total += p.n_tokens
        return cls(torch.cat([p.features for p in parts]),
                   torch.cat([p.next_tokens for p in parts]),
                   torch.cat([p.top_ids for p in parts]),
                   torch.cat([p.top_probs for p in parts]), torch.cat(offsets))

    def select(self, seqs: list[int]) -> "Sequences":
        """The sequences ``seqs`` (indices), as a new set."""
        rows = [torch.arange(int(self.starts[s]), int(self.starts[s + 1])) for s in seqs]
        lens = torch.as_tensor([len(r) for r in rows], dtype=torch.long)
        idx = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        return Sequences(self.features[idx], self.next_tokens[idx], self.top_ids[idx],
                         self.top_probs[idx], torch.cat([torch.zeros(1, dtype=torch.long),
                                                         lens.cumsum(0)]))


def shard_path(folder: Path, n: int) -> Path:
    return folder / f"shard-{n:05d}.safetensors"


def save_shard(folder: Path, n: int, seqs: Sequences) -> None:
    """Write shard n atomically (a half-written shard never looks finished)."""
    tmp = folder / f".shard-{n:05d}.tmp"
    save_file({"features": seqs.features.contiguous(), "next_tokens": seqs.next_tokens,
               "top_ids": seqs.top_ids, "top_probs": seqs.top_probs, "starts": seqs.starts},
              str(tmp))
    tmp.replace(shard_path(folder, n))


def finished_shards(folder: Path, info: DatasetInfo) -> int:
    """How many shards, from the first, are on disk (a resumed run starts after them)."""
    n = 0
    while n < info.shards and shard_path(folder, n).exists():
        n += 1
    return n


def load_sequences(folder: Path) -> tuple[DatasetInfo, Sequences]:
    """Every finished shard of a dataset folder, concatenated."""
    info = DatasetInfo.load(folder)
    parts = []
    for n in range(finished_shards(folder, info)):
        t = load_file(str(shard_path(folder, n)))
        parts.append(Sequences(t["features"], t["next_tokens"], t["top_ids"], t["top_probs"],
                               t["starts"]))
    return info, Sequences.concat(parts)
