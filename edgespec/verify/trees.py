"""Token trees: verifying several candidate continuations in one forward pass (SpecInfer,
CARD's beam tree).

A draft tree is (tokens, parents): node i holds tokens[i] and hangs from node parents[i], or from
the root (-1): the session's last committed token. Parents come first (parents[i] < i), so node
order is a topological order and every root-to-node path is a chain of increasing indices.

Verification walks from the root: at the current node the target decides its next token (greedy:
the argmax; sampling: the position-keyed sample of ``edgespec.verify.sampling`` at the absolute
position
of that token); if a child of the current node holds that token, the walk moves to it, else it
stops and emits the token. The accepted path is then the longest one that target-only decoding
would have produced, and the emitted tokens are exactly target-only decoding's: the keyed sample
at a position depends on (seed, position, the target's distribution there) only, never on which
candidates were drafted. A chain is the tree whose node i hangs from node i - 1, and gives
exactly ``verify_greedy`` / ``verify_keyed``'s verdict.

``TargetRunner.forward_tree`` computes the logits of every node with a tree attention mask;
``TargetRunner.compact`` keeps the accepted path's keys/values (the engine's step ties the
three).
Every node's logits are bitwise those of its root-to-node chain
(``edgespec.runner.attention``: branch
nodes read their ancestors' keys in decoding order), so the verdict is exactly decoding's.
``verify_tree`` states the walk for one tree; the verifier runs it for a whole step on the
device (``edgespec.verify.verify_step``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Sequence

import torch

from ..config import MAX_TREE_NODES, SamplingParams
from ..protocol.contract import Branch
from .keyed_noise import keyed_choice, seed_of
from .sampling import filtered_logits


def check_token(x, vocab_size: int, what: str = "token") -> int:
    """``x`` as a token id in [0, vocab_size), or ValueError."""
    if not isinstance(x, numbers.Integral) or isinstance(x, bool) or not 0 <= int(x) < vocab_size:
        raise ValueError(f"{what} must be a token id in [0, {vocab_size}), got {x!r}")
    return int(x)


@dataclass(frozen=True)
class DraftTree:
    """A draft tree: node i holds ``tokens[i]`` and hangs from node ``parents[i]`` (-1: the
    root). Construction checks the shape (equal lengths, -1 <= parents[i] < i); ``check`` adds
    the vocabulary and size limits."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        tokens, parents = list(self.tokens), list(self.parents)
        if len(tokens) != len(parents):
            raise ValueError(f"a tree needs one parent per token: {len(tokens)} tokens, "
                             f"{len(parents)} parents")
        for i, p in enumerate(parents):
            if not isinstance(p, numbers.Integral) or isinstance(p, bool) or not -1 <= p < i:
                raise ValueError(f"parents[{i}] must be -1 (the root) or an earlier node "
                                 f"in [0, {i}), got {p!r}")
        for i, t in enumerate(tokens):
            if not isinstance(t, numbers.Integral) or isinstance(t, bool) or t < 0:
                raise ValueError(f"tokens[{i}] must be a token id, got {t!r}")
        object.__setattr__(self, "tokens", tuple(int(t) for t in tokens))
        object.__setattr__(self, "parents", tuple(int(p) for p in parents))

    def __len__(self) -> int:
        return len(self.tokens)

    def check(self, vocab_size: int, max_nodes: int = MAX_TREE_NODES) -> "DraftTree":
        """Refuse (ValueError) a tree with a token outside the vocabulary or too many nodes."""
        if len(self) > max_nodes:
            raise ValueError(f"a tree has at most {max_nodes} nodes, got {len(self)}")
        for i, t in enumerate(self.tokens):
            check_token(t, vocab_size, f"tokens[{i}]")
        return self

    # -- shape -------------------------------------------------------------------------------
    def depths(self) -> list[int]:
        """Depth of each node: 1 for a child of the root."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self) -> dict[int, list[int]]:
        """Node -> its children in node order; key -1 is the root. Leaves are absent."""
        out: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i)
        return out

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def chain(cls, tokens: Sequence[int]) -> "DraftTree":
        """A chain draft as a tree: node i hangs from node i - 1."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))


def tree_of_draft(spine: Sequence[int], branches: Sequence[Branch]) -> DraftTree:
    """The verifier's node layout of a chain draft ``spine`` and its branches (each hangs from
    the spine token at - 1, or from the root when at is 0; at len(spine), a draft head's
    proposal past the chain, it extends the chain's last token). The spine is nodes
    0..len(spine) - 1, so a path's leading nodes below len(spine) are spine tokens; a branch
    that repeats existing nodes shares them (a trie), and one that does not hang from the
    spine is ignored."""
    tokens, parents = list(spine), list(range(-1, len(spine) - 1))
    index = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
    for b in branches:
        node = b.at - 1  # the spine node it hangs from; -1: the root
        if not -1 <= node < len(spine):
            continue
        for t in b.tokens:
            nxt = index.get((node, t))
            if nxt is None:
                nxt = index[(node, t)] = len(tokens)
                tokens.append(t)
                parents.append(node)
            node = nxt
    return DraftTree(tuple(tokens), tuple(parents))


@dataclass(frozen=True)
class TreeVerdict:
    """The accepted path (node indices, root's child first), its tokens, and the token the
    target emits after it."""

    path: list[int]
    tokens: list[int]
    token: int

    @property
    def n_accepted(self) -> int:
        return len(self.path)


def verify_tree(logits: torch.Tensor, tree: DraftTree, params: SamplingParams, start: int
                ) -> TreeVerdict:
    """Verify one tree. logits: [1 + N, V] raw target logits (row 0 scores the token after the
    root, row 1 + i the token after node i, as ``forward_tree`` returns them); ``start``: the
    absolute position of the root's successor, so a node at depth d sits at start + d - 1."""
    if logits.dim() != 2 or logits.shape[0] < 1 + len(tree):
        raise ValueError(f"a tree of {len(tree)} nodes needs logits [{1 + len(tree)}, V], "
                         f"got {list(logits.shape)}")
    tree.check(logits.shape[-1], max_nodes=len(tree))
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
    path: list[int] = []
    while True:
        token = choose(node + 1, start + depth)  # node i's row is 1 + i, the root's (-1) 0
        nxt = next((c for c in children.get(node, ()) if tree.tokens[c] == token), None)
        if nxt is None:
            return TreeVerdict(path, [tree.tokens[i] for i in path], token)
        path.append(nxt)
        node, depth = nxt, depth + 1
