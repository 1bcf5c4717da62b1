"""A step's rows built once (``edgespec.runner.step_rows``), held to the rules written out node by
node: depths, the ancestor matrix, the branch nodes' decoding-order keys, and one copy of each
kind to the device."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from reference import trie

from edgespec.runner.attention import KEY_BLOCK
from edgespec.runner.step_rows import DraftShape, StepRows, ancestor_rows
from edgespec.verify.trees import DraftTree


def _random_tree(rng: random.Random) -> DraftTree:
    kind = rng.random()
    if kind < 0.3:
        return DraftTree.chain([rng.randrange(100) for _ in range(rng.randint(0, 9))])
    return trie([[rng.randrange(4) for _ in range(rng.randint(1, 6))]
                 for _ in range(rng.randint(1, 5))])


def _depths(tree: DraftTree) -> list[int]:
    d = [0]
    for p in tree.parents:
        d.append(d[p + 1] + 1)
    return d


def _path_rows(tree: DraftTree, node: int) -> list[int]:
    """Rows of the root and of the node's ancestors down to it (row 1 + i is node i)."""
    path = []
    while node >= 0:
        path.append(1 + node)
        node = tree.parents[node]
    return [0] + path[::-1]


def _spine(tree: DraftTree) -> int:
    n = 0
    while n < len(tree) and tree.parents[n] == n - 1:
        n += 1
    return n


@pytest.mark.parametrize("seed", range(6))
def test_shape_depths_and_ancestors_are_the_node_by_node_rules(seed):
    rng = random.Random(seed)
    trees = [_random_tree(rng) for _ in range(rng.randint(1, 6))]
    shape = DraftShape.of([(t.tokens, t.parents) for t in trees])
    N = max(1, max(len(t) for t in trees))
    assert shape.nodes.shape == shape.parents.shape == (len(trees), N)
    assert shape.is_tree == any(_spine(t) < len(t) for t in trees)
    assert shape.max_depth == max(max(_depths(t)) for t in trees)
    seen = ancestor_rows(shape.parents, shape.counts)
    for b, t in enumerate(trees):
        n = len(t)
        assert list(shape.nodes[b, :n]) == list(t.tokens) and (shape.nodes[b, n:] == -1).all()
        assert list(shape.depths[b, :n + 1]) == _depths(t)
        assert (shape.depths[b, n + 1:] == 0).all()
        for i in range(n):
            assert sorted(seen[b, 1 + i].nonzero()[0]) == sorted(_path_rows(t, i))
        last = _path_rows(t, n - 1) if n else [0]
        for r in range(n + 1, N + 1):  # a padding row hangs from the row before it
            assert sorted(seen[b, r].nonzero()[0]) == last + list(range(n + 1, r + 1))


@pytest.mark.parametrize("seed", range(6))
def test_branch_nodes_read_their_ancestors_in_decoding_order(seed):
    rng = random.Random(100 + seed)
    trees = [_random_tree(rng) for _ in range(rng.randint(1, 5))]
    if all(_spine(t) == len(t) for t in trees):
        trees.append(trie([[1, 2, 3], [1, 5], [4]]))
    starts = [rng.randrange(300) for _ in trees]
    shape = DraftShape.of([(t.tokens, t.parents) for t in trees])
    rows = StepRows.build(list(range(len(trees))), starts, [7] * len(trees), shape, "cpu")
    assert rows.tree and rows.tail is not None
    tail = rows.tail
    expected = [(b, 1 + i) for b, t in enumerate(trees) for i in range(_spine(t), len(t))]
    assert list(zip(tail.rows.tolist(), tail.queries.tolist())) == expected
    for s, (b, q) in enumerate(expected):
        first = KEY_BLOCK * (starts[b] // KEY_BLOCK)
        want = list(range(first, starts[b])) + \
            [starts[b] + r for r in _path_rows(trees[b], q - 1)]
        assert tail.block0[s] == starts[b] // KEY_BLOCK
        assert tail.index[s, :len(want)].tolist() == want
        assert tail.visible[s].tolist() == [j < len(want) for j in range(tail.index.shape[1])]
        assert (tail.index[s, len(want):] == 0).all()
    assert tail.index.shape[1] % KEY_BLOCK == 0
    assert tail.n_blocks == max(int(k) + tail.index.shape[1] // KEY_BLOCK for k in tail.block0)


def test_chains_run_as_chains_unless_a_tree_forward_is_asked_for():
    shape = DraftShape.of([([5, 6, 7], [-1, 0, 1]), ([], [])])
    assert not shape.is_tree and shape.max_depth == 3
    chains = StepRows.build([0, 1], [10, 20], [1, 2], shape, "cpu")
    assert not chains.tree and chains.ancestors is None and chains.tail is None
    assert chains.tokens.tolist() == [[1, 5, 6, 7], [2, 0, 0, 0]]
    forced = StepRows.build([0, 1], [10, 20], [1, 2], shape, "cpu", tree=True)
    assert forced.tree and forced.tail is None and forced.ancestors is not None
    assert forced.ancestors.shape == (2, 4, 4)
    empty = StepRows.build([0], [3], [9], DraftShape.of([([], [])]), "cpu")
    assert empty.width == 1 and empty.tokens.tolist() == [[9]]
    # a chain's token t sits at depth t in every row (the host's copy, shared by the steps of
    # a shape: read-only), a forced tree's at its node's depth (padding 0)
    again = StepRows.build([1, 0], [4, 8], [3, 4], shape, "cpu")
    for rows in (chains, again):
        assert rows.host.depth.tolist() == [[0, 1, 2, 3]] * 2
        assert not rows.host.depth.flags.writeable
    assert forced.host.depth.tolist() == [[0, 1, 2, 3], [0, 0, 0, 0]]


def test_the_rows_reach_the_device_in_one_copy_per_kind(monkeypatch):
    """Integers in one copy, booleans in another, however many rows and branches (to a device
    other than the host: "meta" here); on the CPU the host buffer is the tensors, no copy."""
    copies = []
    orig = torch.Tensor.to
    me = threading.get_ident()  # another test's thread left running here moves its own

    def counting(t, *a, **k):
        if threading.get_ident() == me and any(isinstance(x, (str, torch.device))
                                               for x in (*a, k.get("device"))):
            copies.append(t.dtype)  # a move to a device, not a cast
        return orig(t, *a, **k)

    shape = DraftShape.of([(t.tokens, t.parents) for t in
                           [trie([[1, 2, 3], [1, 5], [4]]), DraftTree.chain([3, 3])]])
    monkeypatch.setattr(torch.Tensor, "to", counting)
    rows = StepRows.build([0, 1], [70, 5], [1, 1], shape, "meta")
    assert sorted(map(str, copies)) == ["torch.bool", "torch.int64"]
    assert rows.tokens.device.type == "meta" and rows.ancestors is not None
    copies.clear()
    on_cpu = StepRows.build([0, 1], [70, 5], [1, 1], shape, "cpu")
    assert copies == []
    assert on_cpu.tokens.tolist() == [[1, 1, 2, 3, 5, 4], [1, 3, 3, 0, 0, 0]]


def test_every_part_of_the_copy_starts_at_a_16_byte_boundary():
    """The fused kernels read a step's slots, starts, depths and paths through pointers Triton
    specialises on 16-byte alignment: in every step they keep it (one binary)."""
    for drafts in ([([5, 6, 7], [-1, 0, 1]), ([], [])],  # odd sizes
                   [(t.tokens, t.parents) for t in [trie([[1, 2, 3], [1, 5], [4]]),
                                                     DraftTree.chain([3])]]):
        rows = StepRows.build([0, 2, 1][:len(drafts)], [70, 5, 9][:len(drafts)],
                              [1, 1, 1][:len(drafts)], DraftShape.of(drafts), "cpu")
        parts = [rows.slot_index, rows.start_index, rows.tokens, rows.depths]
        if rows.path is not None:
            parts.append(rows.path)
        assert all(p.data_ptr() % 16 == 0 for p in parts)
        assert rows.slot_index.tolist() == [0, 2, 1][:len(drafts)]
        assert rows.start_index.tolist() == [70, 5, 9][:len(drafts)]


def test_a_padding_row_s_path_is_itself():
    """A tree's padding row (past its row's nodes) reads its own key: path[t][0] = t."""
    shape = DraftShape.of([([1, 2, 3], [-1, -1, 0]), ([4], [-1])])
    rows = StepRows.build([0, 1], [10, 20], [7, 8], shape, "cpu", tree=True)
    assert rows.path is not None
    for t in (2, 3):  # row 1's rows past its one node
        assert rows.path[1, t, 0] == t and rows.depths[1, t] == 0


@pytest.mark.parametrize("seed", range(4))
def test_chains_laid_out_at_once_equal_the_general_layout(seed):
    """``DraftShape.of_chains`` (the step's layout when no row branches) gives every array
    ``DraftShape.of`` gives the same drafts as chains, empty rows and an empty batch's width
    included."""
    rng = random.Random(seed)
    decode = [[] for _ in range(rng.randint(1, 12))]  # every row its root alone
    for chains in ([[rng.randrange(500) for _ in range(rng.randrange(0, 9))]
                    for _ in range(rng.randint(1, 12))], [[]], [[], [3]], decode, decode):
        fast = DraftShape.of_chains(chains)
        slow = DraftShape.of([(c, list(range(-1, len(c) - 1))) for c in chains])
        for name in ("nodes", "parents", "depths", "counts"):
            assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
        assert (fast.max_nodes, fast.max_depth, fast.is_tree, fast.ancestors) == \
            (slow.max_nodes, slow.max_depth, False, None)


@pytest.mark.parametrize("seed", range(40))
def test_rows_outside_the_vocabulary_are_the_rows_holding_such_an_id(seed):
    """``rows_outside`` names exactly the rows holding an id below 0 (-1, the padding's value,
    included) or at or past the vocabulary, for chains laid out at once and for trees, rows
    without nodes among them."""
    rng = random.Random(seed)
    vocab = 50
    drafts = []
    for _ in range(rng.randint(1, 8)):
        tree = _random_tree(rng) if rng.random() < 0.5 else \
            DraftTree.chain([rng.randrange(vocab) for _ in range(rng.randint(0, 6))])
        tokens = [t % vocab for t in tree.tokens]
        if tokens and rng.random() < 0.3:
            tokens[rng.randrange(len(tokens))] = rng.choice([-1, -2, -(1 << 40), vocab,
                                                              vocab + 3, 1 << 40])
        drafts.append((tokens, list(tree.parents)))
    want = [b for b, (tokens, _) in enumerate(drafts)
            if any(t < 0 or t >= vocab for t in tokens)]
    assert DraftShape.of(drafts).rows_outside(vocab) == want
    chains = [t for t, p in drafts if list(p) == list(range(-1, len(t) - 1))]
    assert DraftShape.of_chains(chains).rows_outside(vocab) == \
        [b for b, tokens in enumerate(chains) if any(t < 0 or t >= vocab for t in tokens)]


def test_a_decode_steps_shared_layout_is_read_only_and_its_rows_are_the_roots():
    """A decode step's layout is built once per batch size and shared by every such step:
    its arrays refuse a write, and the rows built on it hold each session's root alone, as
    rows built on a layout of the step's own do."""
    shape = DraftShape.of_chains([(), ()])
    assert DraftShape.of_chains([(), ()]) is shape
    for a in (shape.nodes, shape.parents, shape.depths, shape.counts):
        with pytest.raises(ValueError):
            a[0] = 7
    own = DraftShape.of([((), ()), ((), ())])
    for tree in (None, True):
        rows = StepRows.build([3, 1], [10, 20], [5, 6], shape, "cpu", tree=tree)
        ref = StepRows.build([3, 1], [10, 20], [5, 6], own, "cpu", tree=tree)
        assert rows.tokens.tolist() == ref.tokens.tolist() == [[5], [6]]
        for name in ("nodes", "parents", "depths", "counts", "slot_index", "start_index"):
            assert torch.equal(getattr(rows, name), getattr(ref, name)), name
        assert shape.rows_outside(4) == []


@pytest.mark.parametrize("align", [None, 4096], ids=["own-arrays", "one-buffer"])
def test_parts_on_the_cpu_are_copies_of_their_arrays_at_16_byte_boundaries(monkeypatch, align):
    """``to_device`` on the CPU: each part a tensor with its array's values, shape and the dtype
    asked, contiguous (a strided, broadcast or column-major array's too), aligned, sharing no
    memory with the array it came from (a write to either leaves the other as it was), strided
    views and empty parts among them; where the allocator's tensors are not at the boundary
    asked (4096 bytes here), the one aligned buffer's views instead."""
    from edgespec.runner import host_transfers

    if align is not None:
        monkeypatch.setattr(host_transfers, "ALIGN_BYTES", align)
    base = np.arange(24, dtype=np.int64).reshape(4, 6)
    parts = [base, base[:, ::2], np.zeros(0, dtype=np.int64), np.array([7, 8, 9]),
             np.broadcast_to(np.arange(3), (2, 3)), np.asfortranarray(base)]
    got = host_transfers.to_device(parts, "cpu", torch.long)
    for a, t in zip(parts, got):
        assert t.dtype == torch.long and t.shape == a.shape and t.tolist() == a.tolist()
        assert t.is_contiguous() and (t.numel() == 0 or t.data_ptr() % 16 == 0)
    got[0][0, 0] = -5
    assert base[0, 0] == 0
    base[1, 1] = -6
    assert got[0][1, 1] == 7
    flags = host_transfers.to_device([np.array([True, False])], torch.device("cpu"), torch.bool)
    assert flags[0].dtype == torch.bool and flags[0].tolist() == [True, False]
