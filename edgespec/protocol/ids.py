"""Strict formats for the ids that end up inside Redis keys and log lines.

Device ids name a drafter (``--device-id``): 1-64 characters, letters, digits, ``.``, ``_`` and
``-``, starting with a letter or digit. Session ids are made by the verifier (16-32 lowercase hex
characters); any 1-64 characters of letters, digits, ``_`` and ``-`` are accepted. Neither may hold
``:``, the separator of the store's key names, so an id can never address another key.

A refusal raises ``ConfigError`` whose message shows at most ``SHOWN`` characters of the bad value
(escaped): a huge id echoed into a gRPC status would make the caller see RESOURCE_EXHAUSTED
instead of the real refusal.
"""

from __future__ import annotations

import re

from ..config import ConfigError

MAX_ID_LEN = 64
SHOWN = 40

_DEVICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def shown(value, limit: int = SHOWN) -> str:
    """A short, ASCII-only rendering of a possibly hostile value for error messages."""
    text = value if isinstance(value, str) else repr(value)
    cut = text[:limit]
    return ascii(cut) + (f"... ({len(text)} characters)" if len(text) > limit else "")


def _check(value, pattern: re.Pattern, what: str, rule: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_ID_LEN or not pattern.fullmatch(value):
        raise ConfigError(f"invalid {what} {shown(value)}: {rule}")
    return value


def check_device_id(value) -> str:
    """``value`` if it is a well-formed device id, else ConfigError."""
    return _check(value, _DEVICE_ID, "device id",
                  "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")


def check_session_id(value) -> str:
    """``value`` if it is a well-formed session id, else ConfigError."""
    return _check(value, _SESSION_ID, "session id", "use 1-64 letters, digits, '_' or '-'")
