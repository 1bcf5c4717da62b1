"""The start check's probes catch what would break batch invariance: an attention kernel whose
bits depend on the call's shape, a linear path that sums a lone row in another order (this
CPU's own, where it has one), a norm that depends on the row count; and the paths the runner
takes in their place keep a row's bits: the attention read from a view of the cache or in
query pieces, the linear layer's fixed row tiles (on CUDA the shapes where cuBLAS varied on an
H200), the CUDA norm's row-tiled sum. The sweeps they guard are ``test_batch_invariance``'s."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from invariance_models import NO_CUDA, build_hd64_model, runner_in as _runner

from edgespec.config import ConfigError
from edgespec.runner import attention_probe
from edgespec.runner.attention_probe import probe_invariance
from edgespec.runner.dtype_probe import first_varying_count, probe_input, probe_row_counts
from edgespec.runner.linear import Linear
from edgespec.runner.target_runner import TargetRunner

pytestmark = pytest.mark.slow  # long sweeps: not the fast tier


@pytest.fixture(scope="module")
def hd64_model():
    return build_hd64_model()


def _random_attention(seed: int, B: int, kvh: int, grp: int, T: int, hd: int, n: int,
                      dtype: torch.dtype = torch.float32):
    """Random q [B, kvh, grp, T, hd], keys [B, kvh, n, hd] and values [B, kvh, n, hd + 1] (the
    last column ones), drawn keys first."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, kvh, n, hd, generator=g).to(dtype)
    values = torch.cat([torch.randn(B, kvh, n, hd, generator=g),
                        torch.ones(B, kvh, n, 1)], -1).to(dtype)
    return torch.randn(B, kvh, grp, T, hd, generator=g).to(dtype), keys, values


def test_the_attention_probe_catches_a_shape_dependent_kernel(monkeypatch):
    import torch.nn.functional as F

    import edgespec.runner.attention as attention

    assert probe_invariance(torch.float32)

    def sdpa(q, keys, values, visible, col_tile=16, tail=None, products=None, max_cols=256):
        B, kvh, g, T, hd = q.shape
        out = F.scaled_dot_product_attention(q.reshape(B, kvh * g, T, hd), keys,
                                             values[..., :hd], attn_mask=visible[:, None],
                                             enable_gqa=True, scale=1.0)
        return out.transpose(1, 2).reshape(B, T, kvh * g * hd)

    monkeypatch.setattr(attention, "invariant_attention", sdpa)
    assert not probe_invariance(torch.float32)


@pytest.mark.parametrize("width,place", [(25, -1), (41, -1), (64, -1), (65, -1), (40, 7)])
def test_the_attention_probe_sweeps_every_width_a_cpu_call_can_have(monkeypatch, width, place):
    """A kernel whose bits move only at one place of calls of one width (MKL's AVX2 float32
    kernel did so for the last columns of some widths, e.g. 25 tokens of a 3-query group, which
    the probe's fixed calls never made) fails the CPU's probe, up to a token tree's whole call
    (1 + MAX_TREE_NODES = 65 tokens) and at any place of the call; the same kernel passes on a
    GPU's torch path, whose probe is the fixed calls alone."""
    import edgespec.runner.attention as attention

    exact = attention.invariant_attention

    def off_at_one_width(q, keys, values, visible, *args, **kw):
        out = exact(q, keys, values, visible, *args, **kw)
        if q.shape[3] == width and q.shape[0] > 1:  # a call of that width, not a lone query
            out[:, place] = out[:, place] * (1 + 2 ** -20)
        return out

    monkeypatch.setattr(attention, "invariant_attention", off_at_one_width)
    assert not probe_invariance(torch.float32, "cpu")
    calls = []
    monkeypatch.setattr(attention_probe, "_every_width_agrees", lambda *a: calls.append(a) or True)
    assert probe_invariance(torch.float32, "cpu") and calls  # the fixed calls alone pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_products_of_a_fixed_width_give_the_bits_they_give_here_and_pass_the_probe(
        monkeypatch, dtype):
    """The kernel of last resort on a CPU (every product exactly 16 query columns wide, for a
    BLAS that blocks wider ones by its own width) computes what one product computes here, in
    products no wider than 16 columns, and passes the probe; the tile the probes choose here
    passes it too."""
    import edgespec.runner.attention as attention
    from edgespec.runner.dtype_probe import attention_kernel

    B, kvh, grp, T, hd, n = 3, 2, 7, 9, 64, 256
    q, keys, values = _random_attention(4, B, kvh, grp, T, hd, n, dtype)
    visible = torch.arange(n)[None, None, :] <= (torch.tensor([20, 100, 240])[:, None]
                                                 + torch.arange(T))[:, :, None].clamp(max=n - 1)
    one = attention.invariant_attention(q, keys, values, visible, 16)
    widths = []
    matmul = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: widths.append(b.shape[-1]) or matmul(a, b))
    fixed = attention.invariant_attention(q, keys, values, visible, 16, max_cols=16)
    monkeypatch.undo()
    assert max(widths) == 16 and len(widths) > 2  # 63 columns: four products a call
    assert torch.allclose(fixed.float(), one.float(), rtol=1e-2, atol=1e-2)
    kernel = attention_kernel(dtype, "cpu", kvh, grp, hd)
    if kernel is not None and kernel.max_cols == 256:  # one product is exact here: so is this
        assert torch.equal(fixed, one)
    # in the products the runner takes for this dtype here: float32 where bfloat16 is emulated
    # (oneDNN's emulated bfloat16 products are not row-invariant: ``dtype_probe``; an AVX2 EPYC)
    products = kernel.products if kernel is not None else None
    assert probe_invariance(dtype, "cpu", 16, kvh, grp, hd, products=products, max_cols=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_attention_reads_a_view_of_the_cache_with_the_bits_of_a_copy(dtype):
    """A run of slots is read as a view of the cache (its rows not contiguous: a value
    product a key block, for float32, unless the call has at most COPIED_ROWS rows, which copy
    it), other slots gathered into a copy (one product): every output the same bits."""
    from edgespec.runner.attention import COPIED_ROWS, invariant_attention

    g = torch.Generator().manual_seed(1)
    B, kvh, grp, T, hd, n, max_len = 5, 2, 3, 4, 64, 192, 512
    keys = torch.randn(B, kvh, max_len, hd, generator=g).to(dtype)
    values = torch.cat([torch.randn(B, kvh, max_len, hd, generator=g),
                        torch.ones(B, kvh, max_len, 1)], -1).to(dtype)
    q = torch.randn(B, kvh, grp, T, hd, generator=g).to(dtype)
    ctx = torch.tensor([10, 70, 130, 150, 185])
    visible = torch.arange(n)[None, None, :] <= (ctx[:, None] + torch.arange(T))[:, :, None]
    view_k, view_v = keys[:, :, :n], values[:, :, :n]
    assert not view_v.is_contiguous()
    from_view = invariant_attention(q, view_k, view_v, visible)
    from_copy = invariant_attention(q, view_k.contiguous(), view_v.contiguous(), visible)
    assert torch.equal(from_view, from_copy)
    # the five rows read the view a block at a time, the lone row copies it
    assert 1 <= COPIED_ROWS < B
    assert torch.equal(from_view[1:2], invariant_attention(q[1:2], view_k[1:2], view_v[1:2],
                                                           visible[1:2]))


@pytest.mark.parametrize("dtype,products", [(torch.float32, None), (torch.bfloat16, None),
                                            (torch.bfloat16, torch.float32)], ids=str)
def test_a_long_call_in_query_pieces_has_the_bits_of_one_call(monkeypatch, dtype, products):
    """On the CPU a call of many queries (a prompt's chunk) runs QUERY_PIECE queries at a time,
    each piece over the key blocks its queries see, its softmax in the scores' layout: every
    output the bits of the whole call at once with the keys innermost, for ragged rows of a
    prefill group (a short row's padding queries too), a fully hidden query, and a piece that
    ends mid-block."""
    import edgespec.runner.attention as attention

    B, kvh, grp, T, hd, n = 2, 2, 3, 150, 64, 384
    q, keys, values = _random_attention(2, B, kvh, grp, T, hd, n, dtype)
    starts = torch.tensor([0, 200])
    visible = torch.arange(n)[None, None, :] <= (starts[:, None] + torch.arange(T))[:, :, None]
    visible[0, 70] = False  # a query that sees no key: NaN either way, in its own column
    pieces = attention.invariant_attention(q, keys, values, visible, products=products)
    monkeypatch.setattr(attention, "QUERY_PIECE", 10 ** 6)
    monkeypatch.setattr(attention, "WIDE_COLUMNS", 10 ** 6)  # the softmax keys innermost
    whole = attention.invariant_attention(q, keys, values, visible, products=products)
    assert pieces.dtype == whole.dtype == dtype and pieces.shape == (B, T, kvh * grp * hd)
    seen = visible.any(-1)  # [B, T]
    assert torch.equal(pieces[seen], whole[seen])
    assert torch.isnan(pieces[~seen]).all() and torch.isnan(whole[~seen]).all()


def _lone_row_in_halves(self: Linear, x: torch.Tensor) -> torch.Tensor:
    """A linear path whose lone row sums its input in two halves, another order than a call of
    more rows takes: what the packed kernel's single-row path did on the CPUs where it was found,
    made here whatever this CPU's own kernels do (oneDNN capped at AVX2 gives a lone row a
    many-row call's bits)."""
    if x.numel() != x.shape[-1]:
        return self._apply(x)
    w, half = self.weight, x.shape[-1] // 2
    out = F.linear(x[..., :half], w[:, :half]) + F.linear(x[..., half:], w[:, half:])
    return out if self.bias is None else out + self.bias


def _down_projection() -> Linear:
    g = torch.Generator().manual_seed(0)
    return Linear(torch.randn(576, 1536, generator=g) * 0.05)  # the default model's down shape


def test_the_linear_probe_catches_a_lone_row_path(monkeypatch):
    """The start check's sweep (``first_varying_count`` over the CPU's row counts) finds a lone
    row summed in another order at one row, and nothing once a lone row goes as two."""
    lin = _down_projection()
    x, counts = probe_input(64, 1536, lin.weight), probe_row_counts("cpu", 64)
    assert first_varying_count(lin, x, counts) is None
    monkeypatch.setattr(Linear, "__call__", _lone_row_in_halves)
    assert first_varying_count(lin, x, counts) == 1


def test_the_linear_probe_catches_this_cpus_own_lone_row_path(monkeypatch):
    """Where this CPU's packed kernel gives a lone row other bits than the same row among two
    (AVX-512 and AMX oneDNN did), the sweep finds that path, called as it is, at one row."""
    lin = _down_projection()
    x, counts = probe_input(64, 1536, lin.weight), probe_row_counts("cpu", 64)
    if torch.equal(lin._apply(x[:1]), lin._apply(x[:2])[:1]):
        pytest.skip("this CPU's kernels give a lone row a two-row call's bits: nothing to find")
    monkeypatch.setattr(Linear, "__call__", Linear._apply)  # a lone row as it is
    assert first_varying_count(lin, x, counts) == 1


# -- the linear layer's row tiles and the start check over the served model's shapes ------------

# the shapes whose rows cuBLAS gave other bits by row count on an H200 (bfloat16: the 1.7B down
# projection, the 8B o and down projections), and the default model's down projection; on the
# CPU only the default model's shapes (a 14336-wide product swept 300 times costs minutes there)
GPU_SHAPES = [(8192, 2048), (4096, 4096), (14336, 4096), (1536, 576)]
TILED_CASES = [pytest.param("cpu", "float32", shape, id=f"cpu-float32-{shape[0]}-{shape[1]}")
               for shape in ((1536, 576), (576, 1536))] + \
              [pytest.param("cuda", dtype, shape, id=f"cuda-{dtype}-{shape[0]}-{shape[1]}",
                            marks=NO_CUDA)
               for dtype in ("float32", "bfloat16") for shape in GPU_SHAPES]
DEVICE_CASES = [pytest.param("cpu", "float32", id="cpu-float32"),
                pytest.param("cuda", "float32", id="cuda-float32", marks=NO_CUDA),
                pytest.param("cuda", "bfloat16", id="cuda-bfloat16", marks=NO_CUDA)]


def _varying(lin: Linear, max_rows: int = 300) -> int | None:
    w = lin.weight
    return first_varying_count(lin, probe_input(max_rows, w.shape[1], w),
                               list(range(1, max_rows + 1)))


@pytest.mark.parametrize("device,dtype,shape", TILED_CASES)
def test_row_tiles_give_every_row_the_bits_of_a_full_call(device, dtype, shape):
    """Rows in fixed 128-row tiles, each call padded: a row's bits do not depend on the call's row
    count (1..300, three tiles) or its place in it. On CUDA the shapes whose rows cuBLAS gave
    other bits by row count on an H200; on the CPU the default model's, the tiled path running
    through plain ``F.linear`` (MKL's float32 sgemm, not row-invariant on its own: next test)."""
    k, n = shape
    g = torch.Generator().manual_seed(k + n)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device=device, dtype=getattr(torch, dtype))
    assert _varying(Linear(w, pack=False, tiled=True)) is None


@pytest.mark.parametrize("device,dtype", DEVICE_CASES)
def test_without_row_tiles_the_sweep_fails(device, dtype):
    """The mutation check: the same sweep over plain calls (padding switched off) finds a row
    count that changes a row's bits: on CUDA (cuBLAS, measured in bfloat16 and float32 on an
    H200) and on this CPU in float32 (MKL's sgemm)."""
    shape = (8192, 2048) if device == "cuda" else (1536, 576)
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(shape[1], shape[0], generator=g) * 0.02).to(device=device,
                                                                  dtype=getattr(torch, dtype))
    assert _varying(Linear(w, pack=False, tiled=False)) is not None


def test_the_start_check_names_the_linear_layer_and_the_row_count(hd64_model, monkeypatch,
                                                                  fresh_probes):
    """A linear path that gives a lone row other bits (summed in another order, as the packed
    kernel's single-row path did) is refused at start, naming the layer, its shape and the row
    count."""
    monkeypatch.setattr(Linear, "__call__", _lone_row_in_halves)
    with pytest.raises(ConfigError, match=r"linear layer \w+ \(\d+ -> \d+\) is not batch-invariant "
                                          r"here: a call of 1 rows gives a row other bits"):
        _runner(hd64_model, "float32", "cpu")


def test_the_start_check_covers_the_row_wise_norm(hd64_model, monkeypatch, fresh_probes):
    """A norm whose result depends on how many rows share the call is refused at start."""
    def norm_by_row_count(self, x, w):
        return w * x * (1 + 1e-3 * x.shape[0])

    monkeypatch.setattr(TargetRunner, "_rms", norm_by_row_count)
    with pytest.raises(ConfigError, match="the RMS norm is not batch-invariant here"):
        _runner(hd64_model, "float32", "cpu")


@pytest.mark.parametrize("device,max_rows", [("cpu", 1040), ("cuda", 1040), ("cuda", 300)])
def test_start_check_row_counts(device, max_rows):
    """On CUDA every count up to two tiles (every padding of a first and a second tile) and the
    most rows a forward sends; on CPU the counts where oneDNN's blocking changes, and about the
    row spans' floor and lower ceiling, up to 129."""
    counts = probe_row_counts(device, max_rows)
    assert counts == sorted(set(counts))
    if device == "cuda":
        assert counts == [*range(1, 257), max_rows]
    else:
        assert {1, 2, 3, 15, 16, 17, 39, 40, 41, 63, 64, 65, 95, 96, 97, 127, 128} <= \
            set(counts) and counts[-1] == 129
        assert len(counts) < 30


def test_the_cuda_norm_path_is_row_invariant_and_agrees_with_the_mean(hd64_model):
    """On CUDA the RMS norm sums a row's squares through a row-tiled product with ones (torch's
    reduction kernels give 1..15 rows wider blocks than 16 and more): the same path, run here,
    gives every row its bits whatever the row count, and agrees with the plain mean to float32
    rounding. The runner skips the start check: its products are this CPU's question (on the
    first GPU sitting's host, at 8 threads, float32's were refused), not the norm's."""
    runner = TargetRunner(hd64_model.float(), n_slots=16, max_len=300, exact=False)
    x = probe_input(300, runner.embed.shape[1], runner.embed)
    plain = runner._rms(x, runner.norm)
    runner._row_sum = Linear(torch.ones(1, x.shape[1]), pack=False, tiled=True)
    assert first_varying_count(lambda t: runner._rms(t, runner.norm), x,
                               list(range(1, 300))) is None
    torch.testing.assert_close(runner._rms(x, runner.norm), plain)


def test_fixed_width_products_reach_query_pieces_and_a_runners_forward(hd64_model, monkeypatch):
    """``max_cols`` reaches every product: a long call in query pieces (many rows: the values
    read a block at a time) and a runner's forward with ``attention_cols`` 16 compute in products
    of at most 16 columns, and here (where one product is exact) the same bits as one product."""
    import edgespec.runner.attention as attention
    from edgespec.runner.dtype_probe import attention_kernel

    widths: list[int] = []
    matmul = torch.matmul

    def spy(a, b):
        widths.append(b.shape[-1])
        return matmul(a, b)

    B, kvh, grp, T, hd, n = 6, 2, 3, 150, 64, 256
    q, keys, values = _random_attention(6, B, kvh, grp, T, hd, n)
    visible = torch.arange(n)[None, None, :] <= (torch.arange(B)[:, None] * 10
                                                 + torch.arange(T))[:, :, None]
    view_v = torch.cat([values, values], 2)[:, :, :n]  # a view: the values a block at a time
    one = attention.invariant_attention(q, keys, view_v, visible, 16)
    monkeypatch.setattr(torch, "matmul", spy)
    fixed = attention.invariant_attention(q, keys, view_v, visible, 16, max_cols=16)
    monkeypatch.setattr(torch, "matmul", matmul)
    assert widths and max(widths) == 16
    exact_one = attention_kernel(torch.float32, "cpu", kvh, grp, hd)
    if exact_one is not None and exact_one.max_cols == attention.MAX_COLS:
        assert torch.equal(fixed, one)
    runner = _runner(hd64_model, "float32", "cpu")
    slots = [runner.new_slot() for _ in range(3)]
    rows = [list(range(5, 14)), [9, 10], [11]]  # 9 tokens x 3 queries: 27 columns a product
    base = runner.forward(slots, rows)
    runner.col_tile, runner.attention_cols = 16, 16
    widths.clear()
    monkeypatch.setattr(torch, "matmul", spy)
    narrow = runner.forward(slots, rows)
    monkeypatch.setattr(torch, "matmul", matmul)
    assert widths and max(widths) <= 16
    if exact_one is not None and exact_one.max_cols == attention.MAX_COLS:
        assert torch.equal(narrow, base)
