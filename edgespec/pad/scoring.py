"""Scoring an answer to a problem with an exact reference answer, by a rule named on the command
line: ``exact``, ``number`` or ``regex:PATTERN``.

- ``exact``: the response, normalised (case, surrounding space and quotes, a final period),
  equals the answer normalised the same way;
- ``number``: the last number in the response equals the answer's number (``1,200`` reads as
  1200; ``3.0`` equals ``3``);
- ``regex:PATTERN``: the first match of PATTERN in the response (its first group if it has
  one), normalised, equals the answer normalised; no match is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..config import ConfigError

SCORERS = ("exact", "number", "regex:PATTERN")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalise(text: str) -> str:
    """Lower case, inner space collapsed, surrounding space, quotes and a final period gone."""
    t = " ".join(text.lower().split()).strip(" \"'`*")
    return t[:-1].rstrip() if t.endswith(".") else t


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (thousands commas allowed), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


@dataclass(frozen=True)
class Scorer:
    """A rule saying whether a response answers a problem correctly."""

    kind: str  # "exact", "number" or "regex"
    pattern: str = ""  # the regex of kind "regex"

    @classmethod
    def parse(cls, spec: str) -> "Scorer":
        """From its command-line name; ConfigError on anything else."""
        if spec in ("exact", "number"):
            return cls(spec)
        if spec.startswith("regex:") and spec != "regex:":
            pattern = spec.removeprefix("regex:")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"scorer {spec!r}: not a valid regular expression ({e})") \
                    from None
            return cls("regex", pattern)
        raise ConfigError(f"unknown scorer {spec!r}: give one of {', '.join(SCORERS)}")

    @property
    def name(self) -> str:
        return f"regex:{self.pattern}" if self.kind == "regex" else self.kind

    def correct(self, response: str, answer: str) -> bool:
        if self.kind == "number":
            got, want = last_number(response), last_number(answer)
            return got is not None and want is not None and abs(got - want) < 1e-9
        if self.kind == "regex":
            m = re.search(self.pattern, response)
            if m is None:
                return False
            return normalise(m.group(1) if m.groups() else m.group(0)) == normalise(answer)
        return normalise(response) == normalise(answer)
