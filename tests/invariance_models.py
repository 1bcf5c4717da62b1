"""The model and runners the batch-invariance tests share (``test_batch_invariance``,
``test_invariance_probes``): a two-layer Llama with the default model's widths, random weights,
and its runner in a dtype on a device."""

from __future__ import annotations

import copy

import pytest
import torch

from edgespec.config import ConfigError
from edgespec.runner.dtype_probe import exact_here
from edgespec.runner.target_runner import TargetRunner

VOCAB = 96

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                             reason="no CUDA device here: the CUDA sweep runs on a GPU machine")


def build_hd64_model():
    """A two-layer Llama with the default model's widths (hidden 576, 9 heads of 64 in 3 kv
    groups, MLP 1536: a lone row once summed the 1536-wide down projection in another order),
    random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=1024, initializer_range=0.1,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def runner_in(model, dtype: str, device: str, slots: int = 16) -> TargetRunner | None:
    """The runner in ``dtype`` on ``device``; None where that dtype is not served on a GPU, after
    asserting that the runner refuses it and says why (a CPU dtype this CPU refuses is skipped
    by its mark)."""
    m = copy.deepcopy(model).to(device=device, dtype=getattr(torch, dtype))
    if device == "cuda" and not exact_here(dtype, "cuda"):
        with pytest.raises(ConfigError, match="not batch-invariant"):
            TargetRunner(m, n_slots=slots, max_len=300)
        return None
    return TargetRunner(m, n_slots=slots, max_len=300)  # not a whole number of key blocks
