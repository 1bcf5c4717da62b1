"""Run the fused Triton kernels on CPU tensors (Triton's interpreter) where no GPU is.

Import this before ``triton``: it sets ``TRITON_INTERPRET=1`` when CUDA is absent, and mends
one interpreter gap: a loop bound loaded from memory (the attention's own key count) is a
one-element array there, which NumPy 2.4 no longer converts with ``int()``."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = not torch.cuda.is_available()
if INTERPRETED:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

if INTERPRETED:
    from triton.runtime import interpreter as _interpreter

    _patch = _interpreter._patch_lang_tensor

    def _patch_with_index(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_with_index
