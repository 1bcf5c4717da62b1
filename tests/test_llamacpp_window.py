"""The llama.cpp drafter's context window: a long prompt is read as its first LLAMACPP_HEAD and
its last tokens (``context_window`` in all, the last included), so that a board opens it in a
fraction of the time. A windowed session drafts exactly what a session opened on those tokens
alone drafts, before and after fixes and drafts stopped early; a sampled draft keeps its
absolute positions' keys; a rollback into the unread part reads the session anew; a prompt
longer than a sequence opens; a window that cannot fit is refused. Skips without
llama-cpp-python (the optional llamacpp extra)."""

import pytest

from edgespec.config import ConfigError, SamplingParams
from llamacpp_harness import llama_cpp  # noqa: F401  (the fixture: skips without it)

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=5)


@pytest.fixture(scope="module")
def drafter(llama_cpp):
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


def test_a_long_prompt_drafts_what_its_head_and_tail_draft(drafter):
    ids = _prompt(200)
    s = drafter.open(ids, GREEDY)
    assert s.skip == len(ids) - 64  # 64 tokens read, the last included
    assert s.kv_len == len(ids) - 1
    ref = drafter.open(_read(ids, s.skip), GREEDY)
    assert ref.skip == 0  # 64 tokens: within the window, read whole
    assert s.propose(6).tokens == ref.propose(6).tokens
    s.close(), ref.close()


def test_a_sampled_draft_is_keyed_by_the_tokens_absolute_position(drafter):
    """The window changes what the drafter reads, not where a token sits: a sampled draft's
    token is the session's keyed sample at its absolute position from the logits its reading
    gives."""
    from edgespec.drafters.token_choice import choose_token

    ids = _prompt(200)
    s = drafter.open(ids, SEEDED)
    ref = drafter.open(_read(ids, s.skip), SEEDED)
    logits = drafter.feed_many([(ref, ref.tokens[ref.kv_len:])])[0]
    keyed = [choose_token(logits, SEEDED, at)[0] for at in (len(ids), len(ref.tokens))]
    assert keyed[0] != keyed[1]  # the two positions' keys draw differently here
    assert s.propose(1).tokens == keyed[:1]
    s.close(), ref.close()


def test_a_draft_stopped_for_low_confidence_leaves_the_window_consistent(llama_cpp):
    """A draft that stops below ``min_confidence`` keeps the logits it stopped on, its cache
    holding every token (the next proposal starts from them); the windowed session drafts on as
    its reading does."""
    from edgespec.drafters.llamacpp import LlamaCppDrafter

    d = LlamaCppDrafter("default", n_slots=2, max_len=160, min_confidence=0.9,
                        context_window=64)
    try:
        ids = _prompt(200)
        s = d.open(ids, GREEDY)
        ref = d.open(_read(ids, s.skip), GREEDY)
        for _ in range(3):
            mine, theirs = s.propose(6).tokens, ref.propose(6).tokens
            assert mine == theirs and len(mine) < 6  # stopped early: its logits kept
            assert s.kv_len == len(s.tokens) and ref.kv_len == len(ref.tokens)
            assert s._held is not None and s._held[0] == len(s.tokens)
        s.close(), ref.close()
    finally:
        d.close()


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
        assert s.skip == skip and s.kv_len - skip == ref.kv_len  # the same positions cached
    assert s.propose(4).tokens == ref.propose(4).tokens
    s.close(), ref.close()


def test_a_rollback_into_the_unread_part_reads_the_session_anew(drafter):
    from edgespec.config import LLAMACPP_HEAD

    ids = _prompt(150)
    s = drafter.open(ids, GREEDY)
    s.propose(3)
    assert 60 - 1 <= LLAMACPP_HEAD + s.skip  # 60 tokens end among those it never read
    s.rollback(60)
    assert s.skip == 0 and s.kv_len == 59 and s.tokens == ids[:60]  # 60 tokens: read whole
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

    for bad in (LLAMACPP_HEAD, 81):  # at most half a session's 160 positions
        with pytest.raises(ConfigError, match="context window"):
            LlamaCppDrafter("default", n_slots=1, max_len=160, context_window=bad)
    whole = LlamaCppDrafter("default", n_slots=1, max_len=160, context_window=0)
    assert whole.open(_prompt(100), GREEDY).skip == 0  # 0: the whole session is read
    whole.close()
