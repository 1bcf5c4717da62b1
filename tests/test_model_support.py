"""The runner decodes a model only as the model itself does: a config asking for what its
forward does not compute (another MLP activation, biases on the attention's output or the MLP,
a sliding window shorter than the served context, rotary scaling that changes past the trained
length) is refused by name before serving, where it was served as another model; within what it
computes (a window no shorter than the context) it is served, target-only's output."""

from __future__ import annotations

import pytest
import torch
import transformers

from conftest import hf_greedy
from edgespec.config import ConfigError, EngineConfig
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.runner.target_runner import TargetRunner

PROMPT = [1, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


def _model(kind: str, **kw):
    torch.manual_seed(0)
    cfg = getattr(transformers, kind + "Config")(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
        max_position_embeddings=kw.pop("max_position_embeddings", 1024),
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2, **kw)
    model = getattr(transformers, kind + "ForCausalLM")(cfg).eval()
    with torch.no_grad():  # biases start at zero: give them values, as a trained model has
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("kind, kw, max_len, says", [
    ("Llama", dict(hidden_act="gelu_pytorch_tanh"), 128, "activation is 'gelu_pytorch_tanh'"),
    ("Llama", dict(attention_bias=True), 128, "o_proj carry biases"),
    ("Llama", dict(mlp_bias=True), 128, "gate_proj, up_proj, down_proj carry biases"),
    ("Mistral", dict(sliding_window=32), 128, "slides over 32 tokens"),
    # Mistral's forward slides over sliding_window whatever its layer_types say
    ("Mistral", dict(sliding_window=32, layer_types=["full_attention"] * 2), 128,
     "slides over 32 tokens"),
    # a Llama's generation keeps only the window's keys in its cache, where a config sets one
    ("Llama", dict(sliding_window=32), 128, "slides over 32 tokens"),
    ("Qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=0), 128,
     "slides over 32 tokens"),
    ("Llama", dict(max_position_embeddings=64,
                   rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                    "rope_theta": 10000.0}), 128, "changes past 64 tokens"),
])
def test_what_the_forward_does_not_compute_is_refused_by_name(kind, kw, max_len, says):
    with pytest.raises(ConfigError, match="not decode this model") as e:
        TargetRunner(_model(kind, **kw), n_slots=1, max_len=max_len)
    assert says in str(e.value)


@pytest.mark.parametrize("kind, kw", [
    ("Mistral", dict(sliding_window=64)),  # no shorter than the context served
    ("Llama", dict(sliding_window=64)),
    ("Qwen2", dict(sliding_window=16)),  # set, but not used (use_sliding_window off)
    ("Qwen2", dict()),  # biases on the query, key and value products: computed
    ("Llama", dict(max_position_embeddings=64,
                   rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                    "rope_theta": 10000.0})),  # within the trained length
])
def test_within_what_it_computes_a_model_is_served_as_itself(kind, kw):
    model = _model(kind, **kw)
    runner = TargetRunner(model, n_slots=1, max_len=64)
    with SpecEngine(runner, None, EngineConfig(max_sessions=1, max_context=64),
                    stop_ids=set()) as engine:
        out = engine.generate(Request(PROMPT, 24)).token_ids
    assert out == hf_greedy(model, PROMPT, 24, eos=(-1,))


def test_a_drafters_runner_is_not_held_to_the_targets_exactness():
    """A draft may be anything (its acceptance alone suffers): a drafter's model with a feature
    the forward does not compute still drafts; a model type with no forward at all does not."""
    TargetRunner(_model("Llama", mlp_bias=True), n_slots=1, max_len=64, exact=False)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_embd=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(ConfigError, match="runner supports"):
        TargetRunner(gpt2, n_slots=1, max_len=64, exact=False)


def test_dynamic_rotary_scaling_changes_past_the_models_own_length():
    """transformers rescales ``dynamic`` rotary frequencies past ``max_position_embeddings``
    (not the parameters' ``original_max_position_embeddings``): served up to it."""
    model = _model("Llama", max_position_embeddings=128, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0,
        "original_max_position_embeddings": 32})
    TargetRunner(model, n_slots=1, max_len=128)
    with pytest.raises(ConfigError, match="changes past 128 tokens"):
        TargetRunner(model, n_slots=1, max_len=256)
