"""The CPU linear layer's products as the dtype probe chooses them: one oneDNN call whatever the
rows ("packed"), or calls of 32 rows each, padded ("packed-tiles": an Emerald Rapids Xeon's packed
bfloat16 takes one kernel up to 32 rows and another above, so a row among 64 got other bits);
the probe's choice, the tiles' calls, the runner and its kernel set built from the choice, and a
row's bits in every call of the products chosen here."""

from __future__ import annotations

import pytest
import torch

from edgespec.runner import dtype_probe
from edgespec.runner.dtype_probe import (PRODUCTS, exact_here, first_varying_count, linear_for,
                                         packed_products, probe_input)
from edgespec.runner.linear import CPU_TILE_ROWS, Linear
from edgespec.runner.target_runner import TargetRunner

DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not exact_here("bfloat16"), reason="this CPU does not serve bfloat16 (refused)"))]


@pytest.fixture()
def fresh_probes():
    dtype_probe._packed_linear_exact.cache_clear()
    yield
    dtype_probe._packed_linear_exact.cache_clear()


def _weight(n: int, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(n + k)
    return (torch.randn(n, k, generator=g) * 0.05).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_products_chosen_here_give_a_row_its_bits_in_every_call(dtype):
    """Whatever this CPU needs, the linear layer built as its probe chose gives a row the same
    bits in every call of 1..100 rows (three tiles and a part), for the default model's MLP
    shapes."""
    dt = getattr(torch, dtype)
    products = packed_products(dt)
    assert products in PRODUCTS
    for n, k in ((576, 1536), (1536, 576)):
        lin = linear_for(products, _weight(n, k, dt))
        x = probe_input(100, k, lin.weight)
        assert first_varying_count(lin, x, list(range(1, 101))) is None, (dtype, products)


def test_row_tiles_call_whole_padded_tiles():
    """Every oneDNN call of a tiled layer has exactly a tile's rows (the rest zeros), whatever
    the rows asked for; leading dims fold into rows and come back."""
    w = _weight(96, 64)
    lin, whole = Linear(w, row_tile=CPU_TILE_ROWS), Linear(w)
    assert lin.tiled and lin.tile_rows == CPU_TILE_ROWS
    calls: list[int] = []
    real = lin._apply
    lin._apply = lambda x: calls.append(len(x)) or real(x)  # type: ignore[method-assign]
    x = torch.randn(3, 70, 64)  # 210 rows in all
    for rows, tiles in ((x[0, :65], 3), (x[0], 3), (x[0, :20], 1), (x[0, :1], 1), (x, 7)):
        calls.clear()
        out = lin(rows)
        assert calls == [CPU_TILE_ROWS] * tiles
        assert out.shape == (*rows.shape[:-1], 96)
        torch.testing.assert_close(out, whole(rows))


def test_the_probe_chooses_tiles_only_where_one_call_varies(monkeypatch, fresh_probes):
    """A kernel whose rows change bits above 32 rows is served in row tiles; one that changes
    them at every call count is refused; an invariant one keeps one call."""
    real = Linear._apply

    def above_32(self, x):
        out = real(self, x)
        return out + 1e-3 * out.abs().amax() if len(x) > 32 else out

    def always(self, x):  # by the rows in use, padded or not
        out = real(self, x)
        return out + 1e-3 * int((x != 0).any(-1).sum())

    assert packed_products(torch.float32) == "packed"  # float32 is served on every CPU kind
    monkeypatch.setattr(Linear, "_apply", above_32)
    dtype_probe._packed_linear_exact.cache_clear()
    assert packed_products(torch.float32) == "packed-tiles"
    assert exact_here("float32")
    monkeypatch.setattr(Linear, "_apply", always)
    dtype_probe._packed_linear_exact.cache_clear()
    assert packed_products(torch.float32) is None
    assert not exact_here("float32")


def test_a_runner_is_built_with_the_tiles_its_kernel_set_names(looping, monkeypatch):
    """The kernel set records the products (another fingerprint), and the runner's every linear
    layer, the LM head's too, calls in tiles when it says so; a runner sharing its weights says
    the same."""
    plain = TargetRunner(looping.model, n_slots=1, max_len=64)
    monkeypatch.setattr(dtype_probe, "packed_products",
                        lambda dtype, device="cpu": "packed-tiles")
    tiled = TargetRunner(looping.model, n_slots=1, max_len=64)
    assert (plain.kernel_set.products, tiled.kernel_set.products) == ("packed", "packed-tiles")
    assert plain.kernel_set.fingerprint != tiled.kernel_set.fingerprint
    for runner, tile in ((plain, None), (tiled, CPU_TILE_ROWS)):
        linears = [runner.lm_head] + [m for layer in runner.layers
                                      for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        assert {lin.row_tile for lin in linears} == {tile}
        assert {lin.tiled for lin in linears} == {tile is not None}
        assert all(lin.packed is not None for lin in linears)
    # a layer-skip drafter runs the owner's linears, and its record says how they call
    skip = TargetRunner(looping.model, n_slots=1, max_len=64, n_layers=1, exact=False,
                        share_weights=tiled)
    assert skip.kernel_set.products == "packed-tiles" and skip.layers[0].qkv is tiled.layers[0].qkv
    # float32's one call is row-invariant here (its probe passed), so its tiles give the same
    # bits: 48 tokens in one forward, past a tile
    rows = [[1, 10, 11, 12] * 12]
    slots = [plain.new_slot()], [tiled.new_slot()]
    assert torch.equal(plain.forward(slots[0], rows), tiled.forward(slots[1], rows))
