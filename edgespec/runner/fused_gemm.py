"""A fixed-config Triton GEMM whose rows are batch-invariant for any row count, reading the
weights once per call: the candidate to replace the runner's 128-row cuBLAS tiles on the GPU
(``Linear.tiles`` reads the weights once per tile, so a 576-row verification step of 64
sessions x 9 tokens reads them five times). Measured against the tiles by the GPU sitting's
``linear`` stage; not yet what the runner uses.

y = x W^T (+ b), x [M, K], W [N, K]. The config is a function of (N, K) alone, never of M:
``BLOCK_M`` x ``BLOCK_N`` output tiles, the reduction in ``BLOCK_K`` steps in a fixed order,
split into ``split`` fixed ranges of K (so a one-row call still spreads over the chip), each
range's partial sums written in float32 and added in range order by a second kernel. A row's
sums never see another row (a matrix instruction's output element depends on its own row and
column only), so its bits are those of any other call; M-tiles that share a weight tile run
next to each other (grouped order), so wide calls read the weights about once from memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M = 64, 128, 64, 8
TARGET_CTAS = 264  # about two per multiprocessor on an H100 or H200 (132)


def split_for(n: int, k: int) -> int:
    """Ranges of K a layer's reduction is split into: enough tiles for a one-row call to use
    the chip, each range still a whole number of at least four ``BLOCK_K`` steps."""
    n_tiles = triton.cdiv(n, BLOCK_N)
    steps = triton.cdiv(k, BLOCK_K)
    split = max(1, min(TARGET_CTAS // n_tiles, steps // 4))
    while steps % split:  # equal whole ranges
        split -= 1
    return split


@triton.jit(do_not_specialize=["M"])
def _gemm_partial_kernel(x_ptr, w_ptr, part_ptr, M, N, K, K_PER_SPLIT,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
    pid_n = (pid % (GROUP_M * n_n)) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k0 = split * K_PER_SPLIT
    for k in range(k0, k0 + K_PER_SPLIT, BLOCK_K):
        a = tl.load(x_ptr + rows[:, None] * K + (k + ks)[None, :],
                    mask=(rows[:, None] < M) & ((k + ks)[None, :] < K), other=0.0)
        b = tl.load(w_ptr + cols[None, :] * K + (k + ks)[:, None],
                    mask=(cols[None, :] < N) & ((k + ks)[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    dst = part_ptr + split * M * N + rows[:, None] * N + cols[None, :]
    tl.store(dst, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _gemm_sum_kernel(part_ptr, bias_ptr, out_ptr, M, N, SPLIT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < N
    total = tl.load(part_ptr + row * N + cols, mask=inside, other=0.0)
    for s in tl.static_range(1, SPLIT):  # in range order: fixed
        total += tl.load(part_ptr + s * M * N + row * N + cols, mask=inside, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, total.to(out_ptr.dtype.element_ty), mask=inside)


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         rows: int | None = None) -> torch.Tensor:
    """x [P, K] (contiguous) times weight [N, K]^T (+ bias [N]) for the first ``rows`` rows
    (default all) -> [P, N] in x's dtype (rows past ``rows`` left as they are)."""
    P, K = x.shape
    N = weight.shape[0]
    M = P if rows is None else rows
    split = split_for(N, K)
    steps = triton.cdiv(K, BLOCK_K)
    part = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N), split)
    _gemm_partial_kernel[grid](x, weight, part, M, N, K, (steps // split) * BLOCK_K,
                               BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                               GROUP_M=GROUP_M, num_warps=4, num_stages=4,
                               PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    out = torch.empty(P, N, dtype=x.dtype, device=x.device)
    _gemm_sum_kernel[(M, triton.cdiv(N, 1024))](part, bias if bias is not None else part, out,
                                                 M, N, SPLIT=split, HAS_BIAS=bias is not None,
                                                 BLOCK=1024, num_warps=4)
    return out
