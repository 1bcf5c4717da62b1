"""Verification maths, as pure functions (DESIGN.md section 3).

Vocabulary: a verification step sees the target's distributions at T+1 positions for a draft of
T tokens, accepts a prefix of n draft tokens, and emits one token of its own: the *recovered*
token after a rejection, or the *bonus* token after a full accept.

- Greedy: accept while the draft token is the target's argmax; then emit the argmax.
- Sampling: accept draft token x with probability min(1, p(x) / q(x)); on rejection sample from
  norm(max(0, p - q)). A deterministic draft (MaG, n-gram) has a one-hot q, so this is "accept
  with p(x), else sample from p without x". A model draft sends the top-k-truncated, renormalised
  q' it really sampled from, as (token ids, probabilities).

p is always the target's *processed* distribution (temperature, top-k, top-p applied), so the
output follows exactly what target-only sampling would draw from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import SamplingParams


@dataclass
class SparseQ:
    """A draft distribution over a few tokens: ids [k] and their probabilities [k] (sum 1)."""

    ids: list[int]
    probs: list[float]

    def dense(self, vocab_size: int, device=None) -> torch.Tensor:
        q = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        q[torch.as_tensor(self.ids, device=device)] = torch.as_tensor(
            self.probs, dtype=torch.float32, device=device)
        return q


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target probabilities after temperature, top-k and top-p. logits: [N, V] -> probs [N, V]."""
    logits = logits.float() / max(params.temperature, 1e-5)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already cover top_p
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def make_generator(seed: int | None, device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def verify_greedy(target_argmax: list[int], draft: list[int]) -> tuple[int, int]:
    """target_argmax: the target's argmax at each of the T+1 positions. -> (n_accepted, token)."""
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return n, target_argmax[n]


def verify_sampling(probs: torch.Tensor, draft: list[int], q: list[SparseQ] | None,
                    generator: torch.Generator) -> tuple[int, int]:
    """Speculative sampling over one row.

    probs: [T+1, V] processed target probabilities (row i scores the token after draft[:i]);
    draft: T token ids; q: per draft token its SparseQ, or None for a deterministic draft.
    Returns (n_accepted, token), token being the recovered or bonus token.
    """
    probs = probs.to(generator.device)  # e.g. CUDA logits, CPU generator: draw on its device
    vocab = probs.shape[-1]
    for i, x in enumerate(draft):
        p_i = probs[i]
        q_x = 1.0 if q is None else _q_at(q[i], x)
        accept = min(1.0, float(p_i[x]) / q_x) if q_x > 0 else 0.0
        if float(torch.rand((), generator=generator, device=generator.device)) < accept:
            continue
        if q is None:
            residual = p_i.clone()
            residual[x] = 0.0
        else:
            residual = (p_i - q[i].dense(vocab, p_i.device)).clamp_min(0.0)
        total = float(residual.sum())
        if total <= 0:  # p == q: rejection has probability 0, guard against round-off
            residual, total = p_i, float(p_i.sum())
        token = torch.multinomial(residual / total, 1, generator=generator)
        return i, int(token)
    token = torch.multinomial(probs[len(draft)], 1, generator=generator)
    return len(draft), int(token)


def _q_at(q: SparseQ, x: int) -> float:
    for tid, pr in zip(q.ids, q.probs):
        if tid == x:
            return float(pr)
    return 0.0


def verify_batch(logits: torch.Tensor, drafts: list[list[int]], qs: list[list[SparseQ] | None],
                 params: list[SamplingParams], generators: list[torch.Generator | None]
                 ) -> list[tuple[int, int]]:
    """Verify a padded batch. logits: [B, T_max, V]; row b uses its first len(drafts[b]) + 1."""
    out: list[tuple[int, int]] = []
    argmax = None
    for b, draft in enumerate(drafts):
        n_rows = len(draft) + 1
        if params[b].greedy:
            if argmax is None:
                argmax = logits.argmax(-1).tolist()  # [B, T_max], one transfer for the batch
            out.append(verify_greedy(argmax[b][:n_rows], draft))
        else:
            probs = process_logits(logits[b, :n_rows], params[b])
            out.append(verify_sampling(probs, draft, qs[b], generators[b]))
    return out


def sample_sparse(logits: torch.Tensor, params: SamplingParams, top_k: int,
                  generator: torch.Generator) -> tuple[int, SparseQ]:
    """A drafter's sample from its top-k-truncated, renormalised distribution q'.

    logits: [V]. Returns the sampled token and the exact q' it was drawn from.
    """
    probs = process_logits(logits[None], params)[0]
    top = torch.topk(probs, min(top_k, probs.shape[-1]))
    keep = top.values > 0
    ids, vals = top.indices[keep], top.values[keep]
    vals = vals / vals.sum()
    pick = int(torch.multinomial(vals, 1, generator=generator))
    return int(ids[pick]), SparseQ(ids=ids.tolist(), probs=vals.tolist())
