"""PAD's labels on disk: candidate positions with their features and utilities, in shards.

A labels folder holds ``labels.json`` (``LabelInfo``: what made the labels, the target's
fingerprint included) and ``shard-NNNNN.safetensors`` files; shard n holds the candidates of
problems [n * per_shard, (n + 1) * per_shard), so a stopped run resumes at its first missing
shard. A candidate is a position of the target's greedy answer where the drafter's greedy token
differs from the target's. Per shard:

- ``features`` [M, H] float32: the target's hidden state at the tap, at the position that
  scores the candidate token;
- ``entropy`` [M], ``token_prob`` [M]: the target's entropy there (nats) and its probability of
  the draft token;
- ``u_draft`` [M], ``u_target`` [M]: the share of right answers among continuations sampled from
  prefix + draft token and from prefix + target token;
- ``problem`` [M], ``position`` [M], ``draft_token`` [M], ``target_token`` [M] int64;
- ``problems`` [P] int64 and ``success`` [P] float32: the shard's problems and the target's
  success rate on each (sampled answers); a problem at or under ``skip_at`` gives no candidates.

The labels themselves are made when training (``label_of``), so one labelling serves several
alpha / threshold choices.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import ConfigError

MANIFEST = "labels.json"
COLUMNS = ("features", "entropy", "token_prob", "u_draft", "u_target", "problem", "position",
           "draft_token", "target_token")
PIVOT, NOT_PIVOT, AMBIGUOUS = 1, 0, -1


@dataclass(frozen=True)
class LabelInfo:
    """``labels.json``: what the shards were made from (all but ``command`` must match to
    resume)."""

    target: str  # the target's fingerprint
    target_name: str
    hidden: int
    tap: int
    tap_layers: int
    task: str  # a family name or a file's path
    scorer: str
    drafter: str
    problems: int
    per_shard: int
    rollouts: int  # continuations per side, and for the target's success rate
    temperature: float
    max_new_tokens: int
    max_candidates: int  # per problem
    skip_at: float  # problems the target gets right this often or less are skipped
    seed: int
    command: str = ""

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, folder: Path) -> "LabelInfo":
        path = folder / MANIFEST
        if not path.exists():
            raise ConfigError(f"{folder} holds no PAD labels (no {MANIFEST})")
        return cls(**json.loads(path.read_text()))

    @property
    def shards(self) -> int:
        return -(-self.problems // self.per_shard)


@dataclass
class Candidates:
    """Rows of candidates (see the module docstring for the columns)."""

    features: torch.Tensor  # [M, H] float32
    entropy: torch.Tensor  # [M]
    token_prob: torch.Tensor  # [M]
    u_draft: torch.Tensor  # [M]
    u_target: torch.Tensor  # [M]
    problem: torch.Tensor  # [M] int64
    position: torch.Tensor  # [M] int64
    draft_token: torch.Tensor  # [M] int64
    target_token: torch.Tensor  # [M] int64

    def __len__(self) -> int:
        return len(self.entropy)

    @classmethod
    def empty(cls, hidden: int) -> "Candidates":
        z = torch.zeros(0)
        n = torch.zeros(0, dtype=torch.long)
        return cls(torch.zeros(0, hidden), z, z, z, z, n, n, n, n)

    @classmethod
    def concat(cls, parts: list["Candidates"], hidden: int) -> "Candidates":
        if not parts:
            return cls.empty(hidden)
        return cls(*[torch.cat([getattr(p, c) for p in parts]) for c in COLUMNS])

    def select(self, rows: torch.Tensor) -> "Candidates":
        return Candidates(*[getattr(self, c)[rows] for c in COLUMNS])


def label_of(u_draft: torch.Tensor, u_target: torch.Tensor, alpha: float, low: float,
             high: float) -> torch.Tensor:
    """[M] int64: PIVOT where the draft side's success falls under ``alpha`` times the target
    side's and is at most ``low``; NOT_PIVOT where the draft side's is at least ``high``;
    AMBIGUOUS (dropped) otherwise."""
    out = torch.full(u_draft.shape, AMBIGUOUS, dtype=torch.long)
    out[u_draft >= high] = NOT_PIVOT
    out[(u_draft < alpha * u_target) & (u_draft <= low)] = PIVOT
    return out


def shard_path(folder: Path, n: int) -> Path:
    return folder / f"shard-{n:05d}.safetensors"


def save_shard(folder: Path, n: int, cands: Candidates, problems: list[int],
               success: list[float]) -> None:
    """Write shard n atomically (a half-written shard never looks finished)."""
    tmp = folder / f".shard-{n:05d}.tmp"
    tensors = {c: getattr(cands, c).contiguous() for c in COLUMNS}
    tensors["problems"] = torch.as_tensor(problems, dtype=torch.long)
    tensors["success"] = torch.as_tensor(success, dtype=torch.float32)
    save_file(tensors, str(tmp))
    tmp.replace(shard_path(folder, n))


def finished_shards(folder: Path, info: LabelInfo) -> int:
    """How many shards, from the first, are on disk."""
    n = 0
    while n < info.shards and shard_path(folder, n).exists():
        n += 1
    return n


@dataclass
class LabelSet:
    info: LabelInfo
    candidates: Candidates
    success: torch.Tensor  # [P] float32: the target's success rate on each labelled problem


def load_labels(folder: Path) -> LabelSet:
    """Every finished shard of a labels folder, concatenated."""
    info = LabelInfo.load(folder)
    parts, success = [], []
    for n in range(finished_shards(folder, info)):
        t = load_file(str(shard_path(folder, n)))
        parts.append(Candidates(*[t[c] for c in COLUMNS]))
        success.append(t["success"])
    return LabelSet(info, Candidates.concat(parts, info.hidden),
                    torch.cat(success) if success else torch.zeros(0))
