"""``frozen_value``: a dataclass that the type checker holds frozen and that is built at the
cost of a plain one.

The step's values (a session's row, its verdict, its decision, its commit's outcome, what the
step asks of its draft) are made once per session and step, then read, never edited. As frozen
dataclasses they were slow to build: on CPython 3.11 a frozen dataclass's ``__init__`` sets
each field through ``object.__setattr__``, and a nine-field ``Verdict`` took 2.2 us against
0.55 us for the same dataclass unfrozen; a step of 64 sessions builds about eight such values a
session (``edgespec bench-host``: ~7 us of a session-step). So a ``frozen_value`` class is a
plain dataclass at run time (equality, a hash of its fields as a frozen one has, repr,
``dataclasses.replace``; slotted, so it is built without an instance dict: 0.6% of
bench-host's instructions a session-step, docs/measured/fleet-host/instructions), and a frozen
one to mypy (``dataclass_transform(frozen_default=True)``): an assignment to a field anywhere in
the checked packages is a type error, caught where CI runs mypy, not by an exception at run
time; an attribute that is not a field cannot be set at all.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, TypeVar

T = TypeVar("T")

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # Python 3.10: the marker is only the type checker's, which runs on 3.11 or newer
    def dataclass_transform(**_: Any) -> Callable[[T], T]:
        return lambda decorated: decorated


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def frozen_value(cls: type[T]) -> type[T]:
    """``cls`` as a dataclass with a hash of its fields, frozen to the type checker."""
    return dataclasses.dataclass(eq=True, unsafe_hash=True, slots=True)(cls)
