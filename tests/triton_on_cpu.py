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
kernels call ``require_triton()`` (skipped where Triton is not installed).

It also patches the language for a jit helper called inside a kernel once a launch, not at
every call (the same kernels, a fifth less time), and gives the kernels' tests their inputs: the
device (``DEV``), the dtypes they are held in (``DTYPES``) and seeded random tensors there."""

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

    # The interpreter builds a table of 19 dtypes at every lookup of an element's NumPy type
    # (several lookups an operation, in every program): a sixteenth of these tests' time. The
    # scalar types are the language's singletons, so one table, by identity, answers the same.
    _np_dtype = _interpreter._get_np_dtype
    _by_id = {id(t): _np_dtype(t) for t in (
        tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16,
        tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16)}
    _block = tl.block_type

    def _known_np_dtype(tt_dtype):  # pointers (and blocks of them) by the interpreter's own
        element = tt_dtype.element_ty if type(tt_dtype) is _block else tt_dtype
        got = _by_id.get(id(element))
        return _np_dtype(tt_dtype) if got is None else got

    _interpreter._get_np_dtype = _known_np_dtype

    # Every interpreted tensor holds its shape as a language tuple, whose type spells out its
    # name (a string of every element's type) when it is made, in every operation of every
    # program: a sixth of these tests' time. Only ``str`` reads that name: spelt when read.
    _tuple_type = tl.core.tuple_type

    def _unnamed_tuple_type(self, types, fields=None):
        self.types, self.fields = types, fields or [""] * len(types)

    _tuple_type.__init__ = _unnamed_tuple_type
    _tuple_type.name = property(
        lambda self: "[" + ",".join(f"{k}:{v}" for k, v in zip(self.fields, self.types)) + "]")

    # Triton re-patches the language (``inspect.getmembers`` over its modules) at every call of
    # a jit helper inside a kernel, in every program: a fifth of these tests' time. Once a launch
    # is enough: nothing restores those patches before the launch ends.
    _launches = [0]
    _launch = _interpreter.GridExecutor.__call__

    def _counted_launch(self, *args, **kwargs):
        _launches[0] += 1
        try:
            return _launch(self, *args, **kwargs)
        finally:  # the launch restored the language: a helper called after it patches again
            _launches[0] += 1

    def _device_call(self, *args, **kwargs):
        if getattr(self, "_patched_in", None) != _launches[0]:
            _interpreter._patch_lang(self.fn)
            self._patched_in = _launches[0]
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise _interpreter.InterpreterError(repr(e)) from e

    _interpreter.GridExecutor.__call__ = _counted_launch
    _interpreter.InterpretedFunction.__call__ = _device_call


DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEV, dtype)


def require_triton() -> None:
    """Skip the calling module where Triton is not installed (pip install triton)."""
    if not HAVE_TRITON:
        pytest.skip("Triton is not installed here (pip install triton runs its kernels on CPU "
                    "tensors under its interpreter)", allow_module_level=True)
