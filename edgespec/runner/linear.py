"""The runner's linear layer: pre-packed oneDNN weights on CPU, rows batch-invariant (a lone row
goes through as two), the building block ``edgespec.runner.target_runner`` and
``edgespec.runner.dtype_probe`` share."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def _mkldnn_ok(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear:
    """y = x W^T + b. On CPU in float32 and bfloat16 the weight is pre-packed for oneDNN once
    (bfloat16: AMX where the CPU has it, ~2x float32 per row and flat up to 8 rows).

    Rows are batch-invariant from 2 rows up (measured: 1..512 rows, every layer shape of the
    default model, float32 and bfloat16); a lone row goes through as two.

    Pre-packing matters: measured on 2 CPU cores, MKL's plain sgemm re-packs the weight on every
    call and costs ~2x a matrix-vector product for 2..8 rows, so a forward over a k+1-token draft
    cost ~2x a forward over one token; with packed weights a 7-token forward costs ~1.5x a
    1-token one (37.5 vs 55.6 ms, default model, 700-token context).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 pack: bool = True, batch_hint: int = 8):
        self.weight, self.bias = weight, bias
        self.packed = None
        if pack and _mkldnn_ok(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1]:
            # one row: oneDNN (and MKL) take a single-row path that sums a long input (the MLP's
            # down projection, 1536 wide) in another order than for 2 rows and more, so a decode
            # step would not have a verification row's bits; 2 rows cost about what 1 does
            two = x.reshape(1, -1).expand(2, -1).contiguous()
            return self._apply(two)[:1].reshape(*x.shape[:-1], -1)
        return self._apply(x)

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
