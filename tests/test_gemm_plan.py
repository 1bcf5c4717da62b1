"""The products' kernels by row count (``edgespec.runner.gemm_plan``): the measured bands, the
start proof that keeps only kernels giving the tiles' bits, a planned layer's rows with the
tiles' bits at every row count, and on a GPU a runner of measured shapes planned and stepping
with the bits of the same runner on the tiles alone. On a CPU the Triton GEMM runs under
Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from triton_on_cpu import require_triton

require_triton()
from edgespec.runner.fused_gemm import GemmConfig, fits, gemm  # noqa: E402
from edgespec.runner.gemm_plan import (BY_NAME, MEASURED, Band, GemmPlan,  # noqa: E402
                                       attach_plans, plan_for, prove_plan)
from edgespec.runner.linear import Linear  # noqa: E402

SMALL = GemmConfig(16, 32, 128, group_m=16, split_k=False)
WIDE = GemmConfig(64, 64, 64, group_m=16, split_k=False)


def test_a_measured_product_has_a_kernel_a_band_and_others_have_none():
    plan = plan_for(4096, 4096, torch.bfloat16)  # the 8b attention output
    assert plan is not None
    assert [plan.config_for(r) for r in (1, 16)] == [BY_NAME["16x32x128/w4s4g16/nosplit"]] * 2
    assert plan.config_for(17) is None and plan.config_for(128) is None  # the tiles
    assert plan.config_for(129) == plan.config_for(576) == BY_NAME["64x64x64/w4s4g16/nosplit"]
    assert plan_for(4096, 4096, torch.float32) is None  # measured in bfloat16 only
    assert plan_for(4096, 14336, torch.bfloat16) is None  # 8b down: no kernel gave its bits
    assert plan_for(100, 100, torch.bfloat16) is None
    for (n, k), bands in MEASURED.items():  # every band names a kernel; the last takes any rows
        tops = [top for top, _ in bands]
        assert tops[-1] is None and tops[:-1] == sorted(tops[:-1])
        assert plan_for(n, k, torch.bfloat16) is not None


class _TilesOf(Linear):
    """A layer whose 'tiles' are one Triton configuration's kernel: the reference the proof
    holds a plan to, with a kernel known to give its bits (on a CPU torch's product and the
    interpreter's sum in other orders)."""

    def __init__(self, weight, config):
        super().__init__(weight, pack=False, tiled=True)
        self.reference = config

    def tiles_cublas(self, rows):
        return gemm(rows, self.weight, config=self.reference)


def _layer(config, k=1024):  # K of 8 steps of 128: block_k 64 sums in another order
    g = torch.Generator().manual_seed(0)
    return _TilesOf((torch.randn(136, k, generator=g) * 0.05).to(torch.bfloat16), config)


def test_the_proof_keeps_the_kernels_giving_the_tiles_bits_and_drops_the_others():
    lin = _layer(SMALL)
    x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert not torch.equal(gemm(x, lin.weight, config=WIDE), gemm(x, lin.weight, config=SMALL))
    plan = GemmPlan((Band(16, SMALL), Band(128, None), Band(None, WIDE)), 136, 1024)
    proven, why = prove_plan(lin, plan, rows=128)
    assert proven is not None
    assert proven.config_for(1) == SMALL and proven.config_for(500) is None  # WIDE dropped
    assert why == [f"{WIDE.name}: other bits than the tiles"]
    assert "more: tiles" in proven.describe()
    only_wide, why = prove_plan(lin, GemmPlan((Band(None, WIDE),), 136, 1024), rows=128)
    assert only_wide is None and len(why) == 1  # nothing but the tiles left


def test_a_planned_layer_gives_its_rows_the_tiles_bits_at_every_row_count():
    lin = _layer(SMALL)
    plan = GemmPlan((Band(16, SMALL), Band(None, WIDE)), 136, 1024)
    lin.plan, _ = prove_plan(lin, plan, rows=128)
    assert lin.plan is not None and lin.plan.configs == [SMALL]
    rows = torch.randn(256, 1024, generator=torch.Generator().manual_seed(2))
    rows = rows.to(torch.bfloat16)
    want = lin.tiles_cublas(rows)
    for used in (1, 16, 17, 130):  # either side of the band's edge, and past a tile
        assert torch.equal(lin.tiles(rows, used)[:used], want[:used]), used
    assert torch.equal(lin(rows[:3]), want[:3])  # through the padded call too


def test_a_kernel_that_does_not_build_is_dropped_with_its_reason():
    lin = _layer(SMALL)
    broken = GemmConfig(16, 32, 48, split_k=False)  # a block of 48: not a power of two
    plan = GemmPlan((Band(16, SMALL), Band(None, broken)), 136, 1024)
    proven, why = prove_plan(lin, plan, rows=16)
    assert proven is not None and proven.configs == [SMALL] and proven.config_for(17) is None
    assert len(why) == 1 and why[0].startswith(broken.name + ": ")
    assert "other bits" not in why[0]


def test_the_triton_gemm_refuses_what_its_32_bit_offsets_or_layout_cannot_take():
    x = torch.zeros(16744, 16, dtype=torch.bfloat16)
    head = torch.zeros(128256, 16, dtype=torch.bfloat16)  # the 8b LM head's columns
    assert fits(16743, 128256, 16, SMALL) and not fits(16744, 128256, 16, SMALL)
    head_plan = plan_for(128256, 4096, torch.bfloat16)  # the 8b LM head: past it, the tiles
    assert head_plan is not None and head_plan.config_for(16743) == BY_NAME["128x256x64/w8s3"]
    assert head_plan.config_for(16744) is None
    with pytest.raises(ValueError, match="fit 32 bits"):
        gemm(x, head, config=SMALL)
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous operands of one dtype"):
        gemm(torch.zeros(64, 8, dtype=torch.bfloat16).t(), w, config=SMALL)  # a strided view
    with pytest.raises(ValueError, match="contiguous operands of one dtype"):
        gemm(torch.zeros(8, 64), w, config=SMALL)  # float32 rows, bfloat16 weights


def test_only_cuda_layers_of_measured_shapes_are_planned():
    w = torch.zeros(4096, 4096, dtype=torch.bfloat16)  # a measured shape, on the CPU
    lin = Linear(w, pack=False, tiled=True)
    assert attach_plans([lin]) == "0 of 1 products planned by rows" and lin.plan is None


CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="no CUDA device here: the GPU sitting runs it")


@CUDA
def test_cuda_a_runner_of_measured_shapes_plans_its_products_and_keeps_the_tiles_bits():
    """One layer of the 135m shape (every product measured): the products whose plans the start
    proof kept (on an H200, all five) step with the bits of the same products on the tiles
    alone, graphed and eager, at 1, 15 (an eager step in the first band whose graph bucket, 8 x
    4, is in the second), 40 and 300 rows."""
    from edgespec.models.shapes import random_model
    from edgespec.runner.step_rows import DraftShape, StepRows
    from edgespec.runner.target_runner import TargetRunner

    model = random_model("135m", "cuda", "bfloat16", layers=1)
    graphed = TargetRunner(model, n_slots=40, max_len=128, exact=False, graphs=True)
    linears = [graphed.lm_head] + [m for layer in graphed.layers
                                   for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    planned = sum(lin.plan is not None for lin in linears)
    assert graphed.gemm_plans == f"{planned} of 5 products planned by rows"
    if torch.cuda.get_device_capability()[0] == 9:
        assert planned > 0
    eager = TargetRunner(model, n_slots=40, max_len=128, exact=False, graphs=False,
                         share_weights=graphed)
    plans = [lin.plan for lin in linears]
    sizes = ((1, 1), (5, 3), (40, 1), (30, 10))

    def steps(r, with_plans):  # the prompts prefilled and the steps, the plans kept or not
        for lin, plan in zip(linears, plans):
            lin.plan = plan if with_plans else None
        for slot in range(40):  # prefilled again: the steps wrote past each prompt
            r.cache.lengths[slot] = 0
            r.prefill(slot, [1] + [(7 * slot + i) % 500 + 3 for i in range(20)])
        out = []
        for B, T in sizes:
            drafts = [([(3 * b + t) % 400 + 3 for t in range(T - 1)], list(range(-1, T - 2)))
                      for b in range(B)]
            rows = StepRows.build(list(range(B)), [21] * B, [5] * B, DraftShape.of(drafts),
                                  r.device)
            out.append(r.score_rows(rows).logits.clone())
        return out

    for slot in range(40):
        graphed.new_slot()
        eager.new_slot()
    want = steps(eager, with_plans=False)
    for runner in (graphed, eager):
        for got, ref, size in zip(steps(runner, with_plans=True), want, sizes):
            assert torch.equal(got, ref), (runner.graphs is not None, size)
    assert graphed.graphs.replays == len(sizes)
