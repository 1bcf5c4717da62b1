"""The CPU linear layer's products as the dtype probe chooses them: one oneDNN call whatever the
rows ("packed"), calls of 40 up to 128 (or 96) rows ("packed-spans128": an Emerald Rapids Xeon's
packed bfloat16 takes one kernel up to 32 rows and another above, so a row among 64 got other
bits, while calls of 37 rows and more agreed), or calls of 32 rows each, padded
("packed-tiles"); the probe's choice, the spans' and tiles' calls, the runner and its kernel set
built from the choice, and a row's bits in every call of the products chosen here."""

from __future__ import annotations

import pytest
import torch

from edgespec.runner import dtype_probe
from edgespec.runner.dtype_probe import (PRODUCTS, exact_here, first_varying_count, linear_for,
                                         packed_products, probe_input)
from edgespec.runner.linear import CPU_TILE_ROWS, SPAN_FLOOR, Linear
from edgespec.runner.target_runner import TargetRunner

DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not exact_here("bfloat16"), reason="this CPU does not serve bfloat16 (refused)"))]


def _weight(n: int, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(n + k)
    return (torch.randn(n, k, generator=g) * 0.05).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_products_chosen_here_give_a_row_its_bits_in_every_call(dtype):
    """Whatever this CPU needs, the linear layer built as its probe chose gives a row the same
    bits in every call of 1..140 rows (four tiles and a part; a span's ceiling and a part), for
    the default model's MLP shapes."""
    dt = getattr(torch, dtype)
    shapes = ((576, 1536), (1536, 576))
    products = packed_products(dt, "cpu", shapes)
    assert products in PRODUCTS
    for n, k in shapes:
        lin = linear_for(products, _weight(n, k, dt))
        x = probe_input(140, k, lin.weight)
        assert first_varying_count(lin, x, list(range(1, 141))) is None, (dtype, products)


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


def test_row_spans_call_between_the_floor_and_the_ceiling():
    """Every oneDNN call of a layer in row spans has floor..ceiling rows: fewer padded up (the
    rest zeros), more cut into calls of the ceiling and a last part, itself padded; a call in
    the span goes as it is; leading dims fold into rows and come back."""
    w = _weight(96, 64)
    lin, whole = Linear(w, row_span=(SPAN_FLOOR, 128)), Linear(w)
    calls: list[int] = []
    real = lin._apply
    lin._apply = lambda x: calls.append(len(x)) or real(x)  # type: ignore[method-assign]
    x = torch.randn(3, 110, 64)  # 330 rows in all
    for rows, sizes in ((x[0, :1], [SPAN_FLOOR]), (x[0, :39], [SPAN_FLOOR]), (x[0, :40], [40]),
                        (x[0, :77], [77]), (x[:2, :64], [128]), (x[:2, :66], [128, SPAN_FLOOR]),
                        (x, [128, 128, 74])):
        calls.clear()
        out = lin(rows)
        assert calls == sizes, rows.shape
        assert out.shape == (*rows.shape[:-1], 96)
        torch.testing.assert_close(out, whole(rows))
    calls.clear()
    assert lin(x[0, :0]).shape == (0, 96) and calls == []  # no rows: no call
    with pytest.raises(ValueError, match="floor"):
        Linear(w, row_span=(50, 40))
    with pytest.raises(ValueError, match="not both"):
        Linear(w, row_span=(40, 128), row_tile=CPU_TILE_ROWS)


def test_the_probe_chooses_spans_or_tiles_only_where_one_call_varies(monkeypatch,
                                                                     fresh_probes):
    """The cheapest products whose probe passes: one call for an invariant kernel; spans up to
    128 rows for one whose rows change bits above 32 rows (the Emerald Rapids Xeon's bfloat16),
    up to 96 where they change again above 100, and only where every shape of the model agrees
    at every span size (a kernel that varies for a narrow layer inside the span takes tiles);
    tiles for one whose rows change with every count but 32's; refused where they change at
    every call."""
    real = Linear._apply

    def kernel(level):  # rows' bits moved by the call's level (its rows, its layer's shape)
        return lambda self, x: real(self, x) + 1e-3 * int(level(self, len(x)))

    def always(self, x):  # by the rows in use, padded or not
        out = real(self, x)
        return out + 1e-3 * int((x != 0).any(-1).sum())

    def choice(fn, shapes=()):
        monkeypatch.setattr(Linear, "_apply", fn)
        dtype_probe._packed_linear_exact.cache_clear()
        dtype_probe._span_exact.cache_clear()
        return packed_products(torch.float32, "cpu", shapes)

    assert packed_products(torch.float32) == "packed"  # float32 is served on every CPU kind
    assert choice(kernel(lambda self, n: n > 32)) == "packed-spans128"
    assert exact_here("float32")
    assert choice(kernel(lambda self, n: n > 32), ((576, 1536), (96, 576))) == "packed-spans128"
    assert choice(kernel(lambda self, n: (n > 32) + (n > 100))) == "packed-spans96"
    # a 96-wide layer whose 49-row calls differ: the model's shapes decide
    narrow = kernel(lambda self, n: (n > 32) + (self.weight.shape[0] == 96 and n == 49))
    assert choice(narrow) == "packed-spans128"
    assert choice(narrow, ((576, 1536), (96, 576))) == "packed-tiles"
    assert choice(kernel(lambda self, n: 0 if n == 32 else n)) == "packed-tiles"
    assert choice(always) is None
    assert not exact_here("float32")


@pytest.mark.skipif(not exact_here("bfloat16"), reason="this CPU does not serve bfloat16")
def test_the_span_sweep_refuses_a_narrow_layer_wherever_it_varies(fresh_probes):
    """Where this CPU's bfloat16 goes in row spans, a narrow layer (64 or 96 outputs: oneDNN
    blocks a narrow product another way) that random rows show varying inside the span (a row
    of a 40-row call against the same row among 100) is refused by the sweep, whose rows cancel
    so that any change of summation order shows (random rows caught such a layer in about half
    the draws). A CPU where no such layer varies has nothing to refuse: skipped."""
    if not (packed_products(torch.bfloat16) or "").startswith(dtype_probe.SPANS):
        pytest.skip("this CPU's bfloat16 does not go in row spans")
    varied = []
    for shape in ((64, 576), (96, 576)):
        for seed in range(10):
            g = torch.Generator().manual_seed(seed)
            w = (torch.randn(*shape, generator=g) * 0.05).bfloat16()
            x = (torch.randn(100, 576, generator=g) * 2).bfloat16()
            lin = Linear(w, row_span=(SPAN_FLOOR, 128))
            if not torch.equal(lin(x[:40]), lin(x)[:40]):
                varied.append(shape)
                break
    if not varied:
        pytest.skip("no narrow layer varies inside the span on this CPU")
    threads = torch.get_num_threads()
    for shape in varied:
        assert not dtype_probe._span_exact(torch.bfloat16, "cpu", threads, "packed-spans128",
                                           shape), shape
        assert packed_products(torch.bfloat16, "cpu", (shape,)) != "packed-spans128", shape


def test_a_runner_is_built_with_the_tiles_its_kernel_set_names(looping, monkeypatch):
    """The kernel set records the products (another fingerprint), and the runner's every linear
    layer, the LM head's too, calls in tiles or spans when it says so; the probe is asked about
    the model's own layers' shapes; a runner sharing its weights says the same."""
    plain = TargetRunner(looping.model, n_slots=1, max_len=64)
    asked: list[tuple] = []

    def chosen(products):
        def probe(dtype, device="cpu", shapes=()):
            asked.append(shapes)
            return products
        return probe

    monkeypatch.setattr(dtype_probe, "packed_products", chosen("packed-tiles"))
    tiled = TargetRunner(looping.model, n_slots=1, max_len=64)
    monkeypatch.setattr(dtype_probe, "packed_products", chosen("packed-spans96"))
    spans = TargetRunner(looping.model, n_slots=1, max_len=64)
    assert [ks.products for ks in (plain.kernel_set, tiled.kernel_set, spans.kernel_set)] == \
        ["packed", "packed-tiles", "packed-spans96"]
    assert len({ks.fingerprint for ks in (plain.kernel_set, tiled.kernel_set,
                                          spans.kernel_set)}) == 3
    cfg = looping.model.config
    hidden, inner = cfg.hidden_size, cfg.intermediate_size
    heads = cfg.num_attention_heads * (hidden // cfg.num_attention_heads)
    kv = cfg.num_key_value_heads * (hidden // cfg.num_attention_heads)
    assert set(asked[0]) == {(heads + 2 * kv, hidden), (hidden, heads), (2 * inner, hidden),
                             (hidden, inner), (cfg.vocab_size, hidden)}
    for runner, tile, span in ((plain, None, None), (tiled, CPU_TILE_ROWS, None),
                               (spans, None, (SPAN_FLOOR, 96))):
        linears = [runner.lm_head] + [m for layer in runner.layers
                                      for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        assert {lin.row_tile for lin in linears} == {tile}
        assert {lin.row_span for lin in linears} == {span}
        assert {lin.tiled for lin in linears} == {tile is not None}
        assert all(lin.packed is not None for lin in linears)
    # a layer-skip drafter runs the owner's linears, and its record says how they call
    skip = TargetRunner(looping.model, n_slots=1, max_len=64, n_layers=1, exact=False,
                        share_weights=tiled)
    assert skip.kernel_set.products == "packed-tiles" and skip.layers[0].qkv is tiled.layers[0].qkv
    # float32's one call is row-invariant here (its probe passed), so its tiles and spans give
    # the same bits: 48 tokens in one forward, past a tile and the spans' floor
    rows = [[1, 10, 11, 12] * 12]
    logits = [r.forward([r.new_slot()], rows) for r in (plain, tiled, spans)]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
