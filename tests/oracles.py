"""Test oracles: the verification rules stated one row at a time, written apart from the
verifier's own code on purpose, so that the tests can hold the device path
(``edgespec.verify.verify_step``) to them. Nothing in the product runs these; they live under
tests/ only.

- ``filtered_logits``: a row's processed logits (temperature, top-k, top-p);
- ``verify_greedy`` / ``verify_keyed``: a chain's exact verdict, greedy or by the keyed sample;
- ``accept_loosely`` / ``verify_loose``: FLy's lossy rule walked token by token;
- ``verify_tree``: the walk down a draft tree;
- ``verify_batch``: a padded batch of chains through the device path, as (n_accepted, token).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable

import torch

from edgespec.config import LooseParams, SamplingParams
from edgespec.verify.keyed_noise import keyed_choice, seed_of
from edgespec.verify.loose import row_entropy
from edgespec.verify.trees import DraftTree
from edgespec.verify.verify_step import VerifyBatch, verify_step
from edgespec.verify.target_choice import top_p_drop


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with top-k / top-p removed tokens at -inf: log p up to a
    constant per row. logits: [N, V] -> float32 [N, V]."""
    logits = logits.float() / max(params.temperature, 1e-5)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        top_p = torch.full(logits.shape[:-1], params.top_p, dtype=torch.float32)
        logits = logits.masked_fill(top_p_drop(logits, top_p), float("-inf"))
    return logits


def verify_greedy(target_argmax: list[int], draft: list[int]) -> tuple[int, int]:
    """target_argmax: the target's argmax at each of the T+1 positions. -> (n_accepted, token)."""
    n = 0
    while n < len(draft) and _same(draft[n], target_argmax[n]):
        n += 1
    return n, target_argmax[n]


def verify_keyed(scores: torch.Tensor, draft: list[int], seed: int, start: int
                 ) -> tuple[int, int]:
    """Sampled verification of one row. scores: [T+1, V] filtered target logits (row i scores the
    token after draft[:i]); draft token i sits at absolute position start + i. Accept while each
    draft token equals the keyed sample at its position; then emit the keyed sample at the next.
    Returns (n_accepted, token)."""
    for i in range(len(draft) + 1):
        token = keyed_choice(scores[i], seed, start + i)
        if i == len(draft) or not _same(draft[i], token):
            return i, token
    raise AssertionError("unreachable")


def _same(x, token: int) -> bool:
    """A draft entry matches only when it is an integer id equal to ``token`` (garbage never
    matches, never raises)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and int(x) == token


def verify_loose(logits: torch.Tensor, draft: list[int], params: SamplingParams, start: int,
                 loose: LooseParams) -> tuple[int, int]:
    """FLy's lossy verification of one row (``edgespec.verify.loose``). logits: [T+1, V] raw
    target logits (row i scores the token after draft[:i]); draft token i sits at absolute
    position start + i. Returns (n_accepted, token)."""
    floor = math.log(loose.min_ratio)

    def plausible(row: torch.Tensor, x: int) -> bool:  # p(x) >= min_ratio * p(top)
        return x < row.shape[-1] and bool(row[x] > float("-inf")) and \
            float(row[x] - row.max()) >= floor

    if params.greedy:
        choices = logits.argmax(-1).tolist()
        return accept_loosely(draft, choices.__getitem__, lambda i: entropy(logits[i]),
                              lambda i, x: plausible(logits[i].float(), x), loose)
    scores = filtered_logits(logits, params)
    seed, picked = seed_of(params), {}

    def choice_at(i: int) -> int:
        if i not in picked:
            picked[i] = keyed_choice(scores[i], seed, start + i)
        return picked[i]

    return accept_loosely(draft, choice_at, lambda i: entropy(scores[i]),
                          lambda i, x: plausible(scores[i], x), loose)


def entropy(scores: torch.Tensor) -> float:
    """Entropy in nats of softmax(scores) over one row of logits (-inf: impossible tokens).
    A row that is not a distribution (NaN) reads as 0: never loose."""
    return float(row_entropy(scores.reshape(1, -1))[0])


def accept_loosely(draft: list, choice_at: Callable[[int], int],
                   entropy_at: Callable[[int], float], possible: Callable[[int, int], bool],
                   params: LooseParams) -> tuple[int, int]:
    """FLy's rule over one draft. ``choice_at(i)``: the target's own token at draft position i
    (i = len(draft): the bonus position); ``entropy_at(i)``: the target's entropy there;
    ``possible(i, token)``: whether the target's processed distribution allows ``token`` at i.
    The callables are asked lazily, only where the rule needs them.

    Returns (n_accepted, token): the draft's first n tokens are kept, then ``token`` (the
    target's choice at n)."""
    n = len(draft)
    i = 0
    while i < n:
        token = choice_at(i)
        if not _same(draft[i], token) and not _loose_accept(draft, i, choice_at, entropy_at,
                                                             possible, params):
            return i, token
        i += 1
    return n, choice_at(n)


def _loose_accept(draft: list, i: int, choice_at, entropy_at, possible,
                  params: LooseParams) -> bool:
    x = draft[i]
    if not _is_id(x) or i + params.window >= len(draft):
        return False  # garbage, or the window is not all in this draft: cannot confirm
    if not entropy_at(i) > params.entropy or not possible(i, int(x)):
        return False
    return all(_same(draft[j], choice_at(j)) for j in range(i + 1, i + params.window + 1))


def _is_id(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and int(x) >= 0


@dataclass(frozen=True)
class TreeVerdict:
    """The accepted path (node indices, root's child first), its tokens, and the token the
    target emits after it."""

    path: list[int]
    tokens: list[int]
    token: int
    lenient: list[int] = field(default_factory=list)  # per path node: 1 if only a lossy rule

    @property
    def n_accepted(self) -> int:
        return len(self.path)


def verify_tree(logits: torch.Tensor, tree: DraftTree, params: SamplingParams, start: int,
                keep: list[bool] | None = None) -> TreeVerdict:
    """Verify one tree. logits: [1 + N, V] raw target logits (row 0 scores the token after the
    root, row 1 + i the token after node i, as ``forward_tree`` returns them); ``start``: the
    absolute position of the root's successor, so a node at depth d sits at start + d - 1.
    ``keep`` (PAD's rows): node i may stand where the target chose otherwise; a child holding
    the target's choice still goes first, then the first kept child."""
    if logits.dim() != 2 or logits.shape[0] < 1 + len(tree):
        raise ValueError(f"a tree of {len(tree)} nodes needs logits [{1 + len(tree)}, V], "
                         f"got {list(logits.shape)}")
    rows = logits[: 1 + len(tree)]
    if params.greedy:
        argmax = rows.argmax(-1).tolist()  # one transfer for every node

        def choose(row: int, pos: int) -> int:
            return argmax[row]
    else:
        scores = filtered_logits(rows, params)
        seed = seed_of(params)

        def choose(row: int, pos: int) -> int:
            return keyed_choice(scores[row], seed, pos)

    children = tree.children()
    node, depth = -1, 0
    lenient: list[int] = []
    path: list[int] = []
    while True:
        token = choose(node + 1, start + depth)  # node i's row is 1 + i, the root's (-1) 0
        nxt = next((c for c in children.get(node, ()) if tree.tokens[c] == token), None)
        exact = nxt is not None
        if nxt is None and keep is not None:  # a sampled row keeps only what its filters leave
            nxt = next((c for c in children.get(node, ()) if keep[c] and
                        (params.greedy or bool(scores[node + 1, tree.tokens[c]].isfinite()))),
                       None)
        if nxt is None:
            return TreeVerdict(path, [tree.tokens[i] for i in path], token, lenient)
        path.append(nxt)
        if keep is not None:
            lenient.append(0 if exact else 1)
        node, depth = nxt, depth + 1


def verify_batch(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
                 starts: list[int], verify: str | list[str] = "exact",
                 loose: LooseParams | None = None) -> list[tuple[int, int]]:
    """A padded batch of chains through the device path. logits: [B, T_max, V]; row b uses its
    first len(drafts[b]) + 1 positions; starts[b]: absolute position of row b's first draft
    token; ``verify``: "exact" or "loose", or one per row. Returns (n_accepted, token) per row."""
    modes = [verify] * len(drafts) if isinstance(verify, str) else list(verify)
    drafts = [list(d)[: logits.shape[1] - 1] for d in drafts]  # never past the row
    vb = VerifyBatch.build([(d, list(range(-1, len(d) - 1))) for d in drafts], starts, params,
                           modes, logits.device)
    out = verify_step(logits, vb, loose)
    return [(len(p), t) for p, t in zip(out.paths, out.tokens)]
