"""A session's figures (``edgespec.protocol.request_stats.Stats``): the per-position counts,
kept a step at a time as a histogram and settled when the session ends, are what counting each
accepted position at each step gives; a session's result holds them settled, equal to its
steps' reports; another version's pickle still reads."""

from __future__ import annotations

import pickle
import random

from edgespec.config import EngineConfig
from edgespec.drafters.mag import MaGDrafter
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.protocol.request_stats import Stats
from edgespec.runner.target_runner import TargetRunner


def _counted_each_step(steps: list[tuple[int, int]]) -> list[int]:
    """The per-position counts as a step-by-step count gives them: the list grown to each
    draft's length, one added at each position a draft's accepted tokens reach."""
    per_pos: list[int] = []
    for drafted, accepted in steps:
        if drafted:
            per_pos.extend([0] * (drafted - len(per_pos)))
            for i in range(accepted):
                per_pos[i] += 1
    return per_pos


def test_settled_counts_are_each_steps_count_whenever_settled():
    rng = random.Random(4)
    for trial in range(200):
        steps = []
        for _ in range(rng.randint(0, 40)):
            drafted = rng.choice([0, rng.randint(1, 20)])
            steps.append((drafted, rng.randint(0, drafted)))
        stats = Stats()
        settle_at = set(rng.sample(range(len(steps) + 1), min(len(steps) + 1,
                                                              rng.randint(0, 3))))
        for i, (drafted, accepted) in enumerate(steps):
            if i in settle_at:  # settling midway changes nothing of the end's counts
                stats.settle()
            stats.record_step(drafted, accepted)
        stats.settle()
        assert stats.accepted_per_pos == _counted_each_step(steps), (trial, steps)
        assert stats.num_drafts == sum(1 for d, _ in steps if d)
        assert stats.accepted_tokens == sum(a for _, a in steps)
        stats.settle()  # twice: nothing counted again
        assert stats.accepted_per_pos == _counted_each_step(steps)
        assert stats.to_dict()["accepted_per_pos"] == _counted_each_step(steps)


def test_to_dict_settles_what_was_recorded():
    stats = Stats()
    stats.record_step(5, 3)
    stats.record_step(2, 2)
    assert stats.to_dict()["accepted_per_pos"] == [2, 2, 1, 0, 0]


def test_a_sessions_result_holds_its_steps_reports_counts(looping):
    """What the engine's result says per position is what its steps reported, summed: settled
    when the session ended, not left in the histogram."""
    runner = TargetRunner(looping.model, n_slots=2, max_len=256)
    cfg = EngineConfig(max_draft=4, window=8, chunk=2, adaptive=False, draft_wait_ms=5000)
    with SpecEngine(runner, MaGDrafter(), cfg, stop_ids=set()) as engine:
        done = []
        act = engine.add(Request([1, 10, 11, 12, 13, 10, 11, 12, 13, 10], 40))
        act.on_finish = done.append
        summed: list[int] = []
        while not done:
            report = engine.step()
            if report is None:
                continue
            summed.extend([0] * (len(report.accepted_per_pos) - len(summed)))
            for i, n in enumerate(report.accepted_per_pos):
                summed[i] += n
    stats = done[0].stats
    assert stats.accepted_tokens > 0  # drafts were verified
    assert stats.accepted_per_pos[:len(summed)] == summed
    assert not any(stats.accepted_per_pos[len(summed):])  # positions no draft's accepted reach
    assert len(stats.accepted_per_pos) == 4  # as long as the longest draft


def test_another_versions_pickled_stats_read_and_settle():
    """Stats an older replica pickled (no histogram of unsettled steps: it counted each step)
    are read whole and settle to what they hold."""
    old = Stats(steps=3, num_drafts=2, draft_tokens=8, accepted_tokens=5,
                accepted_per_pos=[2, 2, 1, 0])
    state = {k: v for k, v in old.__dict__.items() if not k.startswith("_")}
    got = pickle.loads(pickle.dumps(_Pickled(state)))
    assert isinstance(got, Stats)
    assert got.to_dict()["accepted_per_pos"] == [2, 2, 1, 0]
    assert got == old


class _Pickled:
    """An object that pickles as a ``Stats`` with ``state`` (another version's fields)."""

    def __init__(self, state: dict):
        self.state = state

    def __reduce__(self):
        import copyreg

        return copyreg._reconstructor, (Stats, object, None), self.state
