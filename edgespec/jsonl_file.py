"""A JSONL file a user hands a command (a tasks file, a prompt file), read line by line: the
file unreadable or a line not JSON is a ``ConfigError`` that names it; blank lines are skipped.
What each line must hold is the caller's to check."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from .config import ConfigError


def jsonl_rows(path: str, what: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line of ``path``; ``what`` names the file
    in the error where it cannot be read ("the tasks file")."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"cannot read {what} {path}: not UTF-8 text (byte {e.start})") \
            from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"{path}:{n}: not a JSON object") from None
