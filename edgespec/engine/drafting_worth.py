"""Whether a batch's drafting pays, measured on whole steps: tokens a second while the drafters
draft against while they rest, at each batch size.

The draft planner (``draft_planner``) weighs the verification forward's fitted cost against
acceptance. What that fit does not see costs too: the steps' waits for drafts on their way, the
commits that send fixes, and, on a server whose cores its draft cache shares, the cache's work
receiving the drafts. Measured on a one-core server with eight MaG boards, the forward came out
even while the cache and its Redis spent 4.4 CPU s more of the same core and every step waited
12.4 ms: 0.93x serving alone. So the engine also times whole steps (take, forward and commit)
in two regimes, per batch size:

- *drafting*: the planner's choice each step (it may itself plan no draft, or probe);
- *resting*: no session asked for a draft and every drafter told to rest (``Commit.wanted``
  0: nothing drafted or pushed), the batch decoded as the server alone decodes it;

and rests a batch whose drafting measured fewer tokens a second than its resting did. The
choice is made in windows of the regime not chosen: ``SETTLE`` + ``MEASURE`` steps, whose first
``SETTLE`` are not counted (a board hears of a change with the step's commit, and rests or
catches up during the next steps); at its end the window's own steps are compared with the
chosen regime's last steps (a mean over ~10, ``DECAY``), so that both are measured at about the
same time: a server's steps slow down as its sessions' contexts grow (measured: 27 to 16 tokens
a second over a 485-step run), and a rate measured a hundred steps ago is not comparable. The
other regime is chosen only for a rate ``SWITCH_MARGIN`` above the chosen one's, and no window
starts at a batch size where the chosen regime has no steps measured yet (it would learn
nothing). Windows come as
rarely as they keep agreeing with the choice (the interval doubles each time, back to
``FIRST_EXPLORE`` when the choice flips). Drafting whose rate is ``CLEAR_WIN`` times resting's
(before resting was measured, the forward fit's rate for one-token rows) is not rested to
check: waits and handling have not cost that much anywhere measured. Only speed depends on
this, never output: a rested session decodes one token a step, as target-only does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

DRAFT, REST = "draft", "rest"
SETTLE = 3  # steps after a change of regime that are not counted
MEASURE = 6  # steps counted in a window of the regime not chosen
FIRST_EXPLORE = 32  # steps before the first window, and between windows after a flip
MAX_INTERVAL = 512
DECAY = 0.9  # a regime's rate: each counted step weighs 1, older ones decay by this
MIN_WEIGHT = 2.0  # decayed steps a regime needs before its rate is read
CLEAR_WIN = 1.25
SWITCH_MARGIN = 0.05  # the regime not chosen must measure this much faster to be chosen


@dataclass
class RegimeRate:
    """A regime's recent steps at one batch size: tokens committed and seconds, decayed."""

    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0

    def add(self, tokens: float, seconds: float) -> None:
        self.tokens = DECAY * self.tokens + tokens
        self.seconds = DECAY * self.seconds + seconds
        self.weight = DECAY * self.weight + 1.0

    @property
    def rate(self) -> float | None:
        """Tokens a second, or None before ``MIN_WEIGHT`` steps."""
        if self.weight < MIN_WEIGHT or self.seconds <= 0:
            return None
        return self.tokens / self.seconds


@dataclass
class BatchRates:
    """Both regimes' rates at one batch size."""

    draft: RegimeRate = field(default_factory=RegimeRate)
    rest: RegimeRate = field(default_factory=RegimeRate)

    def of(self, regime: str) -> RegimeRate:
        return self.draft if regime == DRAFT else self.rest

    def restart(self, regime: str) -> None:
        """Forget ``regime``'s steps: a window of it counts its own alone."""
        if regime == DRAFT:
            self.draft = RegimeRate()
        else:
            self.rest = RegimeRate()

    def preferred(self, current: str) -> str | None:
        """The regime measured faster, ``current`` unless the other measured ``SWITCH_MARGIN``
        faster; None until both are measured."""
        d, r = self.draft.rate, self.rest.rate
        if d is None or r is None:
            return None
        if current == DRAFT:
            return REST if r > (1 + SWITCH_MARGIN) * d else DRAFT
        return DRAFT if d > (1 + SWITCH_MARGIN) * r else REST


def _fmt(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.2f}"


def _other(regime: str) -> str:
    return REST if regime == DRAFT else DRAFT


class DraftingWorth:
    """The regime of each step (``choose``) from the steps measured (``observe``)."""

    def __init__(self) -> None:
        self.rates: dict[int, BatchRates] = {}  # by rows in the step (at most the KV slots)
        self.regime = DRAFT  # the regime of the step last chosen
        self.run = 0  # steps of that regime in a row, that one included
        self.interval = FIRST_EXPLORE
        self.windows = 0  # windows of the regime not chosen, started so far
        self.rested = 0  # steps chosen to rest so far
        self._left = 0  # steps left of the window under way (0: none)
        self._since = 0  # steps since the last window ended
        self._before: str | None = None  # the choice when the window under way began
        self._window_rows = 0  # the rows of the step last chosen
        self.choices: dict[int, str] = {}  # each batch size's regime, as its last window chose

    def preferred(self, rows: int) -> str:
        """The regime the last window at ``rows`` sessions chose, or at the nearest batch size
        where a window chose; drafting until then."""
        own = self.choices.get(rows)
        if own is not None:
            return own
        if not self.choices:
            return DRAFT
        return self.choices[min(self.choices, key=lambda n: (abs(n - rows), n))]

    def choose(self, rows: int, plain_rate: float | None) -> str:
        """The regime of the next step of ``rows`` sessions. ``plain_rate``: the forward fit's
        tokens a second for a step of ``rows`` one-token rows (None: not fitted yet)."""
        if self._left:
            self._left -= 1
            regime = self.regime  # the window's
        else:
            if self._before is not None:  # a window just ended: its steps against the choice's
                self._judge_window(self._window_rows)
            preferred = self.preferred(rows)
            self._since += 1
            regime = preferred
            if self._since >= self.interval and self._worth_checking(rows, preferred,
                                                                     plain_rate):
                regime, self._before = _other(preferred), preferred
                self._left, self._since = SETTLE + MEASURE - 1, 0
                self.windows += 1
                self.rates.setdefault(rows, BatchRates()).restart(regime)
        self.run = self.run + 1 if regime == self.regime else 1
        self.regime = regime
        self._window_rows = rows
        self.rested += regime == REST
        return regime

    def next_regime(self, rows: int) -> str | None:
        """The regime ``choose`` would give the next step of ``rows`` sessions as things stand,
        without choosing it; None where a window ends then (its judging, by the steps' measures
        still to come, decides). A guess for what runs before that step is planned (a decode
        step launched ahead while resting): the measures observed meanwhile may still start a
        window."""
        if self._left:
            return self.regime  # the window's
        if self._before is not None:
            return None
        preferred = self.preferred(rows)
        if self._since + 1 >= self.interval and self._worth_checking(rows, preferred, None):
            return _other(preferred)
        return preferred

    def _judge_window(self, rows: int) -> None:
        """The window that just ended, at ``rows`` sessions: its regime chosen there if it
        measured ``SWITCH_MARGIN`` faster than the chosen one's last steps; the interval to the
        next window doubled if the choice stands, back to ``FIRST_EXPLORE`` if it flipped."""
        before, self._before = self._before, None
        assert before is not None
        batch = self.rates.get(rows)
        choice = None if batch is None else batch.preferred(before)
        if batch is None or choice is None:  # one not measured at this batch size: nothing learnt
            return
        self.choices[rows] = choice
        self.interval = min(MAX_INTERVAL, 2 * self.interval) if choice == before else \
            FIRST_EXPLORE
        log.info("drafting worth at %d session(s), a window measured: drafting %s, resting %s "
                 "tokens a second: %s (the next window in %d steps)", rows,
                 _fmt(batch.draft.rate), _fmt(batch.rest.rate), choice, self.interval)

    def _worth_checking(self, rows: int, preferred: str, plain_rate: float | None) -> bool:
        """Whether the regime not chosen may be better: not before the chosen one has steps
        measured at this batch size (a window would have nothing to be compared with, and its
        steps of the other regime would be spent for nothing: it waits until the chosen regime
        is measured here); not when drafting clearly pays, by ``CLEAR_WIN`` over resting as
        measured at this batch size, or before that over the forward fit's ``plain_rate``."""
        batch = self.rates.get(rows)
        chosen = None if batch is None else batch.of(preferred).rate
        if batch is None or chosen is None:
            return False
        if preferred == REST:
            return True
        against = batch.rest.rate if batch.rest.rate is not None else plain_rate
        return against is None or chosen < CLEAR_WIN * against

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """The step last chosen verified ``rows`` sessions and committed ``tokens`` in
        ``seconds`` (its take, forward and commit); its first ``SETTLE`` steps not counted."""
        if self.run <= SETTLE or rows <= 0 or seconds <= 0:
            return
        self.rates.setdefault(rows, BatchRates()).of(self.regime).add(tokens, seconds)
