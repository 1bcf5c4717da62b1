"""Training PAD's pivot classifier on labels (``labels``), and validating it on held-out problems.

Labels come from the utilities by ``labels.label_of`` (ambiguous candidates dropped). A fifth of
the problems (chosen by the seed) are held out: their candidates are never trained on, and the
checkpoint kept is the one with the lowest held-out loss. The loss is cross-entropy weighted so
that both classes count alike (pivots are rarer). Full-batch AdamW: a labelling gives hundreds
to thousands of candidates, a few seconds of training on a CPU.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .classifier import PadConfig, PivotClassifier
from .labels import AMBIGUOUS, PIVOT, Candidates, label_of

HELD_OUT_SHARE = 5  # one problem in this many is held out
MIN_PER_CLASS = 2  # fewer training labels of a class than this: no classifier


@dataclass(frozen=True)
class TrainSettings:
    alpha: float = 0.8  # a pivot's draft side succeeds under alpha x the target side
    low: float = 0.5  # ... and at most this often
    high: float = 0.8  # a non-pivot's draft side succeeds at least this often
    steps: int = 400
    lr: float = 1e-3
    weight_decay: float = 1e-2
    seed: int = 0


@dataclass(frozen=True)
class TrainReport:
    """What training did and how the kept checkpoint does on held-out labels."""

    counts: dict  # pivots / not / ambiguous, train and held-out
    training: dict  # steps, best step, seconds, seed
    validation: dict  # loss, AUC, accuracy (None where a held-out class is missing)


class TooFewLabels(Exception):
    """Not enough labels of each class to train on."""


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """Area under the ROC curve of ``scores`` [M] for binary ``labels`` [M] (1 positive), by
    ranks (ties share their mean rank); None without both classes."""
    pos = int(labels.sum())
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        return None
    order = scores.double().argsort()
    ranks = torch.empty(len(scores), dtype=torch.float64)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    for value in scores.unique():  # ties: their mean rank
        tied = scores == value
        ranks[tied] = ranks[tied].mean()
    return float((ranks[labels.bool()].sum() - pos * (pos + 1) / 2) / (pos * neg))


def held_out_problems(problems: torch.Tensor, seed: int) -> torch.Tensor:
    """[M] bool: candidates whose problem is held out (one problem in HELD_OUT_SHARE)."""
    ids = sorted(set(problems.tolist()))
    random.Random(seed).shuffle(ids)
    chosen = set(ids[: max(1, len(ids) // HELD_OUT_SHARE)]) if len(ids) > 1 else set()
    return torch.tensor([p in chosen for p in problems.tolist()], dtype=torch.bool)


def _loss(model: PivotClassifier, c: Candidates, y: torch.Tensor, weight: torch.Tensor
          ) -> torch.Tensor:
    return F.cross_entropy(model(c.features, c.entropy, c.token_prob), y, weight=weight)


def train_classifier(cands: Candidates, cfg: PadConfig, settings: TrainSettings
                     ) -> tuple[PivotClassifier, TrainReport]:
    """Train on the labelled candidates; the checkpoint with the lowest held-out loss (the last
    one without held-out labels). TooFewLabels when a class has under MIN_PER_CLASS training
    labels."""
    t0 = time.monotonic()
    torch.manual_seed(settings.seed)
    y_all = label_of(cands.u_draft, cands.u_target, settings.alpha, settings.low, settings.high)
    keep = y_all != AMBIGUOUS
    held = held_out_problems(cands.problem, settings.seed)
    train_rows, val_rows = torch.nonzero(keep & ~held)[:, 0], torch.nonzero(keep & held)[:, 0]
    train, val = cands.select(train_rows), cands.select(val_rows)
    y_train, y_val = y_all[train_rows], y_all[val_rows]
    counts = {"pivots": int((y_all == PIVOT).sum()), "not_pivots": int((y_all == 0).sum()),
              "ambiguous": int((~keep).sum()), "train": len(train_rows),
              "held_out": len(val_rows)}
    n_pos = int(y_train.sum())
    if min(n_pos, len(y_train) - n_pos) < MIN_PER_CLASS:
        raise TooFewLabels(f"{n_pos} pivots and {len(y_train) - n_pos} non-pivots to train on "
                           f"(need {MIN_PER_CLASS} of each): label more problems")
    weight = (len(y_train) / (2 * torch.bincount(y_train, minlength=2).clamp_min(1))).float()
    model = PivotClassifier(cfg)
    model.fit_scales(train.features, torch.stack([train.entropy, train.token_prob], -1))
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr,
                            weight_decay=settings.weight_decay)
    best, best_loss, best_step = copy.deepcopy(model.state_dict()), float("inf"), 0
    first_loss = last_loss = float("nan")
    for step in range(1, settings.steps + 1):
        model.train()
        loss = _loss(model, train, y_train, weight)
        opt.zero_grad()
        loss.backward()
        opt.step()
        last_loss = float(loss.detach())
        if step == 1:
            first_loss = last_loss
        if len(val_rows):
            with torch.no_grad():
                model.eval()
                vl = float(_loss(model, val, y_val, weight))
            if vl < best_loss:
                best, best_loss, best_step = copy.deepcopy(model.state_dict()), vl, step
    if not len(val_rows):
        best, best_step = model.state_dict(), settings.steps
    model.load_state_dict(best)
    model.eval()
    report = TrainReport(counts, {"steps": settings.steps, "best_step": best_step,
                                  "first_loss": round(first_loss, 4),
                                  "last_loss": round(last_loss, 4),
                                  "seconds": round(time.monotonic() - t0, 1),
                                  "seed": settings.seed, "alpha": settings.alpha,
                                  "low": settings.low, "high": settings.high},
                         validate(model, val, y_val, weight))
    return model, report


@torch.no_grad()
def validate(model: PivotClassifier, val: Candidates, y: torch.Tensor, weight: torch.Tensor
             ) -> dict:
    """Held-out loss, AUC and accuracy (argmax) of ``model`` on labelled candidates."""
    if not len(val):
        return {"labels": 0, "loss": None, "auc": None, "accuracy": None}
    logits = model(val.features, val.entropy, val.token_prob)  # [M, 2]
    a = auc(logits.softmax(-1)[:, 1], y)
    return {"labels": len(val), "pivots": int(y.sum()),
            "loss": round(float(F.cross_entropy(logits, y, weight=weight)), 4),
            "auc": None if a is None else round(a, 4),
            "accuracy": round(float((logits.argmax(-1) == y).float().mean()), 4)}
