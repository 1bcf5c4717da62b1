"""Learning from live traffic (``--learn``): the verifier keeps a bounded buffer of its sessions'
(feature, committed token) pairs and fine-tunes a copy of its head in a background thread of
low priority, swapping the copy in only when it drafts better on held-out recent traffic.

- Memory is bounded (``max_tokens`` pairs, the oldest sessions dropped first) and so is CPU:
  the thread runs at the lowest scheduling priority (its torch threads inherit it) and sleeps so
  that it trains at most ``share`` of the time. Verification never waits for it: the engine
  hands it pairs it already has and swaps heads by one reference assignment.
- The held-out slice is the most recent sessions (a fifth of the buffer); both the serving head
  and the candidate are measured on it (``validation.held_out_acceptance``), and the candidate
  replaces the serving head only if its tokens per step are higher.
- A committed token is the target's own choice, so it is the label: no distributions are kept.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

import torch

from .dataset import Sequences
from .modules import DraftHead
from .training import TrainSettings, optimizer_step, sample_batch
from .validation import held_out_acceptance

log = logging.getLogger("edgespec.heads.online")


@dataclass(frozen=True)
class LearnSettings:
    max_tokens: int = 60_000  # pairs held (about 70 MB of bfloat16 features at H = 576)
    min_new_tokens: int = 2_000  # new pairs before another round
    steps: int = 60  # training steps a round
    lr: float = 3e-4
    share: float = 0.25  # at most this share of wall time spent training
    held_out: float = 0.2  # the newest sessions' share kept for the swap decision


class OnlineLearner:
    """Fine-tunes the head of a ``HeadProposer`` (``swap``, ``head``) from live sessions."""

    def __init__(self, proposer, settings: LearnSettings | None = None):
        self.proposer = proposer
        self.s = settings or LearnSettings()
        self._open: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._done: deque[tuple[torch.Tensor, torch.Tensor]] = deque()  # (feats, tokens)
        self._held = 0  # pairs in _done
        self._new = 0  # pairs since the last round
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.rounds = 0
        self.last_candidate: float | None = None  # the last candidate's held-out tokens/step
        self._thread = threading.Thread(target=self._run, name="head-learner", daemon=True)
        self._thread.start()

    @property
    def buffered_tokens(self) -> int:
        with self._lock:
            return self._held

    # -- fed by the engine (its thread) --------------------------------------------------------
    def record(self, sid: str, feats: torch.Tensor, tokens: torch.Tensor) -> None:
        """A step's new pairs of a session: feats [n, H], tokens [n] (device tensors)."""
        pair = (feats.detach().to("cpu", torch.bfloat16), tokens.detach().to("cpu"))
        with self._lock:
            self._open.setdefault(sid, []).append(pair)

    def finish(self, sid: str) -> None:
        """A session ended: its pairs join the buffer (the oldest leave beyond the bound)."""
        with self._lock:
            parts = self._open.pop(sid, None)
            if not parts:
                return
            feats = torch.cat([f for f, _ in parts])
            tokens = torch.cat([t for _, t in parts])
            if len(tokens) < 3:
                return
            self._done.append((feats, tokens))
            self._held += len(tokens)
            self._new += len(tokens)
            while self._held > self.s.max_tokens and len(self._done) > 1:
                self._held -= len(self._done.popleft()[1])
            ready = self._new >= self.s.min_new_tokens
        if ready:
            self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    # -- the background thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:  # Linux: a thread's own niceness, inherited by the torch threads it starts
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._round()
            except Exception:  # never the verifier's problem: log, keep serving the old head
                log.exception("a --learn round failed; the serving head is unchanged")

    def _snapshot(self) -> tuple[Sequences, Sequences] | None:
        with self._lock:
            seqs = list(self._done)
            self._new = 0
        if len(seqs) < 2:
            return None
        n_val = max(1, int(len(seqs) * self.s.held_out))
        return _as_sequences(seqs[:-n_val]), _as_sequences(seqs[-n_val:])

    def _round(self) -> None:
        split = self._snapshot()
        if split is None:
            return
        train, val = split
        serving: DraftHead = self.proposer.head
        candidate = DraftHead(serving.cfg, serving.target)  # the frozen target tensors shared
        candidate.load_state_dict(serving.state_dict(), strict=False)
        candidate.train()
        opt = torch.optim.AdamW([p for p in candidate.parameters() if p.requires_grad],
                                lr=self.s.lr, weight_decay=0.0)
        ts = replace(TrainSettings(kind=serving.cfg.kind), context=serving.cfg.context,
                     depth=serving.cfg.depth, span=16, batch=8)
        g = torch.Generator().manual_seed(self.rounds)
        for _ in range(self.s.steps):
            if self._stop.is_set():
                return
            t0 = time.monotonic()
            optimizer_step(candidate, opt, sample_batch(train, ts, g))
            busy = time.monotonic() - t0
            time.sleep(busy * (1 - self.s.share) / self.s.share)  # the CPU share bound
        candidate.eval()
        new = held_out_acceptance(candidate, val)["tokens_per_step"]
        old = held_out_acceptance(serving, val)["tokens_per_step"]
        self.last_candidate = new
        if new > old:
            self.proposer.swap(candidate, new)
            log.info("--learn: head version %d, held-out tokens/step %.3f (was %.3f)",
                     self.proposer.version, new, old)
        else:
            self.proposer.measured(old)
        self.rounds += 1  # last: a reader that sees the round sees its swap


def _as_sequences(seqs: list[tuple[torch.Tensor, torch.Tensor]]) -> Sequences:
    """Live pairs as a dataset whose only 'distribution' is the committed token."""
    feats = torch.cat([f for f, _ in seqs])
    tokens = torch.cat([t for _, t in seqs])
    # pair i is (f_i, x_{i+1}): the label after position i is x_{i+1} itself
    lens = torch.as_tensor([len(t) for _, t in seqs])
    return Sequences(feats, tokens.int(), tokens.int()[:, None],
                     torch.ones(len(tokens), 1, dtype=torch.float16),
                     torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]))
