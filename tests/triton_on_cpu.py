"""Run the fused Triton kernels on CPU tensors (Triton's interpreter) where no GPU is.

``conftest`` imports this first, before anything imports Triton (which reads
``TRITON_INTERPRET`` once): it sets ``TRITON_INTERPRET=1`` when CUDA is absent, and mends two
interpreter gaps:

- a loop bound loaded from memory (the attention's own key count) is a one-element array
  there, which NumPy 2.4 no longer converts with ``int()``;
- ``tl.dot`` there is NumPy's BLAS ``matmul``, whose output row gets other last bits depending
  on where it sits in the tile (OpenBLAS's micro-kernels treat rows differently). A GPU's
  product computes every output element the same way (the start check proves it there), so
  here each element sums its products in order, in the accumulator's type: row invariance
  under the interpreter then says what it says on the device. (Its own ``tl.dot`` also
  multiplies bfloat16 operands as their raw bits: widened here first.) Test modules of the
kernels call ``require_triton()`` (skipped where Triton is not installed)."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = not torch.cuda.is_available()
if INTERPRETED:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

if HAVE_TRITON and INTERPRETED:
    from triton.runtime import interpreter as _interpreter

    _patch = _interpreter._patch_lang_tensor

    def _patch_with_index(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_with_index

    import numpy as np

    import triton.language as tl

    def _values(x, acc):
        """An operand's values in the accumulator's type (the interpreter keeps bfloat16 as its
        bits in uint16: widened exactly here)."""
        if x.dtype.scalar == tl.bfloat16:
            return (x.data.astype(np.uint32) << 16).view(np.float32).astype(acc)
        return x.data.astype(acc)

    def _dot_in_order(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data.dtype
        products = _values(a, acc)[:, :, None] * _values(b, acc)[None, :, :]  # [M, K, N]
        # a sum over a leading axis adds its slices one after another: the same order for
        # every element, wherever it sits
        return _interpreter.TensorHandle(products.sum(axis=1, dtype=acc) + d.data,
                                         d.dtype.scalar)

    _interpreter.InterpreterBuilder.create_dot = _dot_in_order


def require_triton() -> None:
    """Skip the calling module where Triton is not installed (pip install triton)."""
    if not HAVE_TRITON:
        pytest.skip("Triton is not installed here (pip install triton runs its kernels on CPU "
                    "tensors under its interpreter)", allow_module_level=True)
