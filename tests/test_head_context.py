"""A session's head context after a step (``heads.drafting.next_context``) and CTC's collapse,
against plain Python on chains and trees."""

import torch

from edgespec.heads.drafting import _collapse_ctc, next_context


def _step(W, old_pairs, node_tokens, parents, accepted_nodes, emitted, H=3):
    """One session: old_pairs [(feature id, token)], a tree (node tokens and parents), the
    accepted path's nodes, the emitted token. Row r's feature is the vector filled with 100 + r."""
    N = len(node_tokens)
    depths = [0]
    for p in parents:
        depths.append(depths[p + 1] + 1)
    feats = torch.stack([torch.full((H,), 100.0 + r) for r in range(1 + N)])[None]
    old_f = torch.zeros(1, W, H)
    old_t = torch.zeros(1, W, dtype=torch.long)
    old_v = torch.zeros(1, W, dtype=torch.bool)
    for j, (f, t) in enumerate(old_pairs):
        at = W - len(old_pairs) + j
        old_f[0, at], old_t[0, at], old_v[0, at] = f, t, True
    acc = torch.zeros(1, N, dtype=torch.bool)
    acc[0, accepted_nodes] = True
    return next_context(old_f, old_t, old_v, feats, torch.tensor([node_tokens]),
                        torch.tensor([depths]), acc, torch.tensor([emitted]))


def _pairs(f, t, v):
    return [(int(f[0, i, 0]), int(t[0, i])) for i in range(t.shape[1]) if v[0, i]]


def test_a_chain_step_appends_the_root_and_the_accepted_nodes():
    f, t, v = _step(4, [(7, 70)], [11, 12, 13], [-1, 0, 1], [0, 1], emitted=99)
    # root row 0 is followed by node 0's token; node 0 (row 1) by node 1's; node 1 by emitted
    assert _pairs(f, t, v) == [(7, 70), (100, 11), (101, 12), (102, 99)]


def test_the_window_keeps_the_last_pairs():
    f, t, v = _step(3, [(5, 50), (6, 60), (7, 70)], [11], [-1], [], emitted=42)
    assert _pairs(f, t, v) == [(6, 60), (7, 70), (100, 42)]


def test_a_tree_path_through_a_branch_gathers_its_own_rows():
    # nodes: 0:a(root child) 1:b(child of 0) 2:c(child of root) 3:d(child of 2)
    f, t, v = _step(6, [], [21, 22, 23, 24], [-1, 0, -1, 2], [2, 3], emitted=77)
    assert _pairs(f, t, v) == [(100, 23), (103, 24), (104, 77)]


def test_ctc_collapses_repeats_and_drops_blanks():
    blank = 5
    ids = torch.arange(100, 105)  # draft id i is target id 100 + i
    best = torch.tensor([[1, 1, 5, 1, 2, 2, 5, 5], [5, 5, 5, 5, 5, 5, 5, 5]])
    out = _collapse_ctc(best, blank, ids, 4).tolist()
    assert out == [[101, 101, 102, -1], [-1, -1, -1, -1]]
