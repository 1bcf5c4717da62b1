"""Token trees: verifying several candidate continuations in one forward pass (SpecInfer,
CARD's beam tree).

A draft tree is (tokens, parents): node i holds tokens[i] and hangs from node parents[i], or from
the root (-1): the session's last committed token. Parents come first (parents[i] < i), so node
order is a topological order and every root-to-node path is a chain of increasing indices.

Verification walks from the root: at the current node the target decides its next token (greedy:
the argmax; sampling: the position-keyed sample at the absolute position of that token); if a
child of the current node holds that token, the walk moves to it, else it stops and emits the
token. The accepted path is then the longest one that target-only decoding would have produced,
and the emitted tokens are exactly target-only decoding's: the keyed sample at a position depends
on (seed, position, the target's distribution there) only, never on which candidates were
drafted. A chain is the tree whose node i hangs from node i - 1.

``TargetRunner.forward_tree`` computes the logits of every node with a tree attention mask;
``TargetRunner.compact`` keeps the accepted path's keys/values (the engine's step ties the
three). Every node's logits are bitwise those of its root-to-node chain
(``edgespec.runner.attention``: branch nodes read their ancestors' keys in decoding order), so
the verdict is exactly decoding's. The verifier walks every tree of a step at once on the device
(``edgespec.verify.verify_step``); tests/oracles.py ``verify_tree`` walks one.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Sequence

from ..protocol.contract import Branch


@dataclass(frozen=True)
class DraftTree:
    """A draft tree: node i holds ``tokens[i]`` and hangs from node ``parents[i]`` (-1: the
    root). Construction checks the shape (equal lengths, -1 <= parents[i] < i); the token ids
    were checked where the draft entered (the stores)."""

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
