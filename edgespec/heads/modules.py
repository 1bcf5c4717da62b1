"""The draft heads' networks: small modules over the target's features, reading out through the
target's own frozen LM head (restricted to a draft vocabulary).

Every head reads a context of W pairs (f_i, x_{i+1}): the target's feature at position i (its
final norm's output, what its LM head reads) and the token the target put after it. After a
verification step the last pair is (the last accepted position's feature, the token the target
emitted), and a head drafts the tokens after that one. All three kinds share one building block
(``Block``: pre-norm attention whose keys may include other inputs, then a gated MLP):

- ``eagle``: autoregressive at the feature level. The block over the context predicts the next
  feature f^_{i+1}; its token (argmax of the LM head) and f^ become the next pair; and so on.
- ``specformer``: K learned draft queries, each started from the last pair, attend causally to
  the context and bidirectionally to each other; query j's feature gives token j. One pass.
- ``ctc``: the same with T = 2K query slots and a blank class; the best path, repeats collapsed
  and blanks dropped, gives the tokens (CTC drafting). One pass.

Shapes: B sessions (or windows), W context pairs, H the target's hidden size, D the head's width,
Vd the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import HEAD_KINDS

KINDS = HEAD_KINDS


@dataclass(frozen=True)
class HeadConfig:
    kind: str
    hidden: int  # H: the target's hidden size
    width: int  # D: the head's
    n_heads: int
    context: int  # W: context pairs read
    depth: int  # K: most tokens drafted a step
    draft_vocab: int  # Vd
    eps: float = 1e-5  # the target's RMSNorm epsilon

    @property
    def slots(self) -> int:
        """Query slots: K (specformer), 2K (ctc: room for blanks), 0 (eagle)."""
        return {"eagle": 0, "specformer": self.depth, "ctc": 2 * self.depth}[self.kind]

    def as_dict(self) -> dict:
        return asdict(self)


class TargetParts(nn.Module):
    """The target's frozen tensors a head reads through: the token embedding [V, H], the LM
    head's rows of the draft vocabulary [Vd, H], the final norm's weight [H]."""

    embed: torch.Tensor
    lm_rows: torch.Tensor
    norm: torch.Tensor
    vocab_ids: torch.Tensor

    def __init__(self, embed: torch.Tensor, lm_rows: torch.Tensor, norm: torch.Tensor,
                 vocab_ids: torch.Tensor):
        super().__init__()
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.register_buffer("lm_rows", lm_rows.detach(), persistent=False)
        self.register_buffer("norm", norm.detach(), persistent=False)
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=False)  # [Vd] target ids


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Block(nn.Module):
    """Pre-norm multi-head attention and a gated SiLU MLP, width D."""

    def __init__(self, width: int, n_heads: int, eps: float):
        super().__init__()
        self.n_heads, self.eps = n_heads, eps
        self.ln1 = nn.Parameter(torch.ones(width))
        self.ln2 = nn.Parameter(torch.ones(width))
        self.q = nn.Linear(width, width, bias=False)
        self.kv = nn.Linear(width, 2 * width, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.gate_up = nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(width, width, bias=False)

    def keys(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of inputs x [..., L, D]: two [..., L, D]."""
        k, v = self.kv(_rms(x, self.eps) * self.ln1).chunk(2, -1)
        return k, v

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """Queries x [N, Q, D] over keys/values [N, L, D], ``mask`` [N, Q, L] bool (True:
        visible; every query sees at least one key). Returns [N, Q, D]."""
        N, Q, D = x.shape
        h = self.n_heads

        def split(t):
            return t.view(N, -1, h, D // h).transpose(1, 2)  # [N, h, L, D / h]

        q = split(self.q(_rms(x, self.eps) * self.ln1))
        att = F.scaled_dot_product_attention(q, split(k), split(v), attn_mask=mask[:, None])
        x = x + self.o(att.transpose(1, 2).reshape(N, Q, D))
        gate, up = self.gate_up(_rms(x, self.eps) * self.ln2).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class DraftHead(nn.Module):
    """A head of any kind (``cfg.kind``); ``edgespec.heads.drafting`` drafts with it and
    ``edgespec.heads.training`` trains it."""

    def __init__(self, cfg: HeadConfig, target: TargetParts):
        super().__init__()
        if cfg.kind not in KINDS:
            raise ValueError(f"unknown head kind {cfg.kind!r}")
        self.cfg, self.target = cfg, target
        self.held_out = 0.0  # tokens per step on held-out data, where it was last measured
        H, D = cfg.hidden, cfg.width
        self.feat_ln = nn.Parameter(torch.ones(H))
        self.tok_ln = nn.Parameter(torch.ones(H))
        self.fuse = nn.Linear(2 * H, D)
        self.block = Block(D, cfg.n_heads, cfg.eps)
        self.out = nn.Linear(D, H)
        self.queries: nn.Parameter | None = None
        if cfg.slots:
            self.queries = nn.Parameter(torch.randn(cfg.slots, D) * 0.02)
        if cfg.kind == "ctc":
            self.blank = nn.Parameter(torch.zeros(H))
            self.blank_bias = nn.Parameter(torch.zeros(()))

    # -- pieces --------------------------------------------------------------------------------
    def pairs(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Context pairs: features [..., H] and the tokens after them [...] -> [..., D]."""
        eps = self.cfg.eps
        emb = self.target.embed[tokens.clamp_min(0)].to(feats.dtype)
        return self.fuse(torch.cat([_rms(feats, eps) * self.feat_ln,
                                    _rms(emb, eps) * self.tok_ln], -1))

    def feature(self, y: torch.Tensor) -> torch.Tensor:
        """A predicted target feature [..., H] from the block's output [..., D]: through the
        target's final norm, as the target's own are."""
        return _rms(self.out(y), self.cfg.eps) * self.target.norm.to(y.dtype)

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] (ctc: [..., Vd + 1], the blank last)."""
        out = feats @ self.target.lm_rows.to(feats.dtype).T
        if self.cfg.kind == "ctc":
            blank = feats @ self.blank.to(feats.dtype) + self.blank_bias
            out = torch.cat([out, blank[..., None]], -1)
        return out

    def query_inputs(self, last: torch.Tensor) -> torch.Tensor:
        """The query slots started from the last pair [N, D]: [N, slots, D]."""
        assert self.queries is not None  # the query kinds have them
        return self.queries[None].to(last.dtype) + last[:, None]

    def query_mask(self, ctx_visible: torch.Tensor) -> torch.Tensor:
        """Visibility of [context; queries] to the queries: each query sees the context pairs
        ``ctx_visible`` [N, W] marks and every query. Returns [N, slots, W + slots]."""
        N, S = ctx_visible.shape[0], self.cfg.slots
        both = torch.cat([ctx_visible, torch.ones(N, S, dtype=torch.bool,
                                                  device=ctx_visible.device)], 1)
        return both[:, None].expand(-1, S, -1)

    def run_queries(self, ctx: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Query kinds: context pairs [N, W, D] (right-aligned, ``visible`` [N, W] marks the real
        ones; the last is real) -> the slots' predicted features [N, slots, H]."""
        x = self.query_inputs(ctx[:, -1])
        k, v = self.block.keys(torch.cat([ctx, x], 1))
        return self.feature(self.block(x, k, v, self.query_mask(visible)))
