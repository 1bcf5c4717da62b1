"""Training an imitation network (``heads.imitation``) on a distillation dataset and its layer-L
states (``heads.exit_states``), the target frozen: a fixed number of steps, reproducible from
the seed, checkpointed so that a stopped run resumes where it was.

A batch is B random response positions. The loss mixes, as FastVLM's training does:

- cosine distance between the network's features (its output through the target's final norm)
  and the target's own final features there (what its LM head reads);
- distillation: soft cross-entropy against the target's top-k distribution, over the draft
  vocabulary (``heads.losses.soft_ce``);
- cross-entropy against the response's next token (where the draft vocabulary has it).

Validation on held-out responses: how often the first draft token equals the target's own
greedy choice there (what greedy verification accepts), for the plain early exit (the full LM
head, as ``layers:L`` drafts) and through the network.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..config import ConfigError
from .checkpoint import (load_checkpoint, loss_summary, progress_line, save_checkpoint,
                         set_learning_rate)
from .dataset import Sequences, load_sequences
from .exit_states import load_exit_states
from .imitation import ImitationConfig, ImitationManifest, ImitationNet, save_imitation
from .losses import soft_ce
from .manifest import bind_target
from .training import TargetTensors
from .validation import draft_vocabulary

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class ImitationSettings:
    exit_layer: int
    ffn: int = 1536  # d_ff
    vocab: int = 8192  # draft vocabulary size
    steps: int = 2000
    batch: int = 256  # positions a step
    lr: float = 1e-3
    weight_decay: float = 0.01
    cos_weight: float = 1.0
    kd_weight: float = 1.0
    ce_weight: float = 0.1
    depth: int = 6  # K recorded in the manifest: the most tokens a step drafts
    seed: int = 0
    held_out: float = 0.05  # share of sequences kept for validation


@dataclass
class Rows:
    """Dataset rows with their layer-L states."""

    states: torch.Tensor  # [N, H] bfloat16: layer L's output
    features: torch.Tensor  # [N, H]: the final norm's output
    next_tokens: torch.Tensor  # [N]
    top_ids: torch.Tensor  # [N, k]
    top_probs: torch.Tensor  # [N, k]

    @classmethod
    def of(cls, seqs: Sequences, states: torch.Tensor, seq_ids: list[int]) -> "Rows":
        rows = [torch.arange(int(seqs.starts[s]), int(seqs.starts[s + 1])) for s in seq_ids]
        idx = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        return cls(states[idx], seqs.features[idx], seqs.next_tokens[idx], seqs.top_ids[idx],
                   seqs.top_probs[idx])

    def __len__(self) -> int:
        return len(self.next_tokens)


def imitation_loss(net: ImitationNet, s: ImitationSettings, rows: Rows, idx: torch.Tensor,
                   to_draft: torch.Tensor) -> torch.Tensor:
    """The mixed loss over rows ``idx`` [B] (``to_draft`` [V]: draft id or -1)."""
    feats = net.features(rows.states[idx].float())  # [B, H]
    target = rows.features[idx].float()
    cos = 1 - F.cosine_similarity(feats.float(), target, dim=-1).mean()
    logits = net.logits(feats)  # [B, Vd]
    ones = torch.ones(len(idx), dtype=torch.bool)
    kd = soft_ce(logits, rows.top_ids[idx].long(), rows.top_probs[idx].float(), to_draft, ones)
    tok = to_draft[rows.next_tokens[idx].long()]
    ce = F.cross_entropy(logits.float()[tok >= 0], tok[tok >= 0]) if (tok >= 0).any() \
        else logits.sum() * 0
    return s.cos_weight * cos + s.kd_weight * kd + s.ce_weight * ce


@torch.no_grad()
def first_draft_accuracy(net: ImitationNet, lm_weight: torch.Tensor, rows: Rows,
                         limit: int = 20000) -> dict:
    """The share of held-out positions whose first draft is the target's greedy token: the
    plain early exit (full LM head) and through the network."""
    n = min(len(rows), limit)
    if n == 0:
        return {"first_draft_accuracy": 0.0, "plain_exit_accuracy": 0.0, "points": 0}
    plain = imitated = 0
    norm, eps = net.target.norm.float(), net.cfg.eps
    for at in range(0, n, 1024):
        h = rows.states[at:min(n, at + 1024)].float()
        want = rows.top_ids[at:min(n, at + 1024), 0].long()
        f0 = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm
        plain += int(((f0 @ lm_weight.float().T).argmax(-1) == want).sum())
        mine = net.target.vocab_ids[net.logits(net.features(h)).argmax(-1)]
        imitated += int((mine == want).sum())
    return {"first_draft_accuracy": round(imitated / n, 4),
            "plain_exit_accuracy": round(plain / n, 4), "points": n}


def train_imitation(target: TargetTensors, n_layers: int, data_dir: Path, out_dir: Path,
                    s: ImitationSettings, command: str = "", deadline: float | None = None,
                    say: Callable[[str], None] = print, until_step: int | None = None
                    ) -> dict | None:
    """Train (or resume) the network of ``s`` into ``out_dir``; returns its report, or None if
    the deadline (``time.monotonic``) or ``until_step`` stopped it first (the checkpoint stays,
    and the same call resumes it)."""
    info, seqs = load_sequences(data_dir)
    if info.target != target.fingerprint:
        raise ConfigError(f"the dataset in {data_dir} was made from another target "
                          f"(fingerprint {info.target}, this one {target.fingerprint})")
    if not 1 <= s.exit_layer < n_layers:
        raise ConfigError(f"--exit-layer must be in 1..{n_layers - 1}, got {s.exit_layer}")
    states = load_exit_states(data_dir, s.exit_layer)
    g = torch.Generator().manual_seed(s.seed)
    order = torch.randperm(seqs.n_sequences, generator=g).tolist()
    n_val = max(1, int(round(s.held_out * seqs.n_sequences))) if seqs.n_sequences > 1 else 0
    train_ids, val_ids = sorted(order[n_val:]), sorted(order[:n_val])
    train, val = Rows.of(seqs, states, train_ids), Rows.of(seqs, states, val_ids)
    vocab_ids, coverage = draft_vocabulary(seqs.select(train_ids), seqs.select(val_ids),
                                           s.vocab)
    H = target.embed.shape[1]
    cfg = ImitationConfig(exit_layer=s.exit_layer, n_layers=n_layers, hidden=H, ffn=s.ffn,
                          draft_vocab=len(vocab_ids), depth=s.depth, eps=target.eps)
    torch.manual_seed(s.seed)
    net = ImitationNet(cfg, bind_target(target.embed, target.lm_weight, target.norm, vocab_ids,
                                        torch.float32))
    to_draft = torch.full((target.embed.shape[0],), -1, dtype=torch.long)
    to_draft[vocab_ids] = torch.arange(len(vocab_ids))
    params = [p for n, p in net.named_parameters() if not n.startswith("target.")]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
    rng = torch.Generator().manual_seed(s.seed + 1)
    step, spent = 0, 0.0
    losses: list[float] = []
    ckpt = out_dir / CHECKPOINT
    resumed = load_checkpoint(ckpt, "net", net, opt, rng, asdict(s), info.command)
    if resumed is not None:
        step, spent, losses = resumed
        say(f"train imitation (layer {s.exit_layer}): resuming at step {step}/{s.steps}")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = last_save = last_say = time.monotonic()
    first = step
    net.train()
    while step < s.steps:
        if (deadline is not None and time.monotonic() >= deadline) or step == until_step:
            _save(ckpt, net, opt, rng, step, spent + time.monotonic() - t0, losses, s,
                  info.command)
            return None
        set_learning_rate(opt, s.lr, step, s.steps, warmup=100)
        idx = torch.randint(len(train), (s.batch,), generator=rng)
        with torch.autocast("cpu", dtype=torch.bfloat16,
                            enabled=target.embed.device.type == "cpu"):
            loss = imitation_loss(net, s, train, idx, to_draft)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        now = time.monotonic()
        if now - last_say >= 30 or step == s.steps:
            say(f"train imitation (layer {s.exit_layer}): "
                f"{progress_line(step, s.steps, first, now - t0, losses)}")
            last_say = now
        if now - last_save >= 60:
            _save(ckpt, net, opt, rng, step, spent + now - t0, losses, s, info.command)
            last_save = now
    spent += time.monotonic() - t0
    net.eval()
    accuracy = first_draft_accuracy(net, target.lm_weight, val)
    manifest = ImitationManifest(
        cfg, target.fingerprint, target.name,
        data={"folder": str(data_dir), "tokens": len(train), "sequences": len(train_ids),
              "sources": info.sources, "vocab_coverage": round(coverage, 4)},
        command=command,
        training={"steps": s.steps, "seconds": round(spent, 1), "seed": s.seed,
                  "batch": s.batch, "lr": s.lr, "parameters": net.parameter_count(),
                  **loss_summary(losses)},
        validation=accuracy)
    save_imitation(out_dir, net, manifest)
    ckpt.unlink(missing_ok=True)
    return {"kind": "imitation", "exit_layer": s.exit_layer, **manifest.training, **accuracy,
            "vocab_coverage": round(coverage, 4)}


def _save(path: Path, net: ImitationNet, opt, rng: torch.Generator, step: int, spent: float,
          losses: list[float], s: ImitationSettings, data: str) -> None:
    save_checkpoint(path, "net", net, opt, rng, step, spent, losses, asdict(s), data)
