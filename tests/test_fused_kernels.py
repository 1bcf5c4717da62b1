"""The fused Triton kernels (``edgespec.runner.fused_kernels``, ``fused_gemm``) other than
attention: the residual add and RMS norm, SiLU-and-multiply, RoPE with its KV write, the
fixed-configuration GEMM: what each computes (against plain torch in float32), their masking and
padding, and that a row's bits do not depend on the rest of the call (the attention:
tests/test_fused_attention.py). On a CPU they run under Triton's interpreter
(``TRITON_INTERPRET=1``, set before Triton is first imported: tests/triton_on_cpu.py); on a
GPU, compiled (bits and speed are the GPU's to prove: the sitting and the CUDA sweep)."""

from __future__ import annotations

import pytest
import torch

from triton_on_cpu import DEV, DTYPES, _rand, require_triton

require_triton()
from edgespec.runner import fused_kernels as fk  # noqa: E402
from edgespec.runner.fused_gemm import CANDIDATES  # noqa: E402


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


def _tables(cap, hd, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.outer(torch.arange(cap, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().to(DEV, dtype), emb.sin().to(DEV, dtype)


def _rotate_ref(x, cos, sin):  # x [..., hd] float32
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh,kvh", [(4, 2), (3, 1)])  # a program holds a row's heads, padded
# to a power of two: 8 heads fill it, 5 leave three padding heads that must write nothing
def test_rope_write_kv_rotates_and_writes_each_row_into_its_slot(dtype, nh, kvh):
    hd, cap = 16, 128
    B, T = 2, 3
    qkv = _rand(B * T, (nh + 2 * kvh) * hd, dtype=dtype)
    cos, sin = _tables(cap, hd, dtype)
    k_cache, v_cache = (torch.full((4, kvh, cap, hd), 7.0, dtype=dtype, device=DEV)
                        for _ in range(2))  # 7: what no write leaves (a padding head's is 0)
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
    for cache in (k_cache, v_cache):  # nothing else touched
        assert bool((cache[~written] == 7.0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("k", [512, 128])  # split in ranges (summed by a second kernel); not
def test_the_fixed_config_gemm_computes_the_product(dtype, with_bias, k):
    from edgespec.runner.fused_gemm import gemm, split_for

    x = _rand(70, k, dtype=dtype)
    w = _rand(200, k, dtype=dtype, seed=1) * 0.05
    b = _rand(200, dtype=dtype, seed=2) if with_bias else None
    assert (split_for(200, k) > 1) == (k == 512)
    out = gemm(x, w, b)
    ref = x.float() @ w.float().t() + (b.float() if with_bias else 0)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("config", CANDIDATES, ids=lambda c: c.name)
def test_every_gemm_configuration_gives_a_row_its_bits_in_any_call(config):
    from edgespec.runner.fused_gemm import gemm

    x = _rand(130, 256, dtype=torch.bfloat16)  # row tiles of every size, the last one partial
    w = _rand(136, 256, dtype=torch.bfloat16, seed=3) * 0.05
    full = gemm(x, w, config=config)
    torch.testing.assert_close(full.float(), x.float() @ w.float().t(), rtol=3e-2, atol=3e-2)
    for r in (0, 15, 16, 63, 64, 129):
        assert torch.equal(gemm(x[r:r + 1].contiguous(), w, config=config)[0], full[r])
    assert torch.equal(gemm(x[:5].contiguous(), w, config=config), full[:5])
