"""How big a drafting loop's chunks are, and what the loop counts.

A chunk is useful only if it reaches the cache before the verifier's step takes the session's
draft. A board that drafts one token per model forward (llama.cpp, a model drafter) and serves
several sessions may need longer for a whole chunk than the verifier needs for a step; its
chunk then lands after the step, which decoded the session without it. ``ChunkPace`` sizes
chunks from two things the loop sees: the verifier's step interval (how often a session's
committed end moves, an exponentially weighted average) and the drafter's own cost, fixed per
chunk and per token (fitted on its recent jobs). A round of chunks, one for each session the loop
drafts for, may take ``MARGIN`` of a step; a chunk is never shorter than one token nor longer than
the channel's chunk. A drafter far faster than the verifier (MaG, Cacheback) always gets the
channel's chunk.

``LoopCounts`` are the loop's counters (read by a board's metrics at scrape time), among them the
time from a commit to the session's next usable draft, stage by stage.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

WEIGHT = 0.2  # weight of a new step interval in its average
DECAY = 0.9  # a drafting job's weight in the fit, one job later
PRIOR_WEIGHT = 2.0  # jobs' worth of weight on the prior slope (mean seconds per token)
MARGIN = 0.7  # the share of a verifier step one round of chunks may take


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - WEIGHT) * old + WEIGHT * new


class ChunkPace:
    """The verifier's step interval and the drafter's speed, as the loop sees them.

    A drafting job's seconds ~ ``fixed + per_token * tokens``, least squares over recent jobs
    (older ones decay by ``DECAY`` a job). Until the chunk sizes seen vary, the slope is the
    mean seconds per token (all of a job's time taken as per-token time); a drafter whose
    chunks take as long whatever their size (its time is fixed per chunk) shows it as soon as
    two sizes were tried, and then keeps its full chunks."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # False: every chunk is the channel's chunk
        self.step_s: float | None = None  # seconds between a session's commits
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0
        # the prior's weight decays as the jobs' do: evidence from two chunk sizes keeps its
        # share against it however many equal-size jobs follow
        self._prior = PRIOR_WEIGHT
        self._last: tuple[float, float] | None = None

    def step_seen(self, seconds: float) -> None:
        """A session's committed end moved ``seconds`` after it last moved."""
        if seconds > 0:
            self.step_s = _average(self.step_s, seconds)

    def drafted(self, seconds: float, tokens: int) -> None:
        """A drafting job took ``seconds`` for ``tokens`` tokens (an empty one counts as
        one: it cost a look-up all the same)."""
        x, y = float(max(1, tokens)), max(0.0, seconds)
        self._prior *= DECAY
        self._n = DECAY * self._n + 1
        self._sx = DECAY * self._sx + x
        self._sy = DECAY * self._sy + y
        self._sxx = DECAY * self._sxx + x * x
        self._sxy = DECAY * self._sxy + x * y

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_token) seconds of a drafting job, or None before the first."""
        if self._n <= 0:
            return None
        mx, my = self._sx / self._n, self._sy / self._n
        var = max(0.0, self._sxx / self._n - mx * mx)
        cov = self._sxy / self._n - mx * my
        w = self._prior / self._n  # the prior weighs as much as PRIOR_WEIGHT jobs once did
        if var + w < 1e-12:  # both decayed away (thousands of equal jobs): keep the last fit
            return self._last or (0.0, my / mx)
        slope = max(0.0, (cov + w * my / mx) / (var + w))
        self._last = (max(0.0, my - slope * mx), slope)
        return self._last

    @property
    def token_s(self) -> float | None:
        """Seconds per drafted token (None before the first job)."""
        fit = self.fit()
        return None if fit is None else fit[1]

    def chunk(self, most: int, sessions: int) -> int:
        """Tokens for the next chunk, at most ``most``: as many as land, one chunk for each of
        ``sessions`` sessions, within MARGIN of a step. When not even one token would (the
        drafter is slower than the verifier, or its time is fixed per chunk), ``most``: a
        longer chunk keeps more of itself across the fixes that overtake it."""
        fit = self.fit()
        if not self.enabled or self.step_s is None or fit is None:
            return most
        fixed, per_token = fit
        budget = MARGIN * self.step_s / max(1, sessions)
        if fixed + per_token > budget:
            return most
        if per_token <= 0:
            return most
        return max(1, min(most, int((budget - fixed) / per_token)))


@dataclass
class LoopCounts:
    """A drafting loop's counters, updated under the channel's lock."""

    chunks_drafted: int = 0  # drafting jobs that drafted at least one token
    tokens_drafted: int = 0
    chunks_sent: int = 0  # chunks handed to the transport, held tokens sent again included
    tokens_sent: int = 0
    chunks_resent: int = 0  # chunks of held tokens (kept across a fix) sent again
    tokens_kept: int = 0  # drafted tokens a fix agreed with (kept, not drafted again)
    tokens_discarded: int = 0  # drafted tokens not yet in the cache that a fix disagreed with
    # drafted chunks never handed on, by why: "disagreed" (a fix threw their tokens away),
    # "closed" (the session ended meanwhile), "failed" (drafting or handing on failed)
    dropped: Counter = field(default_factory=Counter)
    # from a commit to the session's next usable draft (a chunk handed on that covers the new
    # committed end): moves of the committed end seen (commits and fixes); those the tokens
    # already sent under the same epoch reached past (usable at once: drafted ahead); those a
    # later chunk served, and their seconds from the move: in all, waiting for the chunk's job
    # to start, and drafting it (the rest is handing it on). A move another overtook before
    # it was served counts in ``commits_seen`` only.
    commits_seen: int = 0
    commits_ahead: int = 0
    commits_served: int = 0
    served_s: float = 0.0
    queued_s: float = 0.0
    drafting_s: float = 0.0
