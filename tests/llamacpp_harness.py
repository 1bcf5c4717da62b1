"""The llamacpp drafter's tests' shared setup (``test_llamacpp_drafter``,
``test_llamacpp_sessions``): llama-cpp-python (skipped without it), a prompt and seeded sampling
settings, and a generator serving the default target whose every step waits for the drafter.
Its fixtures are imported into those modules."""

import pytest

from edgespec.config import EngineConfig, SamplingParams

PROMPT = "List three colours of the rainbow, one per line."
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=11)


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the "
                               "optional llamacpp extra: pip install \".[llamacpp]\")")


@pytest.fixture(scope="module")
def gen(llama_cpp):
    from edgespec.engine.local import LocalGenerator

    # every step waits for the drafter's answer, so what is drafted does not depend on timing
    g = LocalGenerator("default", "none", dtype="float32", config=EngineConfig(
        max_sessions=2, max_context=512, draft_wait_ms=600_000, adaptive=False))
    yield g
    g.close()
