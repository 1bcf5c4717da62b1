"""Run the fused Triton kernels on CPU tensors (Triton's interpreter) where no GPU is.

``conftest`` imports this first, before anything imports Triton (which reads
``TRITON_INTERPRET`` once): it sets ``TRITON_INTERPRET=1`` when CUDA is absent, and mends one
interpreter gap: a loop bound loaded from memory (the attention's own key count) is a
one-element array there, which NumPy 2.4 no longer converts with ``int()``. Test modules of the
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


def require_triton() -> None:
    """Skip the calling module where Triton is not installed (pip install triton)."""
    if not HAVE_TRITON:
        pytest.skip("Triton is not installed here (pip install triton runs its kernels on CPU "
                    "tensors under its interpreter)", allow_module_level=True)
