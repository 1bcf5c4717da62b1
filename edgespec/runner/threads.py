"""The CPU thread policy of a process that runs a model: torch's intra-op threads, and what a
process without torch (a board running llama.cpp) reads for its own threads."""

from __future__ import annotations

import os

from ..config import ConfigError


def default_threads() -> int:
    """Torch intra-op threads when ``--threads`` is not given: all cores but one (at least one).

    A model-running process shares the machine with gRPC, Redis and drafter threads, and often
    with another model process; torch's default (a thread per core) then oversubscribes the
    cores. Measured here (2 cores, default model, ``generate --drafter mag``, 96 tokens):
    alone, 18.0 tok/s with 2 threads and 14.5 with 1; two generations at once, 4.8 + 4.8 tok/s
    with 2 threads each and 15.3 + 12.2 with 1 each. Giving up a core costs ~20% alone and wins
    ~3x under load, so the default leaves one core to the rest."""
    return max(1, (os.cpu_count() or 1) - 1)


_threads: int | None = None
_defaulted = False  # whether set_threads chose the count (none given: no --threads, no env)


def threads_in_use() -> int | None:
    """The count the last ``set_threads`` applied in this process, or None."""
    return _threads


def threads_defaulted() -> bool:
    """Whether torch's thread count in force is one ``set_threads`` chose (no ``--threads``,
    no ``$EDGESPEC_THREADS``) and no one changed since: such a default may be lowered where no
    dtype is batch-invariant at it (``dtype_probe.resolve_dtype``); a count the user gave, or
    set in torch themselves, never is."""
    if not _defaulted:
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.get_num_threads() == _threads


def fewer_threads(n: int) -> list[int]:
    """The counts a default of ``n`` threads steps down through, halving to 1: 7 -> [3, 1].
    A BLAS may split its products by the thread count, and one with fewer threads splits less
    (an AVX2 path's float32 products differed by the row count at 4 threads and more, agreed at
    1-3)."""
    out = []
    while n > 1:
        n //= 2
        out.append(max(1, n))
    return out


def set_threads(n: int | None, by_user: bool | None = None) -> int:
    """Apply the thread policy; returns the count in use. ``by_user``: whether ``n`` is the
    user's (default: whether it was given, or ``$EDGESPEC_THREADS`` set); a count derived from
    a placement (a verifier's cores) is a default too."""
    env = os.environ.get("EDGESPEC_THREADS") or ""
    given = n is not None or bool(env)
    if n is None:
        try:
            n = int(env) if env else default_threads()
        except ValueError:
            raise ConfigError(f"EDGESPEC_THREADS must be an integer, got {env[:20]!r}") from None
    if n < 1:
        raise ConfigError(f"--threads must be >= 1, got {n}")
    global _threads, _defaulted
    _threads = n  # what threads_in_use tells llama.cpp, which a board runs without torch
    _defaulted = not (given if by_user is None else by_user)
    try:
        import torch
    except ImportError:  # a core install (no model runs in torch here)
        return n
    torch.set_num_threads(n)
    return n
