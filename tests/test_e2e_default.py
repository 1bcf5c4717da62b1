"""End to end on the real default model (SmolLM2-135M-Instruct, pulled on first use):
speculative == edgespec target-only == transformers generate, greedy, token for token."""

import pytest
from conftest import hf_greedy

from edgespec.config import SamplingParams

pytestmark = pytest.mark.real_model

PROMPTS = [
    "Summarize in one sentence: The quick brown fox jumps over the lazy dog. The dog does not "
    "move. The fox jumps over the lazy dog again and again.",
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
]


@pytest.fixture(scope="module")
def gen():
    from edgespec.config import EngineConfig
    from edgespec.local import LocalGenerator

    # every step waits until the drafter has answered (a draft of k tokens, or "nothing more"),
    # so what gets drafted does not depend on how fast the drafter thread happened to run
    g = LocalGenerator("default", "mag", config=EngineConfig(
        max_sessions=2, max_context=1024, draft_wait_ms=600_000, adaptive=False))
    yield g
    g.close()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculative_equals_target_only_equals_transformers(gen, prompt):
    ids = gen.encode(prompt)
    hf = hf_greedy(gen.target.model, ids, 32, eos=gen.stop_ids)
    plain = gen.generate(ids, 32, SamplingParams(), drafter="none")
    assert plain.token_ids == hf
    for drafter in ("mag", "layers:6"):
        spec = gen.generate(ids, 32, SamplingParams(), drafter=drafter)
        assert spec.token_ids == hf, drafter
        if drafter.startswith("layers"):  # a model drafter always offers a first token
            assert spec.stats.draft_tokens > 0
