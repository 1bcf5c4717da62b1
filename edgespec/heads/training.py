"""Training a draft head on a distillation dataset (``heads.dataset``): a fixed number of steps,
reproducible from the seed, checkpointed so that a stopped run resumes where it was.

A batch is B windows of S consecutive positions of the target's responses. Every position i is
a drafting point: its context is the pairs (f_j, x_{j+1}) for j in (i - W, i] inside the window,
and the head must name x_{i+2}, x_{i+3}, ... as the target would. Losses (``heads.losses``):
soft cross-entropy against the target's top-k distribution at each drafted position (all kinds),
plus the feature regression (eagle, over its own first and second steps) or CTC against the
target's continuation (ctc).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from ..config import ConfigError
from .checkpoint import (load_checkpoint, loss_summary, progress_line, save_checkpoint,
                         set_learning_rate)
from .dataset import Sequences, load_sequences
from .fingerprint import target_fingerprint
from .losses import Batch, head_loss
from .manifest import HeadManifest, bind_target, save_head
from .modules import DraftHead, HeadConfig
from .validation import draft_vocabulary, held_out_acceptance

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainSettings:
    kind: str
    vocab: int = 8192  # draft vocabulary size
    steps: int = 1500
    batch: int = 8  # windows a step
    span: int = 32  # positions a window
    context: int = 16  # W
    depth: int = 6  # K
    lr: float = 2e-3
    seed: int = 0
    threads: int = 1
    held_out: float = 0.05  # share of sequences kept for validation
    data_share: float = 1.0  # train on this share of the training sequences (ablations)


@dataclass
class TargetTensors:
    """What a head needs of the target: its frozen tensors and identity."""

    embed: torch.Tensor  # [V, H]
    lm_weight: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H]
    eps: float
    fingerprint: str
    name: str

    @classmethod
    def of_model(cls, model, name: str) -> "TargetTensors":
        """From a transformers Llama-family causal LM (as the runner reads it)."""
        base = model.model
        embed, norm = base.embed_tokens.weight.detach(), base.norm.weight.detach()
        return cls(embed, model.lm_head.weight.detach(), norm, float(model.config.rms_norm_eps),
                   target_fingerprint(embed, norm, len(base.layers)), name)


def split_sequences(seqs: Sequences, share: float, seed: int) -> tuple[Sequences, Sequences]:
    """(training, held-out) by a seeded permutation of the sequences."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(seqs.n_sequences, generator=g).tolist()
    n_val = max(1, int(round(share * seqs.n_sequences))) if seqs.n_sequences > 1 else 0
    return seqs.select(sorted(order[n_val:])), seqs.select(sorted(order[:n_val]))


def sample_batch(seqs: Sequences, s: TrainSettings, g: torch.Generator) -> Batch:
    """B windows of S positions at random places of random sequences (``heads.losses.Batch``)."""
    lens = seqs.starts[1:] - seqs.starts[:-1]
    ok = torch.nonzero(lens >= 2)[:, 0]
    seq = ok[torch.randint(len(ok), (s.batch,), generator=g)]
    start = (torch.rand(s.batch, generator=g) * (lens[seq] - 1).float()).long()
    pos = start[:, None] + torch.arange(s.span)[None]  # [B, S]
    length = lens[seq][:, None]
    base = seqs.starts[seq][:, None]
    ahead = torch.arange(s.depth + 1)  # offsets 0..K

    def rows(offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        at = pos[..., None] + offset  # [B, S, n]
        valid = at < length[..., None]
        return (base[..., None] + at.clamp(max=length[..., None] - 1)), valid

    here, valid = rows(ahead[:1])
    fut, fut_valid = rows(ahead[1:])  # [B, S, K]: index i + j
    return Batch(features=seqs.features[here[..., 0]].float(),
                 tokens=seqs.next_tokens[here[..., 0]].long(), valid=valid[..., 0],
                 future_features=seqs.features[fut[..., 0]].float(),
                 future_ids=seqs.top_ids[fut].long(), future_probs=seqs.top_probs[fut].float(),
                 future_tokens=seqs.next_tokens[fut].long(),
                 future_valid=fut_valid & valid)


def optimizer_step(head: DraftHead, opt: torch.optim.Optimizer, batch: Batch) -> float:
    """One training step on a batch (bfloat16 autocast on a CPU, gradients clipped at 1);
    returns the loss."""
    with torch.autocast("cpu", dtype=torch.bfloat16,
                        enabled=head.target.embed.device.type == "cpu"):
        loss = head_loss(head, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    opt.step()
    return loss.item()


def make_head(kind: str, target: TargetTensors, vocab_ids: torch.Tensor, s: TrainSettings
              ) -> DraftHead:
    H = target.embed.shape[1]
    cfg = HeadConfig(kind=kind, hidden=H, width=H, n_heads=max(1, H // 64), context=s.context,
                     depth=s.depth, draft_vocab=len(vocab_ids), eps=target.eps)
    parts = bind_target(target.embed, target.lm_weight, target.norm, vocab_ids, torch.float32)
    return DraftHead(cfg, parts)


def train_head(target: TargetTensors, data_dir: Path, out_dir: Path, s: TrainSettings,
               command: str = "", deadline: float | None = None,
               say: Callable[[str], None] = print, until_step: int | None = None,
               exclude: set[int] | None = None, data_note: dict | None = None
               ) -> dict | None:
    """Train (or resume) a head of ``s.kind`` into ``out_dir``; returns its report, or None if
    the deadline (``time.monotonic``) or ``until_step`` stopped it first (the checkpoint
    stays, and the same call resumes it). ``exclude``: dataset sequences never trained on nor
    validated on (a held-out category's); ``data_note``: recorded in the manifest's data."""
    info, seqs = load_sequences(data_dir)
    if info.target != target.fingerprint:
        raise ConfigError(f"the dataset in {data_dir} was made from another target "
                          f"(fingerprint {info.target}, this one {target.fingerprint})")
    if exclude:
        seqs = seqs.select([i for i in range(seqs.n_sequences) if i not in exclude])
    train, val = split_sequences(seqs, s.held_out, s.seed)
    if s.data_share < 1.0:  # the first share of a seeded order: a smaller run's data is inside
        keep = torch.randperm(train.n_sequences, generator=torch.Generator().manual_seed(s.seed))
        train = train.select(sorted(keep[:max(1, int(s.data_share * len(keep)))].tolist()))
    vocab_ids, coverage = draft_vocabulary(train, val, s.vocab)
    torch.manual_seed(s.seed)
    head = make_head(s.kind, target, vocab_ids, s)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=s.lr,
                            weight_decay=0.0)
    g = torch.Generator().manual_seed(s.seed + 1)
    step, spent = 0, 0.0
    losses: list[float] = []
    ckpt = out_dir / CHECKPOINT
    resumed = load_checkpoint(ckpt, "head", head, opt, g, asdict(s), info.command)
    if resumed is not None:
        step, spent, losses = resumed
        say(f"train {s.kind}: resuming at step {step}/{s.steps}")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0, last_save, last_say, first = time.monotonic(), time.monotonic(), time.monotonic(), step
    head.train()
    while step < s.steps:
        if (deadline is not None and time.monotonic() >= deadline) or step == until_step:
            _save_checkpoint(ckpt, head, opt, g, step, spent + time.monotonic() - t0, losses,
                             s, info.command)
            return None
        set_learning_rate(opt, s.lr, step, s.steps, warmup=50)
        batch = sample_batch(train, s, g)
        losses.append(optimizer_step(head, opt, batch))
        step += 1
        now = time.monotonic()
        if now - last_say >= 15 or step == s.steps:
            say(f"train {s.kind}: {progress_line(step, s.steps, first, now - t0, losses)}")
            last_say = now
        if now - last_save >= 60:
            _save_checkpoint(ckpt, head, opt, g, step, spent + now - t0, losses, s,
                             info.command)
            last_save = now
    spent += time.monotonic() - t0
    head.eval()
    acceptance = held_out_acceptance(head, val)
    manifest = HeadManifest(
        head.cfg, target.fingerprint, target.name, info.feature_dtype,
        data={"folder": str(data_dir), "tokens": train.n_tokens,
              "sequences": train.n_sequences, "sources": info.sources,
              "vocab_coverage": round(coverage, 4), **(data_note or {})},
        command=command,
        training={"steps": s.steps, "seconds": round(spent, 1), "seed": s.seed,
                  "batch": s.batch, "span": s.span, "lr": s.lr, **loss_summary(losses)},
        validation=acceptance)
    save_head(out_dir, head, manifest)
    ckpt.unlink(missing_ok=True)
    return {"kind": s.kind, **manifest.training, **acceptance,
            "vocab_coverage": round(coverage, 4)}


def _save_checkpoint(path: Path, head: DraftHead, opt, g: torch.Generator, step: int,
                     spent: float, losses: list[float], s: TrainSettings, data: str) -> None:
    save_checkpoint(path, "head", head, opt, g, step, spent, losses, asdict(s), data)
