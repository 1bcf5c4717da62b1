"""Drafters: MaG's matching and fallback, model drafters' rollback, the spec parser."""

import numpy as np
import pytest

from edgespec.config import ConfigError, SamplingParams
from edgespec.drafters import DraftLength, MaGDrafter, build_drafter
from edgespec.drafters.mag import longest_suffix_match
from edgespec.runner.target_runner import TargetRunner


def test_longest_suffix_match_prefers_longest_then_most_recent():
    arr = np.array([1, 2, 3, 9, 2, 3, 8, 1, 2, 3])
    assert longest_suffix_match(arr, 8, 1) == (3, 0)  # [1, 2, 3] at 0, followed by 9
    arr = np.array([2, 3, 9, 2, 3, 8, 2, 3])
    assert longest_suffix_match(arr, 8, 1) == (2, 3)  # most recent [2, 3] is followed by 8
    assert longest_suffix_match(np.array([5, 6, 7]), 8, 1) == (0, -1)


def test_mag_proposes_the_continuation_and_extends_its_tokens():
    d = MaGDrafter(tokens_per_match_token=4)
    s = d.open([10, 11, 12, 13, 14, 10, 11], SamplingParams())
    draft = s.propose(3)
    assert draft.tokens == [12, 13, 14]
    assert s.tokens[-3:] == [12, 13, 14]


def test_mag_short_match_sends_a_short_draft():
    d = MaGDrafter(tokens_per_match_token=2)
    s = d.open([10, 11, 12, 13, 14, 15, 10], SamplingParams())
    assert s.propose(8).tokens == [11, 12]  # a 1-token match earns at most 2 tokens


def test_mag_bigram_fallback_learns_across_sessions():
    d = MaGDrafter(min_ngram=2)
    d.open([5, 6, 5, 6, 7], SamplingParams())  # teaches 5 -> 6, 6 -> 5|7
    s = d.open([1, 5], SamplingParams())
    assert s.propose(1).tokens == [6]
    s2 = d.open([42], SamplingParams())
    assert s2.propose(4).tokens == []  # an unseen token: nothing worth sending


def test_bigram_table_stays_bounded_and_keeps_frequent_followers():
    from edgespec.drafters.mag import BigramTable

    t = BigramTable(max_leaders=4, max_followers=3)
    rng = np.random.default_rng(0)
    for _ in range(50):  # many sessions over a large vocabulary
        t.observe(rng.integers(0, 1000, 200).tolist())
        assert len(t) <= 4
        assert all(len(t.followers(a)) <= 3 for a in range(1000))
    t.observe([7, 8] * 20 + [7, 9, 7, 10, 7, 11, 7, 12])  # 7 -> 8 dominates, rare ones churn
    assert len(t) <= 4 and len(t.followers(7)) == 3
    assert t.best(7) == (8, 20 / 24)  # share counts every observation, evicted ones too
    for leader in range(100, 104):
        t.observe([leader, 1])
    assert t.best(7) == (None, 0.0)  # least recently used leader forgotten
    assert t.best(103) == (1, 1.0)
    d = MaGDrafter(max_bigram_leaders=2, max_bigram_followers=1)
    d.open(list(range(50)), SamplingParams())
    assert len(d.bigrams) == 2


def test_draft_length_schedule():
    k = DraftLength(k_max=8, k_init=3)
    assert k.update(3, 3) == 5
    assert k.update(5, 2) == 4
    assert k.update(0, 0) == 4
    fixed = DraftLength(k_max=8, adaptive=False)
    assert fixed.update(8, 0) == 8


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)])
def test_model_drafter_rollback_reproduces_the_same_draft(tiny, params):
    runner = TargetRunner(tiny.model, n_slots=2, max_len=128)
    drafter = build_drafter("layers:2", tiny, runner, n_slots=2, max_len=128)
    drafter.min_confidence = 0.0
    s = drafter.open([3, 40, 41, 42], params)
    first = s.propose(4)
    assert len(first) == 4 and s.tokens[4:] == first.tokens
    # sampled drafts are keyed by (seed, position) too: a rollback redraws the same tokens
    s.rollback(5)  # keep the first drafted token, redo the rest
    assert s.propose(3).tokens == first.tokens[1:]
    s.close()
    again = drafter.open([3, 40, 41, 42], params)
    assert again.propose(4).tokens == first.tokens  # a new session with the same seed
    again.close()


def test_drafter_specs_are_parsed_with_clear_errors(tiny, tiny_draft_dir, tmp_path):
    from conftest import make_tiny_model, make_tokenizer

    assert build_drafter("none") is None
    assert build_drafter("mag").name == "mag"
    with pytest.raises(ConfigError, match="unknown drafter"):
        build_drafter("bogus")
    with pytest.raises(ConfigError, match="integer"):
        build_drafter("layers:x", tiny)
    other = make_tiny_model(tmp_path / "other", tokenizer=make_tokenizer(extra="äöü"))
    with pytest.raises(ConfigError, match="different tokenizer"):
        build_drafter(f"model:{other}", tiny)
    with pytest.raises(ConfigError, match="not found"):
        build_drafter(f"model:{tmp_path / 'missing'}", tiny)
    assert build_drafter(f"model:{tiny_draft_dir}", tiny).name.startswith("model:")


def test_alpha_follows_acceptance_and_probes_come_back():
    from edgespec.drafters.adaptive import Prober

    k = DraftLength(k_max=4)
    assert k.alpha == 0.5  # the prior
    assert k.gains(3) == pytest.approx([0.5, 0.25, 0.125])  # alpha^m before any trial
    for _ in range(10):
        k.update(4, 0)  # every draft rejected at once
    low = k.alpha
    assert low < 0.05
    prober = Prober(8)
    probes = [prober.planned(0, 2) for _ in range(16)]
    assert probes.count(0) == 14 and probes.count(2) == 2  # a short probe every 8th step
    assert prober.planned(3, 2) == 3  # a planned draft goes through unchanged
    for _ in range(5):
        k.update(4, 4)
    assert k.alpha > 0.8 > low


def test_gains_see_drafts_right_in_runs():
    """A drafter right in runs (all of a draft or none of it, as MaG often is): a geometric
    alpha^m overrates its first token; the positions' own rates do not."""
    k = DraftLength(k_max=4)
    for i in range(60):
        k.update(4, 4 if i % 3 == 0 else 0)  # a third of drafts wholly right, the rest wrong
    gains = k.gains(4)
    assert k.alpha > 0.55  # accepted tokens per tested token: 4 in 6
    assert gains[0] == pytest.approx(1 / 3, abs=0.05)  # the first token: right once in 3
    assert gains[3] > 0.7 * gains[0] > k.alpha ** 4  # once right, right to the end
    assert all(a >= b for a, b in zip(gains, gains[1:]))


def test_gains_are_non_increasing_and_follow_where_drafts_break():
    k = DraftLength(k_max=6)
    for _ in range(40):
        k.update(6, 2)  # always the first two, never the third
    gains = k.gains(6)
    assert gains[0] > 0.9 and gains[1] > 0.8 and gains[2] < 0.2  # a prior of 2 trials of alpha
    assert all(a >= b for a, b in zip(gains, gains[1:]))
    assert len(k.gains(3)) == 3 and k.gains(0) == []


def test_a_model_drafter_may_run_in_a_dtype_a_target_may_not(tiny_draft_dir):
    """Drafts need not be exact: a model drafter loads and drafts in float16, which this CPU's
    probe refuses for a target (it is not batch-invariant here)."""
    from edgespec.config import ConfigError, SamplingParams
    from edgespec.runner.dtype_probe import exact_here
    from edgespec.models.loading import load_model

    d = build_drafter(f"model:{tiny_draft_dir}", dtype="float16")
    session = d.open([1, 10, 11, 12], SamplingParams())
    assert all(isinstance(t, int) for t in session.propose(3).tokens)
    session.close()
    if not exact_here("float16"):
        with pytest.raises(ConfigError, match="not batch-invariant"):
            load_model(str(tiny_draft_dir), dtype="float16")


def test_gains_weigh_the_tokens_a_draft_holds_when_taken():
    """A board slower than the steps: asked 4, its draft held 1 token in most steps. The 2nd
    to 4th tokens are worth what they are accepted times how often they are there."""
    k = DraftLength(k_max=4)
    for _ in range(40):
        k.update(4, 4)  # whatever is there is right
    assert k.gains(4)[3] > 0.9
    for i in range(40):
        k.supplied(4, 4 if i % 4 == 0 else 1)  # the whole draft in one take of 4
    gains = k.gains(4)
    assert gains[0] > 0.9  # the first token is always there
    assert gains[1] == pytest.approx(0.25, abs=0.12) and gains[3] <= gains[1]
    holds = k.holds(4)
    assert holds[0] == pytest.approx(1.0) and holds[1] == pytest.approx(gains[1], rel=0.1)
    k.supplied(0, 0)  # a step that asked nothing says nothing of the supply
    assert k.gains(4) == gains


def test_a_few_short_takes_do_not_cap_a_sessions_width_for_good():
    """Positions not asked for hold as the last one asked did: after a few takes that held 2
    of 6, takes of 2 that held 2 bring the positions past them back (they are never asked)."""
    k = DraftLength(k_max=6)
    for _ in range(4):
        k.supplied(6, 2)
    assert k.holds(6)[2] < 0.3
    for _ in range(60):
        k.supplied(2, 2)
    assert min(k.holds(6)) > 0.9


def test_a_sessions_token_array_follows_its_list_through_appends_and_rollbacks():
    """``TokenArray``: what was appended since the last read is copied; a rollback it is told of
    cuts it; a list changed behind its back (cut and refilled with other tokens) is read again
    whole; past its buffer it grows."""
    import random

    import numpy as np

    from edgespec.drafters.mag import TokenArray

    rng = random.Random(5)
    tokens = [rng.randrange(1000) for _ in range(40)]
    mirror = TokenArray()
    for step in range(400):
        action = rng.random()
        if action < 0.6:
            tokens.extend(rng.randrange(1000) for _ in range(rng.randint(1, 9)))
        elif action < 0.8:
            length = rng.randint(0, len(tokens))
            del tokens[length:]
            mirror.cut(length)
        elif tokens:  # behind its back: its tail replaced by other tokens, the length kept
            length = rng.randint(1, len(tokens))
            tail = [(t + 1) % 1000 for t in tokens[length - 1:]]
            del tokens[length - 1:]
            tokens.extend(tail)
        assert np.array_equal(mirror.of(tokens), np.asarray(tokens, dtype=np.int64)), step
    tokens.extend(range(600))  # past the first buffer: it grows, keeping what it mirrors
    assert np.array_equal(mirror.of(tokens), np.asarray(tokens, dtype=np.int64))


@pytest.mark.parametrize("scan", [0, 2, 16], ids=["together", "mixed", "one-by-one"])
def test_the_listed_suffix_match_follows_its_list_and_gives_the_arrays_answer(scan, monkeypatch):
    """``TokenPlaces`` keeps each token's positions through appends, rollbacks it is told of
    and changes behind its back; ``listed_suffix_match`` on it answers as
    ``longest_suffix_match`` on the array, whichever way its candidates are compared."""
    import random

    from edgespec.drafters import suffix_match
    from edgespec.drafters.suffix_match import TokenArray, TokenPlaces, listed_suffix_match

    monkeypatch.setattr(suffix_match, "SCAN_CANDIDATES", scan)
    rng = random.Random(11)
    tokens = [rng.randrange(4) for _ in range(10)]
    places, array = TokenPlaces(), TokenArray()
    for step in range(1500):
        action = rng.random()
        if action < 0.6:
            tokens.extend(rng.randrange(rng.choice([3, 6, 50])) for _ in range(rng.randint(1, 6)))
        elif action < 0.85:
            length = rng.randint(1, len(tokens))
            del tokens[length:]
            places.cut(length)
            array.cut(length)
        else:  # behind its back: its tail replaced by other tokens, the length kept
            length = rng.randint(1, len(tokens))
            tail = [t + 1 for t in tokens[length - 1:]]
            del tokens[length - 1:]
            tokens.extend(tail)
        index = places.of(tokens)
        asked = set(tokens) | set(range(60))  # and tokens it never held
        assert {t: index.places(t) for t in asked} == \
            {t: [i for i, u in enumerate(tokens) if u == t] for t in asked}
        assert set(index.last) == set(tokens)  # a token cut away is unlinked
        top, low = rng.randint(1, 9), 1
        low = rng.randint(1, top)
        want = longest_suffix_match(np.asarray(tokens, dtype=np.int64), top, low)
        assert listed_suffix_match(tokens, index, top, low, lambda: array.of(tokens)) == want, \
            (step, tokens, top, low)


def test_a_mag_sessions_drafts_follow_its_tokens_through_rollbacks(monkeypatch):
    """A MaG session's proposals, through proposals, appends, verified rollbacks and
    retractions, are the continuation of ``longest_suffix_match`` on its tokens as they are
    (its index of places and its array kept in step), with few candidates and many."""
    import random

    from edgespec.drafters import suffix_match

    rng = random.Random(2)
    for scan in (16, 2):
        monkeypatch.setattr(suffix_match, "SCAN_CANDIDATES", scan)
        d = MaGDrafter(tokens_per_match_token=3)
        s = d.open([rng.randrange(5) for _ in range(12)], SamplingParams())
        for step in range(600):
            action = rng.random()
            before = list(s.tokens)
            if action < 0.45:
                k = rng.randint(1, 6)
                n, p = longest_suffix_match(np.asarray(before, dtype=np.int64), d.max_ngram,
                                            d.min_ngram)
                got = s.propose(k).tokens
                if n:
                    assert got == before[p + n: p + n + min(k, 3 * n)], (step, before)
                assert s.tokens == before + got
            elif action < 0.7:
                s.append([rng.randrange(7) for _ in range(rng.randint(1, 4))])
            elif action < 0.85:
                s.rollback(rng.randint(1, len(s.tokens)))
            else:
                s.retract(rng.randint(1, len(s.tokens)))


def test_a_full_bigram_table_forgets_its_least_recently_used_leaders_a_batch_at_once():
    """A table that overflows forgets its least recently used leaders (a use: observed with a
    follower, or read), enough to make room for ``max_leaders // FORGET_SHARE`` more, so that
    it never holds more than ``max_leaders``."""
    from edgespec.drafters.mag import BigramTable

    t = BigramTable(max_leaders=64, max_followers=2)
    for leader in range(64):
        t.observe([leader, 1])
    assert t.best(0) == (1, 1.0) and t.chain(1, 1, 0.0) == [1]  # 0 and 1 used again
    t.observe([64, 1])  # a 65th leader: the five least recently used of the others go
    assert len(t) == 64 - 64 // BigramTable.FORGET_SHARE
    assert [a for a in range(65) if not t.followers(a)] == [2, 3, 4, 5, 6]
    for leader in range(100, 200):
        t.observe([leader, 2])
        assert len(t) <= 64
    assert t.best(199) == (2, 1.0) and t.best(3) == (None, 0.0)


def test_a_bigram_tables_best_follows_what_it_observes():
    """``best`` (kept by ``observe`` where plain, else found when read) is the most counted
    follower, the first of equals, and its share, after every observation, eviction and ties
    included, for leaders read often and seldom."""
    import random

    from edgespec.drafters.mag import BigramTable

    for seed, followers_at_most, reads in ((3, 3, 1), (4, 2, 8), (5, 4, 8), (6, 8, 3)):
        rng = random.Random(seed)
        table = BigramTable(max_leaders=6, max_followers=followers_at_most)
        for _ in range(800):
            table.observe([rng.randrange(8) for _ in range(rng.randint(2, 5))])
            for leader in rng.sample(range(8), reads):
                followers = table.followers(leader)
                if not followers:
                    assert table.best(leader) == (None, 0.0)
                    continue
                top = max(followers, key=followers.__getitem__)
                total = table._followers[leader].total
                assert table.best(leader) == (top, followers[top] / total)


def test_a_bigram_chain_is_best_read_token_by_token():
    """``chain`` (MaG's fallback) gives what ``best`` read follower after follower gives, cut
    before the first share below the bar, and leaves the leaders in the same least-recently-used
    order (the same leader forgotten next)."""
    import copy
    import random

    from edgespec.drafters.mag import BigramTable

    def by_best(table: BigramTable, token: int, k: int, bar: float) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            nxt, share = table.best(token)
            if nxt is None or share < bar:
                break
            out.append(nxt)
            token = nxt
        return out

    rng = random.Random(5)
    table = BigramTable(max_leaders=12, max_followers=3)
    for _ in range(300):
        table.observe([rng.randrange(16) for _ in range(rng.randint(2, 9))])
        twin = copy.deepcopy(table)
        token, k, bar = rng.randrange(18), rng.randint(0, 12), rng.choice([0.0, 0.3, 0.5, 0.7])
        assert table.chain(token, k, bar) == by_best(twin, token, k, bar)
        recency = [(a, e.used) for a, e in table._followers.items()]
        assert recency == [(a, e.used) for a, e in twin._followers.items()]  # the same uses
