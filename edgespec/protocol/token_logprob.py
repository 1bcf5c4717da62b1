"""A token's logprob as every part hands it on (``TokenLogprob``: the engine's ``Result``, a
ticket, the wire, the SDK), and the limit on its alternatives. Free of torch, as the SDK and a
board are; computed in ``edgespec.verify.token_logprobs``."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on ``top_logprobs``


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """An emitted token's log-probability under the target, and the ``top`` most likely
    tokens at its position, as (token id, log-probability), most likely first (ties: the
    lower id first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_top_logprobs(k: int | None, name: str = "logprobs") -> None:
    """Refuses (ConfigError, a ValueError) a ``logprobs`` setting (or the one ``name`` says)
    that is neither None nor an int in [0, MAX_TOP_LOGPROBS]: how many alternatives each
    token's logprob comes with."""
    if k is None:
        return
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
        unset = "" if name.startswith("--") else " or None"  # a flag is left out instead
        raise ConfigError(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}] (the "
                          f"alternatives a token gets){unset}, got {k!r}")
