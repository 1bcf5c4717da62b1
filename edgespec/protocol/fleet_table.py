"""The fleet-wide Cacheback table's contract, shared by the cache (which holds it in Redis and
records every finished session into it), drafters (which pull it in the background) and the
in-process engine.

An entry maps a *leader* n-gram (1 to ``MAX_ORDER`` token ids) to its recent *followers*, most
recent first. ``ngram_pairs`` turns a run of tokens into the (leader, follower) observations
that update a table; every table, local or in Redis, learns from the same pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol

ORDERS = (3, 2, 1)  # leader lengths, longest first: a longer leader is better evidence
MAX_ORDER = max(ORDERS)
MAX_FOLLOWERS = 4


@dataclass(frozen=True)
class FleetEntry:
    leader: tuple[int, ...]
    followers: tuple[int, ...]  # most recent first


@dataclass
class FleetPull:
    """One piece of a table's changes: entries updated after ``since``."""

    entries: list[FleetEntry] = field(default_factory=list)
    version: int = 0  # pass as ``since`` next time
    more: bool = False  # more changes wait: pull again at once


class FleetTable(Protocol):
    def record(self, tokens: list[int], start: int = 0) -> None:
        """Learn the pairs whose follower is ``tokens[i]`` for i >= start (earlier tokens serve
        as leaders only). Never raises: a table that cannot be reached loses the update."""

    def pull(self, since: int, limit: int = 2048) -> FleetPull:
        """The entries changed after version ``since``, oldest change first, at most ``limit``.
        A version below ``since`` with no entries means the table started over."""


def record_output(table: FleetTable, tokens: list[int], prompt_len: int) -> None:
    """Teach ``table`` a session's output: ``tokens`` is prompt + output; the pairs whose
    follower is an output token are recorded, the prompt's last tokens serving as leaders."""
    start = max(0, prompt_len - MAX_ORDER)
    table.record(tokens[start:], prompt_len - start)


def ngram_pairs(tokens: list[int], start: int = 0, orders: tuple[int, ...] = ORDERS
                ) -> Iterator[tuple[tuple[int, ...], int]]:
    """(leader, follower) for every follower tokens[i], i >= max(start, 1), and every order n
    with n tokens before it."""
    for i in range(max(start, 1), len(tokens)):
        follower = tokens[i]
        for n in orders:
            if i >= n:
                yield tuple(tokens[i - n:i]), follower
