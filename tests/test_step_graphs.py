"""Steps of chains padded up to bucketed shapes (``edgespec.runner.step_graphs``): the path CUDA
graphs replay, run eagerly here (no GPU), held bit for bit to the unpadded forward and to
target-only decoding. The capture itself runs only on a GPU (the GPU sitting's tests)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import hf_greedy

from edgespec.config import EngineConfig, SamplingParams
from edgespec.drafters import build_drafter
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.runner.step_graphs import SESSION_BUCKETS, TOKEN_BUCKETS, bucket_of
from edgespec.runner.step_rows import DraftShape, StepRows
from edgespec.runner.target_runner import TargetRunner


def test_a_size_goes_to_the_smallest_bucket_that_holds_it():
    assert [bucket_of(n, SESSION_BUCKETS) for n in (1, 3, 9, 64)] == [1, 4, 12, 64]
    assert bucket_of(65, SESSION_BUCKETS) is None
    assert [bucket_of(n, TOKEN_BUCKETS) for n in (1, 5, 9)] == [1, 6, 12]


def _rows(runner, slots, rng):
    drafts = []
    for _ in slots:
        n = rng.randint(0, 6)
        drafts.append(([rng.randrange(100) for _ in range(n)], list(range(-1, n - 1))))
    return StepRows.build(slots, [runner.cache.lengths[s] for s in slots],
                          [rng.randrange(100) for _ in slots], DraftShape.of(drafts),
                          runner.device)


@pytest.mark.parametrize("seed", range(4))
def test_a_bucketed_step_has_the_eager_steps_bits(tiny, seed):
    rng = random.Random(seed)
    eager = TargetRunner(tiny.model, n_slots=6, max_len=256, graphs=False)
    padded = TargetRunner(tiny.model, n_slots=6, max_len=256, graphs=True)
    assert eager.graphs is None and padded.graphs is not None
    assert padded.cache.free_slots == eager.cache.free_slots == 6  # the scratch is not lent
    n = rng.randint(1, 5)
    slots = sorted(rng.sample(range(6), n))  # not always a run of consecutive slots
    for s in slots:
        prompt = [1] + [rng.randrange(2, 100) for _ in range(rng.randint(3, 90))]
        for r in (eager, padded):
            r.cache.lengths[s] = 0
            r.prefill(s, prompt)
    rows = _rows(eager, slots, rng)
    want = eager.score_rows(rows)
    got = padded.score_rows(rows)
    assert padded.graphs.replays == 1
    assert torch.equal(got.logits, want.logits) and torch.equal(got.features, want.features)
    # the KV each step kept is the same too: the next step reads it
    for s in slots:
        L = eager.cache.lengths[s] + rows.width
        for layer in range(eager.n_layers):
            assert torch.equal(padded.cache.k[layer][s, :, :L], eager.cache.k[layer][s, :, :L])


def test_trees_run_eagerly(tiny):
    runner = TargetRunner(tiny.model, n_slots=2, max_len=128, graphs=True)
    for s in (0, 1):
        runner.new_slot()
        runner.prefill(s, [1, 5, 6, 7])
    shape = DraftShape.of([([5, 6, 9], [-1, 0, 0]), ([8], [-1])])  # node 2 hangs off the chain
    rows = StepRows.build([0, 1], [3, 3], [7, 7], shape, runner.device)
    assert rows.tree
    runner.score_rows(rows)
    assert runner.graphs.replays == 0


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, seed=7)],
                         ids=["greedy", "sampled"])
def test_generation_through_buckets_is_target_onlys(tiny, tiny_dir, params):
    prompts = [[1, 10, 11, 12, 13, 10, 11], [1, 50, 51, 52], [1, 30, 31, 30, 31, 30, 31]]
    cfg = EngineConfig(max_draft=4, draft_wait_ms=2000)

    def run(graphs: bool, drafter: bool):
        runner = TargetRunner(tiny.model, n_slots=3, max_len=128, graphs=graphs)
        d = build_drafter("mag") if drafter else None
        with SpecEngine(runner, d, cfg, stop_ids={2}) as engine:
            out = engine.generate_many([Request(p, 24, params) for p in prompts])
        return [r.token_ids for r in out], runner

    target_only, _ = run(graphs=False, drafter=False)
    spec, runner = run(graphs=True, drafter=True)
    assert spec == target_only
    assert runner.graphs.replays > 0
    if params.greedy:
        assert target_only == [hf_greedy(tiny.model, p, 24) for p in prompts]


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device here: the GPU sitting runs it")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cuda_captured_steps_replay_the_eager_bits(tiny, dtype):
    """On a GPU: the first step of a bucket captures its graph, later steps replay it, and
    every replay gives the eager forward's bits, over changing rows of the same bucket."""
    import copy

    model = copy.deepcopy(tiny.model).to("cuda", dtype)
    eager = TargetRunner(model, n_slots=6, max_len=256, graphs=False)
    graphs = TargetRunner(model, n_slots=6, max_len=256, graphs=True)
    rng = random.Random(5)
    for s in range(6):
        prompt = [1] + [rng.randrange(2, 100) for _ in range(rng.randint(3, 50))]
        for r in (eager, graphs):
            r.prefill(s, prompt)
    for _ in range(4):
        slots = sorted(rng.sample(range(6), 3))
        rows = _rows(eager, slots, rng)
        want = eager.score_rows(rows)
        got = graphs.score_rows(rows)
        assert torch.equal(got.logits, want.logits)
    assert graphs.graphs.replays == 4 and any(b.graph is not None
                                              for b in graphs.graphs.buckets.values())


def test_a_step_too_near_the_slots_end_for_its_bucket_runs_eagerly(tiny):
    """Padding columns must not write past a slot's end: such a step is not bucketed."""
    eager = TargetRunner(tiny.model, n_slots=1, max_len=128, graphs=False)
    padded = TargetRunner(tiny.model, n_slots=1, max_len=128, graphs=True)
    prompt = [1] + [5 + i % 90 for i in range(120)]
    for r in (eager, padded):
        r.new_slot()
        r.prefill(0, prompt)
    rows = StepRows.build([0], [eager.cache.lengths[0]], [7],
                          DraftShape.of([([5, 6, 7, 8, 9, 10], [-1, 0, 1, 2, 3, 4])]), "cpu")
    assert padded.graphs.shape_for(rows) is None  # 121 + 7 tokens fit, the bucket's 8 do not
    got, want = padded.score_rows(rows), eager.score_rows(rows)
    assert padded.graphs.replays == 0 and torch.equal(got.logits, want.logits)
