"""A fixed-config Triton GEMM whose rows are batch-invariant for any row count, reading the
weights once per call: the candidate to replace the runner's 128-row cuBLAS tiles on the GPU
(``Linear.tiles`` reads the weights once per tile, so a 576-row verification step of 64
sessions x 9 tokens reads them five times). Measured against the tiles by the GPU sitting's
``gemm`` stage in each configuration of ``CANDIDATES`` (``scripts/sitting_gemm.py``). The runner
runs some of them at the row counts where they measured faster and give the tiles' bits
(``gemm_plan``); ``gemm="triton"`` runs ``DEFAULT`` at every row count.

y = x W^T (+ b), x [M, K], W [N, K]. The configuration is a function of (N, K) alone, never of
M: ``block_m`` x ``block_n`` output tiles, the reduction in ``block_k`` steps in a fixed order,
split into ``split`` fixed ranges of K (so a one-row call still spreads over the chip), each
range's partial sums written in float32 and added in range order by a second kernel (one range:
written by the first, with the same arithmetic; configurations without split-K always take one
range, getting a decode row's programs from narrow column tiles instead). A row's sums never
see another row (a matrix instruction's output element depends on its own row and column only),
so its bits are those of any other call; M-tiles that share a weight tile run next to each
other (grouped order), so wide calls read the weights about once from memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

TARGET_CTAS = 264  # about two per multiprocessor on an H100 or H200 (132)


@dataclass(frozen=True)
class GemmConfig:
    """One fixed configuration of the kernel (never chosen by M): output tiles of ``block_m``
    x ``block_n``, the reduction in ``block_k`` steps, ``group_m`` M-tiles sharing a weight
    tile side by side, Triton's warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 4
    group_m: int = 8
    split_k: bool = True  # False: one range of K at every call (no float32 partials)

    @property
    def name(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}/w{self.warps}s{self.stages}"
                + ("" if self.split_k else f"g{self.group_m}/nosplit"))


DEFAULT = GemmConfig(64, 128, 64)  # the first sitting's
# what the sitting's ``gemm`` stage measures beside the cuBLAS tiles: small M-tiles waste least
# on a decode step's one row, big ones reuse each weight tile most on a 576-row step
CANDIDATES = (DEFAULT, GemmConfig(16, 128, 128), GemmConfig(64, 256, 64, warps=8, stages=3),
              GemmConfig(128, 128, 64, warps=8, stages=3),
              GemmConfig(128, 256, 64, warps=8, stages=3),
              # no split-K (issue 43, point 2): a decode row gets its programs from narrow column
              # tiles (an 8b layer's 4,096-28,672 columns: 128-896 tiles of 32), a wide step
              # reads each weight tile once for up to 16 M-tiles side by side (576 rows: 9)
              GemmConfig(16, 32, 128, group_m=16, split_k=False),
              GemmConfig(64, 64, 64, group_m=16, split_k=False),
              # no split-K with wider tiles (a wide step's tensor-core tiles; the sitting's
              # ``same_bits`` says whether tiles of one block_k differ only in speed)
              GemmConfig(16, 64, 64, group_m=16, split_k=False),
              GemmConfig(64, 128, 64, group_m=16, split_k=False),
              GemmConfig(128, 128, 64, warps=8, stages=3, group_m=16, split_k=False),
              GemmConfig(128, 256, 64, warps=8, stages=3, group_m=16, split_k=False))


def fits(m: int, n: int, k: int, config: "GemmConfig") -> bool:
    """Whether every element offset of an (m x k) by (n x k) call in ``config``, its split
    partials included, fits the kernels' 32-bit index arithmetic (the 8b LM head's 128,256
    columns reach 2^31 at 16,744 rows)."""
    return max(m * k, n * k, split_for(n, k, config) * m * n) < 2 ** 31


def split_for(n: int, k: int, config: GemmConfig = DEFAULT) -> int:
    """Ranges of K a layer's reduction is split into: enough tiles for a one-row call to use
    the chip, each range still a whole number of at least four ``block_k`` steps."""
    if not config.split_k:
        return 1
    n_tiles = triton.cdiv(n, config.block_n)
    steps = triton.cdiv(k, config.block_k)
    split = max(1, min(TARGET_CTAS // n_tiles, steps // 4))
    while steps % split:  # equal whole ranges
        split -= 1
    return split


@triton.jit(do_not_specialize=["M"])
def _gemm_partial_kernel(x_ptr, w_ptr, part_ptr, bias_ptr, M, N, K, K_PER_SPLIT,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, PRECISION: tl.constexpr, FINAL: tl.constexpr,
                         HAS_BIAS: tl.constexpr):
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
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    if FINAL:  # one range: the sum kernel's arithmetic, here (bias in float32, then rounded)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(part_ptr + rows[:, None] * N + cols[None, :],
                 acc.to(part_ptr.dtype.element_ty), mask=inside)
    else:
        tl.store(part_ptr + split * M * N + rows[:, None] * N + cols[None, :], acc, mask=inside)


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
         rows: int | None = None, config: GemmConfig = DEFAULT) -> torch.Tensor:
    """x [P, K] (contiguous) times weight [N, K]^T (+ bias [N]) for the first ``rows`` rows
    (default all) -> [P, N] in x's dtype (rows past ``rows`` left as they are)."""
    P, K = x.shape
    N = weight.shape[0]
    M = P if rows is None else rows
    if not fits(M, N, K, config) or not (x.is_contiguous() and weight.is_contiguous()) \
            or x.dtype != weight.dtype:
        raise ValueError(f"the Triton GEMM takes contiguous operands of one dtype whose offsets "
                         f"fit 32 bits: {M} x {K} ({x.dtype}) by {N} x {K} ({weight.dtype})")
    split = split_for(N, K, config)
    steps = triton.cdiv(K, config.block_k)
    out = torch.empty(P, N, dtype=x.dtype, device=x.device)
    part = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32,
                                              device=x.device)
    grid = (triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n), split)
    _gemm_partial_kernel[grid](x, weight, part, bias if bias is not None else part, M, N, K,
                               (steps // split) * config.block_k,
                               BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                               BLOCK_K=config.block_k, GROUP_M=config.group_m,
                               PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                               FINAL=split == 1, HAS_BIAS=bias is not None,
                               num_warps=config.warps, num_stages=config.stages)
    if split > 1:
        _gemm_sum_kernel[(M, triton.cdiv(N, 1024))](
            part, bias if bias is not None else part, out, M, N, SPLIT=split,
            HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4)
    return out
