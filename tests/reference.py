"""Target-only references the tests compare with, built on the verifier's own maths: the
processed distribution a position samples from, the token target-only decoding emits there, and
the token-tree helpers the tree tests use (a trie of candidate continuations, a node's path,
one verification step of a tree drafted session)."""

from __future__ import annotations

import torch

from edgespec.config import SamplingParams
from edgespec.verify.keyed_noise import keyed_choice, seed_of
from oracles import filtered_logits
from edgespec.verify.trees import DraftTree
from oracles import TreeVerdict, verify_tree


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target probabilities after temperature, top-k and top-p. logits: [N, V] -> probs [N, V]."""
    return filtered_logits(logits, params).softmax(-1)


def sample_at(logits: torch.Tensor, params: SamplingParams, pos: int) -> int:
    """Target-only decoding of absolute position ``pos`` from its logits [V] (greedy: argmax)."""
    if params.greedy:
        return int(torch.argmax(logits.reshape(-1)))
    return keyed_choice(filtered_logits(logits.reshape(1, -1), params)[0], seed_of(params), pos)


def trie(branches) -> DraftTree:
    """The prefix tree of several candidate continuations: branches sharing a prefix share its
    nodes, numbered in the order they first appear."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for branch in branches:
        node = -1
        for t in branch:
            if (node, t) not in index:
                index[(node, t)] = len(tokens)
                tokens.append(t)
                parents.append(node)
            node = index[(node, t)]
    return DraftTree(tuple(tokens), tuple(parents))


def path_to(tree: DraftTree, node: int) -> list[int]:
    """The nodes from the root's child down to ``node`` (empty for the root, -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


def step_tree(runner, slot: int, root: int, tree: DraftTree, params: SamplingParams
              ) -> TreeVerdict:
    """One verification step of a session that drafted a tree: forward the tree after the
    slot's committed prefix, verify it, keep the accepted path's keys/values (the engine's step,
    for one session)."""
    start = runner.cache.lengths[slot] + 1  # the root sits at the slot's length
    logits = runner.forward_tree([slot], [root], [tree])[0]  # [1 + N, V]
    verdict = verify_tree(logits, tree, params, start)
    runner.compact(slot, verdict.path)
    return verdict
