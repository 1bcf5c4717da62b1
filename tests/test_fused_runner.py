"""The runner on the fused kernels (``kernels="triton"``: the GPU path, here under Triton's
interpreter on CPU tensors): it computes the model (against the eager runner), a row's bits do
not depend on the batch or on whether it was a chain or a tree node, a graph bucket's step has
the eager step's bits, the start check covers the fused kernels, and speculative decoding over
them is target-only decoding."""

from __future__ import annotations

import random

import pytest
import torch

from triton_on_cpu import require_triton

require_triton()
from edgespec.config import ConfigError, EngineConfig, SamplingParams  # noqa: E402
from edgespec.drafters import build_drafter  # noqa: E402
from edgespec.engine.spec_engine import Request, SpecEngine  # noqa: E402
from edgespec.runner import fused_attention, fused_attention_probe, fused_kernels  # noqa: E402
from edgespec.runner.step_rows import DraftShape, StepRows  # noqa: E402
from edgespec.runner.target_runner import TargetRunner  # noqa: E402


pytestmark = pytest.mark.slow  # Triton's interpreter: about a minute in all


@pytest.fixture(scope="module")
def small(tiny_draft_dir):
    """A two-layer tiny Llama (the interpreter runs every kernel program in Python), on the
    GPU where there is one."""
    from edgespec.models.loading import load_model

    loaded = load_model(str(tiny_draft_dir), dtype="float32")
    if torch.cuda.is_available():
        loaded.model.to("cuda")
    return loaded


def _fused(model, n_slots=4, graphs=False, exact=False, **kw):
    # exact=False: the start check runs in its own test (minutes of interpreted probes here)
    return TargetRunner(model, n_slots=n_slots, max_len=256, kernels="triton", graphs=graphs,
                        exact=exact, **kw)


def _prefill(runner, slot, rng, n):
    runner.cache.lengths[slot] = 0
    prompt = [1] + [rng.randrange(3, 100) for _ in range(n)]
    runner.prefill(slot, prompt)
    return prompt


def _chains(runner, slots, drafts, roots):
    shape = DraftShape.of([(d, list(range(-1, len(d) - 1))) for d in drafts])
    return StepRows.build(slots, [runner.cache.lengths[s] for s in slots], roots, shape,
                          runner.device)


def test_the_fused_forward_computes_the_model(small):
    fused = _fused(small.model)
    eager = TargetRunner(small.model, n_slots=4, max_len=256, kernels="eager")
    assert fused.kernels == "triton" and eager.kernels == "eager"
    rng = random.Random(0)
    prompt = [1] + [rng.randrange(3, 100) for _ in range(70)]  # crosses a key block
    out = []
    for r in (fused, eager):
        slot = r.new_slot()
        r.prefill(slot, prompt[:-1])
        out.append(r.forward([slot], [prompt[-1:] + [5, 6, 7]]))
    torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=1e-4)


def test_ragged_chains_have_the_bits_of_one_at_a_time(small):
    runner = _fused(small.model)
    rng = random.Random(1)
    slots = [0, 2, 3]
    for s, n in zip(slots, (5, 66, 20)):
        _prefill(runner, s, rng, n)
    drafts = [[7, 8, 9, 10], [], [11, 12]]
    roots = [20, 21, 22]
    together = runner.score_rows(_chains(runner, slots, drafts, roots))
    for b, (s, d, root) in enumerate(zip(slots, drafts, roots)):
        alone = runner.score_rows(_chains(runner, [s], [d], [root]))
        n = 1 + len(d)
        assert torch.equal(alone.logits[0, :n], together.logits[b, :n])
        assert torch.equal(alone.features[0, :n], together.features[b, :n])


def test_a_tree_node_has_the_bits_of_its_chain(small):
    """Node 2 hangs from node 0 (a branch stored out of decoding order): its logits are those
    of the chain root, node 0, node 2 verified as a chain (the rows kernel's tree nodes:
    test_fused_attention, bit for bit against their chains)."""
    runner = _fused(small.model)
    rng = random.Random(2)
    _prefill(runner, 1, rng, 61)  # the root's position crosses into the next key block
    start = runner.cache.lengths[1]
    tokens, parents = [30, 31, 32, 33], [-1, -1, 0, 2]
    tree = runner.score_rows(StepRows.build([1], [start], [40],
                                            DraftShape.of([(tokens, parents)]), runner.device))
    chain = runner.score_rows(_chains(runner, [1], [[30, 32, 33]], [40]))
    for node, depth in ((0, 1), (2, 2), (3, 3)):
        assert torch.equal(tree.logits[0, 1 + node], chain.logits[0, depth])
    assert torch.equal(tree.logits[0, 0], chain.logits[0, 0])


@pytest.mark.parametrize("tree", [False, True])
def test_a_bucketed_step_has_the_eager_steps_bits(small, tree):
    rng = random.Random(3 + tree)
    eager = _fused(small.model, n_slots=5)
    padded = _fused(small.model, n_slots=5, graphs=True)
    assert padded.graphs is not None and padded.cache.free_slots == 5  # the scratch not lent
    slots = [0, 3, 4]
    for s in slots:
        _prefill(eager, s, rng, rng.randint(3, 40))
    n = eager.cache.capacity  # the graphed runner's slots hold more positions: the slack
    for layer in range(eager.n_layers):  # the same prefix in both (prefilled once)
        padded.cache.k[layer][:5, :, :n].copy_(eager.cache.k[layer][:5])
        padded.cache.v[layer][:5, :, :n].copy_(eager.cache.v[layer][:5])
    padded.cache.lengths[:5] = eager.cache.lengths[:5]
    if tree:
        drafts = [([5, 6, 7], [-1, -1, 1]), ([], []), ([8, 9], [-1, 0])]
    else:
        drafts = [([5, 6, 7], [-1, 0, 1]), ([], []), ([8, 9], [-1, 0])]
    shape = DraftShape.of(drafts)
    rows = StepRows.build(slots, [eager.cache.lengths[s] for s in slots], [1, 2, 3], shape,
                          eager.device)
    want = eager.score_rows(rows)
    got = padded.score_rows(rows)
    assert padded.graphs.replays == 1
    assert padded.graphs.shape_for(rows) == (4, 4)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.features, want.features)
    for s in slots:  # the keys and values the step wrote, which the next step reads
        L = eager.cache.lengths[s] + rows.width
        for layer in range(eager.n_layers):
            assert torch.equal(padded.cache.k[layer][s, :, :L], eager.cache.k[layer][s, :, :L])
            assert torch.equal(padded.cache.v[layer][s, :, :L], eager.cache.v[layer][s, :, :L])


def test_a_step_past_the_buckets_runs_eagerly_with_the_same_kernels(small):
    padded = _fused(small.model, n_slots=2, graphs=True)
    _prefill(padded, 0, random.Random(4), 10)
    rows = _chains(padded, [0], [list(range(5, 25))], [1])  # 21 tokens: past 16
    assert padded.graphs.shape_for(rows) is None
    padded.score_rows(rows)
    assert padded.graphs.replays == 0


def test_the_start_check_covers_the_fused_kernels(small, monkeypatch):
    runner = _fused(small.model, n_slots=1, exact=True, max_rows=8)
    assert runner.start_check_s is not None
    assert runner.attention == "tiles"  # the tiles' probe passed here
    real = fused_kernels.add_rms_norm

    def norm_by_rows(x, delta, weight, eps, out=None):
        got = real(x, delta, weight, eps, out)
        return got * (1 + 1e-3 * x.shape[0])

    monkeypatch.setattr(fused_kernels, "add_rms_norm", norm_by_rows)
    with pytest.raises(ConfigError, match="the fused RMS norm is not batch-invariant here"):
        _fused(small.model, n_slots=1, exact=True, max_rows=8)


def test_the_start_check_refuses_an_attention_that_varies_with_the_batch(small, monkeypatch):
    monkeypatch.setattr(fused_attention_probe, "probe_slot_attention",
                        lambda *a, kernel: "query 0 differs alone and among 3 sessions")
    with pytest.raises(ConfigError, match="the fused attention is not batch-invariant here "
                                          r"\(tiles: query 0 .*; rows: query 0"):
        _fused(small.model, n_slots=1, exact=True, max_rows=8)


def test_where_the_tiles_vary_the_runner_serves_with_the_rows_kernel(small, monkeypatch, caplog):
    monkeypatch.setattr(fused_attention_probe, "probe_slot_attention",
                        lambda *a, kernel: "tree node 2 differs" if kernel == "tiles" else None)
    runner = _fused(small.model, n_slots=1, exact=True, max_rows=8)
    assert runner.attention == "rows" and runner.run_state()["attention"] == "rows"
    assert "serving with the rows kernel" in caplog.text
    assert _fused(small.model, n_slots=1).attention == "tiles"  # unchecked: the default
    # a runner on the same layers (the layer-skip draft) keeps its owner's kernel
    assert _fused(small.model, n_slots=1, n_layers=1, share_weights=runner).attention == "rows"


def test_a_tiles_kernel_that_does_not_run_here_leaves_the_rows_kernel(small, monkeypatch,
                                                                      caplog):
    def probe(*a, kernel):  # the rows kernel's own probe: test_fused_attention runs it
        if kernel == "tiles":
            raise RuntimeError("out of resources: shared memory")
        return None

    monkeypatch.setattr(fused_attention_probe, "probe_slot_attention", probe)
    runner = _fused(small.model, n_slots=1, exact=True, max_rows=8)
    assert runner.attention == "rows"
    assert "RuntimeError: out of resources" in caplog.text




def _mag_equals_target_only(runner, prompts, params, new: int) -> None:
    """The prompts decoded together with MaG drafts give each prompt's target-only decoding
    alone, on ``runner``."""
    cfg = EngineConfig(max_sessions=len(prompts), max_context=runner.max_len)
    with SpecEngine(runner, None, cfg, stop_ids={2}) as engine:
        refs = [engine.generate(Request(p, new, q)).token_ids for p, q in zip(prompts, params)]
    with SpecEngine(runner, build_drafter("mag"), cfg, stop_ids={2}) as engine:
        got = engine.generate_many([Request(p, new, q) for p, q in zip(prompts, params)])
    assert [r.token_ids for r in got] == refs


def test_speculative_decoding_on_the_split_attention_across_key_chunks_is_target_only(
        small, monkeypatch):
    """Graphed steps on the split attention (keys in fixed chunks merged in order; chunks of 64
    here, not 256, so that short prompts cross two while they decode: the interpreter is slow;
    prompts of 61 and 63 tokens, 8 new: keys past 64 from the 4th and 2nd token)."""
    monkeypatch.setattr(fused_attention, "SPLIT_KEYS", 64)
    runner = TargetRunner(small.model, n_slots=2, max_len=128, kernels="triton", graphs=True,
                          exact=False, attention_kernel="split")
    assert runner.attention == "split" and runner.kernel_set.attention == "split"
    rng = random.Random(9)
    prompts = [[1] + [rng.randrange(3, 100) for _ in range(n)] for n in (60, 62)]
    _mag_equals_target_only(runner, prompts, [SamplingParams(), SamplingParams(temperature=0.8,
                                                                               seed=3)], 8)
    assert runner.graphs.replays > 0
    with pytest.raises(ConfigError, match="attention kernel must be one of"):
        _fused(small.model, n_slots=1, attention_kernel="flash")


@pytest.mark.parametrize("graphs", [False, True])
def test_speculative_decoding_on_the_fused_kernels_is_target_only(small, graphs):
    runner = _fused(small.model, n_slots=2, graphs=graphs)
    rng = random.Random(5)
    prompts = [[1] + [rng.randrange(3, 100) for _ in range(rng.randint(5, 20))]
               for _ in range(2)]
    _mag_equals_target_only(runner, prompts, [SamplingParams(), SamplingParams(temperature=0.8,
                                                                               seed=7)], 8)
    if graphs:
        assert runner.graphs.replays > 0


@pytest.mark.parametrize("graphs", [False, True])
def test_decode_steps_run_ahead_on_the_fused_kernels_are_target_only(small, graphs):
    """A target-only server's steps launched a step ahead (``decode_ahead``), their roots
    copied in on the device (into a graph bucket's inputs after its host copy): the outputs of
    the same steps launched one at a time, greedy and keyed sampling."""
    rng = random.Random(11)
    prompts = [[1] + [rng.randrange(3, 100) for _ in range(rng.randint(5, 20))]
               for _ in range(2)]
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=7)]
    outs = {}
    for ahead in (False, True):
        runner = _fused(small.model, n_slots=2, graphs=graphs)
        with SpecEngine(runner, None, EngineConfig(max_sessions=2, decode_ahead=ahead)) as eng:
            outs[ahead] = [r.token_ids for r in eng.generate_many(
                [Request(p, 6, sp) for p, sp in zip(prompts, params)])]
            assert (eng.ahead.claimed > 0) == ahead
        if graphs:
            assert runner.graphs.replays > 0
    assert outs[True] == outs[False] and all(len(o) == 6 for o in outs[True])
