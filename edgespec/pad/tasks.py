"""Problems with exact answers, for labelling pivots: generated task families and a user's JSONL.

A family writes short problems from a seeded ``random.Random`` (the same seed, the same problems,
in the same order). Every problem belongs to one split by a hash of its prompt text alone, never
by the seed: about a quarter of all possible prompts are ``test`` and the rest ``train``, so the
test split is disjoint from the train split whatever seeds made them, and labels (made from
``train``) never see a test prompt. A user's file is split by the same rule.

Families (each tuned so that SmolLM2-135M-Instruct, greedy, is right on 30-90% of them):

- ``arith``: one addition or subtraction of small numbers; scored ``number``;
- ``convert``: a unit conversion with its factor given (metres to centimetres, hours to
  minutes ...);
  scored ``number``;
- ``extract``: one named numeric field of a templated record; scored ``number``;
- ``choice``: which of two objects a two-sentence passage gives a person; scored ``regex``: the
  first object the answer names.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from ..config import ConfigError
from ..jsonl_file import jsonl_rows
from .scoring import Scorer

SPLITS = ("train", "test")
TEST_SHARE = 4  # one prompt in this many is a test prompt


@dataclass(frozen=True)
class Problem:
    prompt: str  # the user message (the chat template is applied when encoding)
    answer: str  # the reference answer the scorer compares with


@dataclass(frozen=True)
class TaskSet:
    """Problems of one source, the scorer that judges them, and where they came from."""

    name: str  # a family name, or the file's path
    scorer: Scorer
    problems: list[Problem]


def split_of(prompt: str) -> str:
    """``test`` for about one prompt in TEST_SHARE (by a hash of the text), else ``train``."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return "test" if int.from_bytes(digest[:4], "big") % TEST_SHARE == 0 else "train"


def _arith(rng: random.Random) -> Problem:
    a, b = rng.randint(1, 30), rng.randint(1, 9)
    return Problem(f"What is {a} + {b}? Reply with the number only.", str(a + b))


_UNITS = [("metre", "centimetres", 100), ("kilometre", "metres", 1000),
          ("centimetre", "millimetres", 10), ("kilogram", "grams", 1000),
          ("gram", "milligrams", 1000), ("litre", "millilitres", 1000),
          ("hour", "minutes", 60), ("minute", "seconds", 60)]
_ASK = ["How many {small} are in {n} {big}s?", "Convert {n} {big}s to {small}.",
        "What is {n} {big}s in {small}?"]


def _convert(rng: random.Random) -> Problem:
    big, small, factor = rng.choice(_UNITS)
    n = rng.randint(2, 9)
    ask = rng.choice(_ASK).format(small=small, n=n, big=big)
    return Problem(f"One {big} is {factor} {small}. {ask} Reply with the number only.",
                   str(n * factor))


_NAMES = ["Anna", "Ben", "Carla", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas"]
_FIELDS = ["age", "room", "floor", "seat", "badge"]


def _extract(rng: random.Random) -> Problem:
    fields = rng.sample(_FIELDS, 3)
    values = [rng.randint(2, 99) for _ in fields]
    asked = rng.randrange(3)
    record = ", ".join(f"{f} {v}" for f, v in zip(fields, values))
    return Problem(f"Record: name {rng.choice(_NAMES)}, {record}. What is the {fields[asked]}? "
                   "Reply with the number only.", str(values[asked]))


_OBJECTS = ["ball", "kite", "book", "drum", "lamp", "cup", "hat", "bike"]


def _choice(rng: random.Random) -> Problem:
    a, b = rng.sample(_NAMES, 2)
    x, y = rng.sample(_OBJECTS, 2)
    who, owned = (a, x) if rng.random() < 0.5 else (b, y)
    return Problem(f"{a} has a {x}. {b} has a {y}. What does {who} have? Reply with one word.",
                   owned)


FAMILIES: dict[str, tuple[Callable[[random.Random], Problem], str]] = {
    "arith": (_arith, "number"), "convert": (_convert, "number"),
    "extract": (_extract, "number"),
    "choice": (_choice, r"regex:\b(" + "|".join(_OBJECTS) + r")\b"),
}


def family_problems(name: str, split: str, n: int, seed: int = 0) -> TaskSet:
    """The first ``n`` distinct problems of family ``name`` in ``split`` from ``seed``."""
    if name not in FAMILIES:
        raise ConfigError(f"unknown task {name!r}: give one of {', '.join(FAMILIES)}")
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    make, scorer = FAMILIES[name]
    rng = random.Random(f"{name}:{seed}")
    seen: set[str] = set()
    out: list[Problem] = []
    for _ in range(200 * n + 1000):
        if len(out) == n:
            break
        p = make(rng)
        if p.prompt not in seen and split_of(p.prompt) == split:
            seen.add(p.prompt)
            out.append(p)
    if len(out) < n:
        raise ConfigError(f"task {name!r} has only {len(out)} distinct {split} problems")
    return TaskSet(name, Scorer.parse(scorer), out)


def file_problems(path: str, scorer: str, split: str) -> TaskSet:
    """A JSONL file's problems ({"prompt": TEXT, "answer": TEXT} a line) in ``split``."""
    out = []
    for n, row in jsonl_rows(path, "the tasks file"):
        if not (isinstance(row, dict) and isinstance(row.get("prompt"), str)
                and isinstance(row.get("answer"), (str, int, float))):
            raise ConfigError(f'{path}:{n}: a line needs "prompt" (text) and "answer"')
        if split_of(row["prompt"]) == split:
            out.append(Problem(row["prompt"], str(row["answer"])))
    return TaskSet(path, Scorer.parse(scorer), out)
