"""Steps through CUDA graph buckets (``edgespec.runner.step_graphs``): the bucket list, the
padding rules, and on a GPU the captures at start, replays with the eager fused forward's bits,
and a failed capture that leaves the runner serving eagerly. Where no GPU is, the buckets run
eagerly under Triton's interpreter (``tests/test_fused_runner.py`` holds them to the eager step
bit for bit and to target-only decoding)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from triton_on_cpu import require_triton

require_triton()
from edgespec.config import ConfigError  # noqa: E402
from edgespec.runner.step_graphs import (GRAPH_SLACK, SESSION_BUCKETS, TOKEN_BUCKETS,  # noqa: E402
                                         StepGraphs, bucket_of, session_buckets)
from edgespec.runner.step_rows import DraftShape, StepRows  # noqa: E402
from edgespec.runner.target_runner import TargetRunner  # noqa: E402

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                             reason="no CUDA device here: the GPU sitting runs it")


def test_a_size_goes_to_the_smallest_bucket_that_holds_it():
    # sessions: 1, 2, 4, then multiples of 8 (a step pads at most 7 rows) up to 128
    assert [bucket_of(n, SESSION_BUCKETS) for n in (1, 3, 9, 33, 64, 65, 128)] == \
        [1, 4, 16, 40, 64, 72, 128]
    assert bucket_of(129, SESSION_BUCKETS) is None
    assert session_buckets(5) == (1, 2, 4, 8) and session_buckets(20)[-1] == 24
    assert session_buckets(500)[-1] == 128
    assert all(b - a <= 8 for a, b in zip(SESSION_BUCKETS, SESSION_BUCKETS[1:]))
    assert [bucket_of(n, TOKEN_BUCKETS) for n in (1, 5, 6, 9, 16)] == [1, 5, 8, 9, 16]
    assert bucket_of(17, TOKEN_BUCKETS) is None


def test_graphs_need_the_fused_kernels(tiny):
    with pytest.raises(ConfigError, match="CUDA graphs replay the fused Triton kernels"):
        TargetRunner(tiny.model, n_slots=2, max_len=128, graphs=True, kernels="eager")


def test_a_cpu_runner_defaults_to_eager_kernels_without_graphs(tiny):
    runner = TargetRunner(tiny.model, n_slots=2, max_len=128)
    assert runner.kernels == "eager" and runner.graphs is None


def test_buckets_are_captured_largest_first_and_sized_by_the_slots(tiny_draft_dir):
    from edgespec.models.loading import load_model

    small = load_model(str(tiny_draft_dir), dtype="float32")
    runner = TargetRunner(small.model, n_slots=5, max_len=128, kernels="triton", graphs=True,
                          exact=False)
    g = runner.graphs
    assert g is not None and g.sessions == (1, 2, 4, 8)
    shapes = g.shapes()
    sizes = [b * t for b, t in shapes]
    assert sizes == sorted(sizes, reverse=True) and len(shapes) == 4 * len(TOKEN_BUCKETS)
    state = g.state()
    assert state.buckets == len(shapes) and state.captured == 0 and state.failed is None


def test_a_step_at_the_slots_end_is_bucketed_its_padding_in_the_slack(tiny_draft_dir):
    """Padding columns write into the positions a graphed runner keeps past a slot's last;
    only a step past those would not be bucketed."""
    from edgespec.models.loading import load_model

    small = load_model(str(tiny_draft_dir), dtype="float32")
    runner = TargetRunner(small.model, n_slots=1, max_len=128, kernels="triton", graphs=True,
                          exact=False)
    assert runner.cache.capacity >= 128 + GRAPH_SLACK and runner.cache.max_len == 128
    draft = DraftShape.of([([5, 6, 7, 8, 9], [-1, 0, 1, 2, 3])])
    runner.cache.lengths[0] = 122
    rows = StepRows.build([0], [122], [7], draft, "cpu")  # 122 + 6 tokens: the slot's last
    assert runner.graphs.shape_for(rows) == (1, 8)  # padded to 8 within the slack
    rows = StepRows.build([0], [runner.cache.capacity - 7], [7], draft, "cpu")
    assert runner.graphs.shape_for(rows) is None  # past the slack (no real row gets there)
    eager = TargetRunner(small.model, n_slots=1, max_len=128, kernels="triton", exact=False)
    assert eager.cache.capacity == 128  # without graphs, no slack


def _cuda_model(tiny, dtype):
    return copy.deepcopy(tiny.model).to("cuda", dtype)


def _random_rows(runner, slots, rng, tree):
    drafts = []
    for _ in slots:
        n = rng.randint(0, 8)
        parents = [rng.randrange(-1, i) if tree else i - 1 for i in range(n)]
        drafts.append(([rng.randrange(100) for _ in range(n)], parents))
    return StepRows.build(slots, [runner.cache.lengths[s] for s in slots],
                          [rng.randrange(100) for _ in slots], DraftShape.of(drafts),
                          runner.device)


@NO_CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cuda_replayed_steps_have_the_eager_bits(tiny, dtype):
    """Every bucket is captured at start; replays over changing rows, chains and trees, give
    the eager fused forward's bits, and write the same keys and values."""
    model = _cuda_model(tiny, dtype)
    eager = TargetRunner(model, n_slots=6, max_len=256, graphs=False)
    graphs = TargetRunner(model, n_slots=6, max_len=256)  # graphs by default on CUDA
    assert eager.kernels == graphs.kernels == "triton"
    state = graphs.graphs.state()
    assert state.failed is None and state.captured == state.buckets
    rng = random.Random(5)
    for s in range(6):
        prompt = [1] + [rng.randrange(2, 100) for _ in range(rng.randint(3, 90))]
        for r in (eager, graphs):
            r.prefill(s, prompt)
    for i in range(6):
        slots = sorted(rng.sample(range(6), rng.randint(1, 6)))
        rows = _random_rows(eager, slots, rng, tree=i % 2 == 1)
        want = eager.score_rows(rows)
        got = graphs.score_rows(rows)
        assert torch.equal(got.logits, want.logits)
        assert torch.equal(got.features, want.features)
        for s in slots:
            L = eager.cache.lengths[s] + rows.width
            assert torch.equal(graphs.cache.k[0][s, :, :L], eager.cache.k[0][s, :, :L])
    assert graphs.graphs.replays == 6


@NO_CUDA
def test_cuda_a_failed_capture_is_reported_and_steps_run_eagerly(tiny, monkeypatch):
    model = _cuda_model(tiny, torch.bfloat16)

    def broken(self, Bb, Tb):
        raise RuntimeError("capture broke on purpose")

    monkeypatch.setattr(StepGraphs, "_run", broken)
    runner = TargetRunner(model, n_slots=2, max_len=128)
    state = runner.graphs.state()
    assert state.captured == 0 and "capture broke on purpose" in state.failed
    monkeypatch.undo()
    runner.prefill(0, [1, 5, 6, 7])
    rows = StepRows.build([0], [4], [8], DraftShape.of([([9], [-1])]), runner.device)
    eager = TargetRunner(model, n_slots=2, max_len=128, graphs=False)
    eager.prefill(0, [1, 5, 6, 7])
    assert torch.equal(runner.score_rows(rows).logits, eager.score_rows(rows).logits)
    assert runner.graphs.replays == 0


@NO_CUDA
def test_cuda_every_bucket_is_captured_by_a_runner_whose_kernels_never_ran():
    """A graphed runner with no start check (its kernels never launched in this process: a head
    layout no other test uses) captures every bucket: each runs once eagerly first, so a kernel
    compiled for a new specialization (a one-session bucket's argument of 1) is loaded outside
    the capture. Seen on an H200: captures failing at buckets (1, 1) and (1, 9)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=200, hidden_size=96, intermediate_size=160,
                      num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=1,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval().to("cuda", torch.bfloat16)
    runner = TargetRunner(model, n_slots=2, max_len=64, graphs=True, exact=False)
    state = runner.graphs.state()
    assert state.failed is None and state.captured == state.buckets
    runner.prefill(0, [1, 5, 6, 7])
    rows = StepRows.build([0], [4], [8], DraftShape.of([([9], [-1])]), runner.device)
    eager = TargetRunner(model, n_slots=2, max_len=64, graphs=False, exact=False)
    eager.prefill(0, [1, 5, 6, 7])
    assert torch.equal(runner.score_rows(rows).logits, eager.score_rows(rows).logits)
    assert runner.graphs.replays == 1


def test_kernels_follow_the_device_and_the_head_size():
    """The fused kernels serve CUDA for heads of a power-of-two size (their block shape); other
    heads, and CPUs, take torch's ops; asking for the fused kernels with such a head is refused."""
    from edgespec.runner.kernel_set import kernels_for

    assert kernels_for(torch.device("cpu"), None, 64) == "eager"
    assert kernels_for(torch.device("cuda"), None, 64) == "triton"
    assert kernels_for(torch.device("cuda"), None, 80) == "eager"
    with pytest.raises(ConfigError, match="power-of-two head size, not 80"):
        kernels_for(torch.device("cuda"), "triton", 80)
