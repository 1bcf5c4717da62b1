"""On a GPU, end to end: speculative decoding gives target-only's tokens on random-weight models of
the SmolLM2-1.7B and Llama-3.1-8B shapes (random weights put near-ties everywhere: the hardest
case), in every dtype served on CUDA (a refused one is asserted refused with its message), with
1, 8 and 64 sessions in a batch, chains and token trees, greedy and keyed sampling.

The reference is each prompt decoded alone by target-only decoding on the same runner; the
speculative runs batch the same prompts (64 sessions: each prompt eight times, in different rows),
so a row whose bits depended on its batch would show. The drafter is the test oracle
(``tree_oracle``), which knows the reference and drafts chains that go wrong with the right token
in a branch, so that long accepted prefixes, rejections and branches all occur; MaG drafts too.

Skipped where no CUDA device is: ``scripts/gpu_sitting.sh`` runs this module on a GPU machine
(and dry-runs it on a CPU with ``EDGESPEC_LOSSLESS_DEVICE=cpu EDGESPEC_LOSSLESS_LAYERS=1``: the
same code over one layer of each shape)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from tree_oracle import OracleTreeDrafter

from edgespec.config import ConfigError, EngineConfig, SamplingParams
from edgespec.drafters import build_drafter
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.models.shapes import random_model
from edgespec.runner.dtype_probe import exact_here
from edgespec.runner.target_runner import TargetRunner

DEVICE = os.environ.get("EDGESPEC_LOSSLESS_DEVICE", "cuda")
LAYERS = int(os.environ.get("EDGESPEC_LOSSLESS_LAYERS", "0")) or None  # None: the whole shape
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(),
    reason="no CUDA device here: scripts/gpu_sitting.sh runs these on a GPU machine")]

N_PROMPTS, NEW_TOKENS, SESSIONS = 8, 24, 64
STOP = {2}


@pytest.fixture(scope="module", params=[("1.7b", "bfloat16"), ("1.7b", "float32"),
                                        ("8b", "bfloat16")], ids=lambda p: "-".join(p))
def served(request):
    """(runner, prompts) for a shape and dtype on the device; skipped after asserting the refusal
    where the dtype is not served there."""
    shape, dtype = request.param
    model = random_model(shape, DEVICE, dtype, layers=LAYERS)
    if not exact_here(dtype, DEVICE):
        with pytest.raises(ConfigError, match="not batch-invariant"):
            TargetRunner(model, n_slots=SESSIONS, max_len=128)
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        pytest.skip(f"{dtype} is refused on {DEVICE} here (asserted): never served")
    runner = TargetRunner(model, n_slots=SESSIONS, max_len=128)
    rng = random.Random(f"{shape}-{dtype}")
    prompts = [[1] + [rng.randrange(3, runner.vocab_size) for _ in range(rng.randint(4, 40))]
               for _ in range(N_PROMPTS)]
    yield runner, prompts
    del runner, model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _params(sampled: bool, i: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i) if sampled \
        else SamplingParams()


def _cfg(trees: bool) -> EngineConfig:
    return EngineConfig(max_draft=6, window=12, chunk=3, adaptive=False, draft_wait_ms=5000,
                        max_sessions=SESSIONS, max_context=128, max_batch_tokens=SESSIONS * 8,
                        tree_width=3, tree_nodes=8 if trees else 0)


def _target_only(runner, prompts, sampled) -> dict[tuple[int, ...], list[int]]:
    with SpecEngine(runner, None, _cfg(False), stop_ids=STOP) as engine:
        return {tuple(p): engine.generate(Request(p, NEW_TOKENS, _params(sampled, i))).token_ids
                for i, p in enumerate(prompts)}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "keyed-sampled"])
def test_speculative_equals_target_only_alone_and_in_batches(served, sampled):
    runner, prompts = served
    refs = _target_only(runner, prompts, sampled)
    for trees in (False, True):
        drafter = OracleTreeDrafter(refs, runner.vocab_size, seed=7)
        with SpecEngine(runner, drafter, _cfg(trees), stop_ids=STOP) as engine:
            for batch in (1, N_PROMPTS, SESSIONS):
                reqs = [Request(prompts[i % N_PROMPTS], NEW_TOKENS,
                                _params(sampled, i % N_PROMPTS)) for i in range(batch)]
                results = engine.generate_many(reqs)
                for i, res in enumerate(results):
                    assert res.token_ids == refs[tuple(prompts[i % N_PROMPTS])], \
                        (trees, batch, i)
                assert sum(r.stats.accepted_tokens for r in results) > 0
                if trees:
                    assert sum(r.stats.branch_tokens for r in results) > 0


def test_mag_in_a_batch_equals_target_only(served):
    runner, prompts = served
    refs = _target_only(runner, prompts, False)
    with SpecEngine(runner, build_drafter("mag"), _cfg(False), stop_ids=STOP) as engine:
        results = engine.generate_many([Request(p, NEW_TOKENS) for p in prompts])
    assert [r.token_ids for r in results] == [refs[tuple(p)] for p in prompts]


def test_logprobs_in_a_batch_equal_target_onlys(served):
    """A session's logprobs (5 alternatives) are target-only decoding's bit for bit when trees
    are drafted for it in a batch of 64 (greedy), as its tokens are."""
    runner, prompts = served
    with SpecEngine(runner, None, _cfg(False), stop_ids=STOP) as engine:
        refs = [engine.generate(Request(p, NEW_TOKENS, logprobs=5)) for p in prompts]
    drafter = OracleTreeDrafter({tuple(p): r.token_ids for p, r in zip(prompts, refs)},
                                runner.vocab_size, seed=7)
    with SpecEngine(runner, drafter, _cfg(True), stop_ids=STOP) as engine:
        results = engine.generate_many([Request(prompts[i % N_PROMPTS], NEW_TOKENS, logprobs=5)
                                        for i in range(SESSIONS)])
    assert sum(r.stats.branch_tokens for r in results) > 0
    for i, res in enumerate(results):
        ref = refs[i % N_PROMPTS]
        assert res.token_ids == ref.token_ids and res.logprobs == ref.logprobs, i


def test_penalties_bias_and_prompt_logprobs_in_a_batch_equal_target_onlys(served):
    """Penalties and a logit bias (sampled, trees drafted, a batch of 64) give target-only's
    tokens, and a session that also asks for its prompt's logprobs (scored as it is prefilled)
    gets the same tokens and the same prompt logprobs as one decoded alone."""
    runner, prompts = served
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=200 + i, presence_penalty=-0.5,
                             frequency_penalty=0.8, logit_bias={5: 3.0, 6: -100})
              for i in range(N_PROMPTS)]
    with SpecEngine(runner, None, _cfg(False), stop_ids=STOP) as engine:
        refs = [engine.generate(Request(p, NEW_TOKENS, params[i], prompt_logprobs=2))
                for i, p in enumerate(prompts)]
        plain = [engine.generate(Request(p, NEW_TOKENS, params[i])).token_ids
                 for i, p in enumerate(prompts)]
    assert [r.token_ids for r in refs] == plain  # scoring the prompt changes nothing
    drafter = OracleTreeDrafter({tuple(p): r.token_ids for p, r in zip(prompts, refs)},
                                runner.vocab_size, seed=7)
    with SpecEngine(runner, drafter, _cfg(True), stop_ids=STOP) as engine:
        results = engine.generate_many([
            Request(prompts[i % N_PROMPTS], NEW_TOKENS, params[i % N_PROMPTS],
                    prompt_logprobs=2 if i % 2 else None) for i in range(SESSIONS)])
    assert sum(r.stats.branch_tokens for r in results) > 0
    for i, res in enumerate(results):
        ref = refs[i % N_PROMPTS]
        assert res.token_ids == ref.token_ids, i
        if i % 2:
            assert res.prompt_logprobs == ref.prompt_logprobs, i
