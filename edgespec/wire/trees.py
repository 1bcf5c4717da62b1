"""Token trees on the wire: a chain draft with branches as a ``DraftChunk``'s nodes and parent
indices (``tree_version`` 1), and back, with the shape checked.

Version 1: ``tokens`` are the chunk's nodes, the chain first; ``tree_parents[i]`` is node i's
parent in the chunk, -1 for the token before ``start``. The chain is the leading run of nodes
whose parent is the node before them (node 0 hangs from -1). Every later node either starts a
branch (its parent is -1 or a chain node other than the last: it is an alternative to the chain
node after its parent) or continues the branch of the node right before it. So a branch is a
chain hanging from the chain, as ``DraftSession.propose_tree`` proposes them.
"""

from __future__ import annotations

from typing import Sequence

from ..config import MAX_TREE_NODES
from ..protocol.contract import Branch, chunk_branches, spine_length

TREE_VERSION = 1  # the newest tree chunk layout this code reads and writes
MAX_BRANCH_NODES = MAX_TREE_NODES  # branch nodes one chunk may carry


def tree_to_wire(tokens: Sequence[int], branches: Sequence[Branch]
                 ) -> tuple[list[int], list[int]]:
    """A chain and its branches as (nodes, parents) of a version-1 tree chunk. Only what the
    session protocol would store is sent (``protocol.chunk_branches``: alternatives to a chain
    token, not repeated, within its bounds)."""
    nodes, parents = list(tokens), list(range(-1, len(tokens) - 1))
    for b in chunk_branches(tokens, branches, len(tokens)):
        parent = b.at - 1
        for t in b.tokens:
            nodes.append(int(t))
            parents.append(parent)
            parent = len(nodes) - 1
    return nodes, parents


def tree_from_wire(nodes: Sequence[int], parents: Sequence[int]
                   ) -> tuple[list[int], list[Branch]]:
    """(chain, branches) of a version-1 tree chunk, or ValueError saying what is wrong."""
    if len(nodes) != len(parents):
        raise ValueError(f"a tree chunk needs one parent per token: {len(nodes)} tokens, "
                         f"{len(parents)} parents")
    n = spine_length(parents)
    if len(nodes) - n > MAX_BRANCH_NODES:
        raise ValueError(f"a tree chunk carries at most {MAX_BRANCH_NODES} branch tokens")
    branches: list[tuple[int, list[int]]] = []
    for i in range(n, len(nodes)):
        p = parents[i]
        if -1 <= p <= n - 2:
            branches.append((p + 1, [nodes[i]]))
        elif p == i - 1 and i - 1 >= n:
            branches[-1][1].append(nodes[i])
        else:
            raise ValueError(f"tree_parents[{i}] = {p}: a node after the chain ({n} tokens) "
                             "must hang from -1, from a chain node but the last, or from the "
                             "node before it in its branch")
    return list(nodes[:n]), [Branch(at, tuple(toks)) for at, toks in branches]
