"""The llama.cpp drafter's context window: a long prompt is read as its first LLAMACPP_HEAD and
its last tokens (``context_window`` in all before the last token), so that a board opens it in
a fraction of the time. A windowed session drafts exactly what a session opened on those tokens
alone drafts, before and after fixes; a rollback into the unread part reads the session anew; a
prompt longer than a sequence opens; a window that cannot fit is refused. Skips without
llama-cpp-python (the optional llamacpp extra)."""

import pytest

from edgespec.config import ConfigError, SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=5)


@pytest.fixture(scope="module")
def drafter():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the optional "
                        "llamacpp extra)")
    from edgespec.drafters.llamacpp import LlamaCppDrafter

    d = LlamaCppDrafter("default", n_slots=2, max_len=160, min_confidence=0.0,
                        context_window=64)
    yield d
    d.close()


def _prompt(n: int) -> list[int]:
    """``n`` token ids of varied text-like ids (what is read matters, not what it says)."""
    return [1] + [(i * 7919) % 20000 + 200 for i in range(n - 1)]


def _read(ids: list[int], skip: int) -> list[int]:
    """What a windowed session reads of ``ids``, as a prompt of its own."""
    from edgespec.config import LLAMACPP_HEAD

    return ids[:LLAMACPP_HEAD] + ids[LLAMACPP_HEAD + skip:]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_long_prompt_drafts_what_its_head_and_tail_draft(drafter, params):
    ids = _prompt(200)
    s = drafter.open(ids, params)
    assert s.skip == len(ids) - 1 - 64  # 64 tokens read before the last
    assert s.kv_len == len(ids) - 1
    got = s.propose(6).tokens
    short = _read(ids, s.skip)
    ref = drafter.open(short, params)
    assert ref.skip == 0  # 65 tokens: within the window, read whole
    if params.temperature:
        # a sampled draft is keyed by absolute position: the reference sits skip tokens earlier,
        # so only greedy drafts compare token for token; a sampled one must at least be drafted
        assert len(got) == 6
    else:
        assert got == ref.propose(6).tokens
    s.close(), ref.close()


def test_fixes_in_a_windowed_session_draft_as_the_same_fixes_in_its_reading(drafter):
    ids = _prompt(150)
    s = drafter.open(ids, GREEDY)
    ref = drafter.open(_read(ids, s.skip), GREEDY)
    skip = s.skip
    for _ in range(3):
        mine, theirs = s.propose(5).tokens, ref.propose(5).tokens
        assert mine == theirs
        # the verifier accepts two and corrects the third
        fix = 4321 if mine[2] != 4321 else 4322
        s.rollback(len(s.tokens) - 3)
        s.append([fix])
        ref.rollback(len(ref.tokens) - 3)
        ref.append([fix])
        assert s.skip == skip and len(s.tokens) == len(ref.tokens) + skip
    assert s.propose(4).tokens == ref.propose(4).tokens
    s.close(), ref.close()


def test_a_rollback_into_the_unread_part_reads_the_session_anew(drafter):
    ids = _prompt(150)
    s = drafter.open(ids, GREEDY)
    s.propose(3)
    s.rollback(60)  # before LLAMACPP_HEAD + skip: positions the sequence never read
    assert s.skip == 0 and s.kv_len == 59 and s.tokens == ids[:60]
    fresh = drafter.open(ids[:60], GREEDY)
    assert s.propose(5).tokens == fresh.propose(5).tokens
    s.close(), fresh.close()


def test_a_prompt_longer_than_a_sequence_opens_and_drafts(drafter):
    ids = _prompt(400)  # a sequence holds 160 positions
    s = drafter.open(ids, GREEDY)
    assert len(s.propose(4).tokens) == 4
    s.close()


def test_a_window_that_cannot_fit_is_refused(drafter):
    from edgespec.config import LLAMACPP_HEAD
    from edgespec.drafters.llamacpp import LlamaCppDrafter

    for bad in (LLAMACPP_HEAD, 160):
        with pytest.raises(ConfigError, match="context window"):
            LlamaCppDrafter("default", n_slots=1, max_len=160, context_window=bad)
    whole = LlamaCppDrafter("default", n_slots=1, max_len=160, context_window=0)
    assert whole.open(_prompt(100), GREEDY).skip == 0  # 0: the whole session is read
    whole.close()
