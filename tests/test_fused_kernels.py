"""The fused Triton kernels (``edgespec.runner.fused_kernels``): what each computes (against
plain torch in float32), their masking and padding, and that a row's bits do not depend on the
rest of the call. On a CPU they run under Triton's interpreter (``TRITON_INTERPRET=1``, set here
before Triton is first imported); on a GPU, compiled (bits and speed are the GPU's to prove: the
sitting and the CUDA sweep)."""

from __future__ import annotations

import pytest
import torch

from triton_on_cpu import INTERPRETED, require_triton

require_triton()
from edgespec.runner import fused_kernels as fk  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEV, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_torch(dtype, with_delta):
    R, H = 5, 96
    x = _rand(R, H, dtype=dtype)
    delta = _rand(R, H, dtype=dtype, seed=1) if with_delta else None
    w = _rand(H, dtype=dtype, seed=2)
    x_ref = (x.float() + delta.float()).to(dtype) if with_delta else x.clone()
    out = fk.add_rms_norm(x, delta, w, 1e-5)
    assert out.shape == (fk.padded_rows(R), H)
    # the residual updated in place (Triton's interpreter rounds to bfloat16 towards zero)
    if dtype == torch.float32 or torch.cuda.is_available():
        assert torch.equal(x, x_ref)
    else:
        torch.testing.assert_close(x.float(), x_ref.float(), rtol=1e-2, atol=1e-2)
    xf = x_ref.float()
    ref = w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:R].float(), ref, rtol=tol, atol=tol)


def test_add_rms_norm_row_bits_do_not_depend_on_the_call():
    H = 96
    x = _rand(9, H, dtype=torch.bfloat16)
    w = _rand(H, dtype=torch.bfloat16, seed=2)
    many = fk.add_rms_norm(x.clone(), None, w, 1e-5)
    for r in (0, 4, 8):
        alone = fk.add_rms_norm(x[r:r + 1].clone(), None, w, 1e-5)
        assert torch.equal(alone[0], many[r])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    gu = _rand(fk.padded_rows(3), 2 * 40, dtype=dtype)
    out = fk.silu_mul(gu, 3)[:3]
    gate, up = gu[:3].float().chunk(2, -1)
    ref = torch.nn.functional.silu(gate).to(dtype).float() * up
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def _cache(slots, kvh, cap, hd, dtype, seed):
    return (_rand(slots, kvh, cap, hd, dtype=dtype, seed=seed),
            _rand(slots, kvh, cap, hd, dtype=dtype, seed=seed + 1))


def _tables(cap, hd, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.outer(torch.arange(cap, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().to(DEV, dtype), emb.sin().to(DEV, dtype)


def _rotate_ref(x, cos, sin):  # x [..., hd] float32
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv_rotates_and_writes_each_row_into_its_slot(dtype):
    nh, kvh, hd, cap = 4, 2, 16, 128
    B, T = 2, 3
    qkv = _rand(B * T, (nh + 2 * kvh) * hd, dtype=dtype)
    cos, sin = _tables(cap, hd, dtype)
    k_cache, v_cache = (torch.zeros(4, kvh, cap, hd, dtype=dtype, device=DEV) for _ in range(2))
    slots = torch.tensor([3, 1], device=DEV)
    starts = torch.tensor([10, 70], device=DEV)
    depth = torch.tensor([[0, 1, 1], [0, 1, 2]], dtype=torch.int32, device=DEV)  # row 0: a tree
    step = fk.FusedStep(slots, starts, depth, torch.zeros(B, T, T, dtype=torch.int32,
                                                          device=DEV))
    q = fk.rope_write_kv(qkv, cos, sin, step, k_cache, v_cache, nh, kvh, hd)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    parts = qkv.float().view(B, T, nh + 2 * kvh, hd)
    for b in range(B):
        for t in range(T):
            pos = int(starts[b]) + int(depth[b, t])
            c, s = cos[pos].float(), sin[pos].float()
            torch.testing.assert_close(q[b * T + t].float().view(nh, hd),
                                       _rotate_ref(parts[b, t, :nh], c, s), rtol=tol, atol=tol)
            at = int(starts[b]) + t  # stored at start + t, rotated by depth
            torch.testing.assert_close(k_cache[int(slots[b]), :, at].float(),
                                       _rotate_ref(parts[b, t, nh:nh + kvh], c, s),
                                       rtol=tol, atol=tol)
            assert torch.equal(v_cache[int(slots[b]), :, at], qkv.view(B, T, -1, hd)[b, t,
                                                                                   nh + kvh:])
    written = torch.zeros_like(k_cache[..., 0], dtype=torch.bool)
    for b in range(B):
        written[int(slots[b]), :, int(starts[b]):int(starts[b]) + T] = True
    assert torch.count_nonzero(k_cache[..., 0][~written]) == 0  # nothing else touched


def _attention_ref(q, k_cache, v_cache, slot, keys, group, scale):
    """One query [nh, hd] over its keys at positions ``keys`` of slot ``slot`` (float32)."""
    k = k_cache[slot][:, keys].float()  # [kvh, n, hd]
    v = v_cache[slot][:, keys].float()
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    probs = torch.softmax((k @ q.float()[:, :, None])[..., 0] * scale, -1)  # [nh, n]
    return (probs[:, None, :] @ v)[:, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_slot_attention_reads_each_query_s_prefix_and_path(dtype):
    nh, kvh, hd, cap = 4, 2, 16, 256
    k_cache, v_cache = _cache(4, kvh, cap, hd, dtype, 5)
    B, T = 2, 4
    slots = torch.tensor([2, 0], device=DEV)
    starts = torch.tensor([70, 5], device=DEV)  # row 0 crosses a key block
    # row 0: a tree (root, node 0 off the root, node 1 off the root, node 2 off node 1);
    # row 1: a chain
    depth = torch.tensor([[0, 1, 1, 2], [0, 1, 2, 3]], dtype=torch.int32, device=DEV)
    path = torch.zeros(B, T, T, dtype=torch.int32, device=DEV)
    path[0, 1, 1], path[0, 2, 1], path[0, 3, 1], path[0, 3, 2] = 1, 2, 2, 3
    for t in range(T):
        path[1, t, :t + 1] = torch.arange(t + 1)
    q = _rand(B * T, nh * hd, dtype=dtype, seed=7)
    out = fk.slot_attention(q, fk.FusedStep(slots, starts, depth, path), k_cache, v_cache,
                            nh, kvh, hd, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b in range(B):
        for t in range(T):
            st = int(starts[b])
            keys = list(range(st)) + [st + int(path[b, t, d]) for d in range(int(depth[b, t]) + 1)]
            ref = _attention_ref(q[b * T + t].view(nh, hd), k_cache, v_cache, int(slots[b]),
                                 torch.tensor(keys, device=DEV), nh // kvh, 0.25)
            torch.testing.assert_close(out[b * T + t].float().view(nh, hd), ref, rtol=tol,
                                       atol=tol)


def test_slot_attention_row_bits_do_not_depend_on_the_call():
    """A query alone, and the same query among other sessions' longer rows, get the same bits;
    a tree node gets the bits of the chain root -> ... -> node stored in decoding order."""
    nh, kvh, hd, cap = 4, 2, 16, 256
    dtype = torch.bfloat16
    k_cache, v_cache = _cache(3, kvh, cap, hd, dtype, 11)
    q = _rand(3 * 5, nh * hd, dtype=dtype, seed=12)
    slots = torch.tensor([0, 1, 2], device=DEV)
    starts = torch.tensor([130, 3, 64], device=DEV)
    many = fk.slot_attention(q, fk.FusedStep.chains(slots, starts, 5), k_cache, v_cache,
                             nh, kvh, hd, 0.25)
    for b in range(3):
        for t in range(5):
            one = fk.FusedStep.chains(slots[b:b + 1], starts[b:b + 1] + t, 1)
            alone = fk.slot_attention(q[b * 5 + t:b * 5 + t + 1], one, k_cache, v_cache,
                                      nh, kvh, hd, 0.25)
            assert torch.equal(alone[0], many[b * 5 + t])
    # a tree node two deep whose ancestors are stored at rows 2 and 4, read as a chain would be
    tree_k, tree_v = k_cache.clone(), v_cache.clone()
    st = 130
    for dst, src in ((st + 1, st + 2), (st + 2, st + 4)):  # the chain layout: root, a, b
        tree_k[0, :, dst], tree_v[0, :, dst] = k_cache[0, :, src], v_cache[0, :, src]
    chain = fk.slot_attention(q[4:5], fk.FusedStep.chains(slots[:1], starts[:1] + 2, 1),
                              tree_k, tree_v, nh, kvh, hd, 0.25)
    depth = torch.tensor([[0, 0, 1, 0, 2]], dtype=torch.int32, device=DEV)
    path = torch.zeros(1, 5, 5, dtype=torch.int32, device=DEV)
    path[0, 4, :3] = torch.tensor([0, 2, 4])
    tree = fk.slot_attention(q[:5], fk.FusedStep(slots[:1], starts[:1], depth, path), k_cache,
                             v_cache, nh, kvh, hd, 0.25)
    assert torch.equal(tree[4], chain[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_fixed_config_gemm_computes_the_product(dtype, with_bias):
    from edgespec.runner.fused_gemm import gemm, split_for

    if INTERPRETED and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter multiplies bfloat16 dots as raw bits: the GPU's case")
    x = _rand(70, 512, dtype=dtype)
    w = _rand(200, 512, dtype=dtype, seed=1) * 0.05
    b = _rand(200, dtype=dtype, seed=2) if with_bias else None
    assert split_for(200, 512) > 1  # the reduction is split: the second kernel's sum is tested
    out = gemm(x, w, b)
    ref = x.float() @ w.float().t() + (b.float() if with_bias else 0)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_the_fixed_config_gemm_gives_a_row_its_bits_in_any_call():
    from edgespec.runner.fused_gemm import gemm

    if INTERPRETED:
        pytest.skip("Triton's interpreter runs a dot through NumPy's BLAS, whose rows vary "
                    "with their place in the block: the GPU proves the bits")
    x = _rand(130, 256, dtype=torch.bfloat16)  # three row tiles, the last one partial
    w = _rand(136, 256, dtype=torch.bfloat16, seed=3) * 0.05
    full = gemm(x, w)
    for r in (0, 63, 64, 129):
        assert torch.equal(gemm(x[r:r + 1].contiguous(), w)[0], full[r])
    assert torch.equal(gemm(x[:5].contiguous(), w), full[:5])
