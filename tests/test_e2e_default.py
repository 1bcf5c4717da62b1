"""End to end on the real default model (SmolLM2-135M-Instruct, pulled on first use):
speculative == edgespec target-only == transformers generate, greedy, token for token."""

import pytest
from conftest import hf_greedy

from edgespec.config import SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

PROMPTS = [
    "Summarize in one sentence: The quick brown fox jumps over the lazy dog. The dog does not "
    "move. The fox jumps over the lazy dog again and again.",
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
]


@pytest.fixture(scope="module")
def gen():
    from edgespec.config import EngineConfig
    from edgespec.engine.local import LocalGenerator

    # every step waits until the drafter has answered (a draft of k tokens, or "nothing more"),
    # so what gets drafted does not depend on how fast the drafter thread happened to run
    g = LocalGenerator("default", "mag", dtype="float32", config=EngineConfig(
        max_sessions=2, max_context=1024, draft_wait_ms=600_000, adaptive=False))
    yield g
    g.close()


@pytest.fixture(scope="module")
def hf_ref(gen):
    """transformers' greedy output of the float32 target, computed once per (prompt, length) in
    the module: two tests compare against the same prompt's."""
    refs: dict = {}

    def ref(ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in refs:
            refs[key] = hf_greedy(gen.target.model, ids, n, eos=gen.stop_ids)
        return list(refs[key])
    return ref


@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculative_equals_target_only_equals_transformers(gen, hf_ref, prompt):
    ids = gen.encode(prompt)
    hf = hf_ref(ids, 32)
    plain = gen.generate(ids, 32, SamplingParams(), drafter="none")
    assert plain.token_ids == hf
    for drafter in ("mag", "layers:6"):
        spec = gen.generate(ids, 32, SamplingParams(), drafter=drafter)
        assert spec.token_ids == hf, drafter
        if drafter.startswith("layers"):  # a model drafter always offers a first token
            assert spec.stats.draft_tokens > 0


@pytest.fixture(scope="module")
def gen_bf16():
    from edgespec.config import EngineConfig
    from edgespec.runner.dtype_probe import exact_here
    from edgespec.engine.local import LocalGenerator

    if not exact_here("bfloat16"):
        pytest.skip("bfloat16 is not exact on this machine (its probe failed): not served")
    g = LocalGenerator("default", "mag", dtype="bfloat16", config=EngineConfig(
        max_sessions=5, max_context=1024, draft_wait_ms=600_000, adaptive=False))
    yield g
    g.close()


def _spec_bench(categories: tuple[str, ...]) -> list[str]:
    from edgespec_cli.bench.run import load_questions

    return [q["prompt"] for q in load_questions(list(categories), 1, full=False)]


CATEGORIES = ("mt_bench", "summarization", "qa", "translation")


def test_bfloat16_speculative_equals_bfloat16_target_only(gen_bf16):
    """Where bfloat16 speculation used to differ from bfloat16 target-only (the first writing
    (mt_bench), summarization and qa prompts: attention over a different number of keys flipped
    a near-tie): now token for token, a chain drafter and a model drafter (2 tokens a step),
    64 tokens; and a seeded sampled session, 48. The sessions run batched, each drafter's and
    target-only's (the batch is the served path; batched target-only is each session's alone,
    ``test_batch_invariance``)."""
    from dataclasses import replace

    from edgespec.engine.generation import Request
    from edgespec.engine.local import LocalGenerator

    prompts = [gen_bf16.encode(_spec_bench((c,))[0]) for c in CATEGORIES]
    assert len(prompts) == len(CATEGORIES) and gen_bf16.dtype == "bfloat16"
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    reqs = [(ids, 64, SamplingParams()) for ids in prompts] + [(prompts[0], 48, sampled)]

    def outputs(gen: LocalGenerator, drafter: str) -> list[list[int]]:
        got = gen.engine(drafter).generate_many([Request(list(i), n, p) for i, n, p in reqs])
        return [r.token_ids for r in got]

    # the model drafter drafts 2 tokens a step, not 8, with the target's first 2 layers, not 6:
    # its forwards (a session and a token at a time in the drafting thread) were most of the
    # test's time (with 6 layers 44 of 97 s on a quiet machine, with 2 layers 27); rows 3 wide
    # all the same still verify over other key counts than target-only's
    model_drafted = LocalGenerator(gen_bf16.target, config=replace(gen_bf16.cfg, max_draft=2))
    try:
        plain = outputs(gen_bf16, "none")
        assert all(len(out) > 8 for out in plain)
        for gen, drafter in ((gen_bf16, "mag"), (model_drafted, "layers:2")):
            for what, spec, ref in zip([*CATEGORIES, "sampled"], outputs(gen, drafter), plain,
                                       strict=True):
                assert spec == ref, (drafter, what)
    finally:
        model_drafted.close()


def test_the_shipped_heads_keep_float32_output_and_get_accepted(gen, hf_ref):
    """The repository's heads and imitation network of the default model (trained on its
    bfloat16 features), in a float32 target: the same tokens as target-only and transformers,
    their drafts accepted."""
    ids = gen.encode(PROMPTS[2])
    hf = hf_ref(ids, 32)
    for drafter in ("head:eagle", "mag+head:specformer", "head:ctc", "imitation:default"):
        out = gen.generate(ids, 32, SamplingParams(), drafter=drafter)
        assert out.token_ids == hf, drafter
        assert out.stats.head_accepted > 0, drafter


def test_the_default_head_and_auto_keep_bfloat16_output_greedy_and_sampled(gen_bf16):
    ids = gen_bf16.encode(_spec_bench(("qa",))[0])
    for params in (SamplingParams(), SamplingParams(temperature=0.7, seed=3)):
        plain = gen_bf16.generate(ids, 40, params, drafter="none")
        for drafter in ("head:default", "auto", "imitation:default"):
            out = gen_bf16.generate(ids, 40, params, drafter=drafter)
            assert out.token_ids == plain.token_ids, (drafter, params)
            if drafter == "auto":  # it picks what pays here; every step is accounted for
                assert sum(out.stats.stacks.values()) == out.stats.steps
            else:
                assert out.stats.head_tokens > 0


def test_the_shipped_pad_classifier_serves_the_default_model(gen_bf16):
    """``--verify pad:default``: the shipped classifier loads for the default model (its
    fingerprint matches), at sigma 0 it is exact verification token for token, and at the
    recommended sigma its sessions are marked lossy."""
    from edgespec.config import EngineConfig, PadParams
    from edgespec.drafters import build_drafter
    from edgespec.engine.spec_engine import Request, SpecEngine
    from edgespec.pad.tasks import family_problems

    problem = family_problems("extract", "test", 1).problems[0]
    ids = gen_bf16.encode(problem.prompt)
    plain = gen_bf16.generate(ids, 40, SamplingParams(), drafter="none")
    for sigma in (0.0, PadParams().sigma):
        cfg = EngineConfig(max_sessions=1, verify="pad", pad=PadParams("default", sigma))
        drafter = build_drafter("mag+cacheback", gen_bf16.target, gen_bf16.runner)
        with SpecEngine(gen_bf16.runner, drafter, cfg, gen_bf16.stop_ids) as engine:
            out = engine.generate(Request(ids, 40, SamplingParams()))
        assert out.stats.lossy and out.stats.verify == "pad"
        if sigma == 0.0:
            assert out.token_ids == plain.token_ids and out.stats.lenient_tokens == 0
