"""The CPU thread policy of a process that runs a model: torch's intra-op threads, and what a
process without torch (a board running llama.cpp) reads for its own threads."""

from __future__ import annotations

import os
import sys

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
# whether the count in force is a default set_threads chose (no --threads, no env) that no
# resolved dtype has settled yet: such a count may still be lowered (``thread_step_down``)
_adjustable = False


def threads_in_use() -> int | None:
    """The count the last ``set_threads`` applied in this process, or None."""
    return _threads


def threads_adjustable() -> bool:
    """Whether torch's thread count in force may still be lowered: a default ``set_threads``
    chose (no ``--threads``, no ``$EDGESPEC_THREADS``), which no one changed since and at which
    no dtype was resolved yet (``settle_threads``). A count the user gave, set in torch
    themselves, or already serving a model never is."""
    if not _adjustable:
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.get_num_threads() == _threads


def settle_threads() -> None:
    """The count in force serves a model now (a dtype was resolved at it): never lowered
    after this, so that a runner built at it keeps running at the count its kernels were
    probed at."""
    global _adjustable
    _adjustable = False


def fewer_threads(n: int) -> list[int]:
    """The counts a default of ``n`` threads is first tried at on the way down, halving to 1:
    7 -> [3, 1] (``thread_step_down`` then looks between the first that passes and the last
    that failed). A BLAS may split its products by the thread count, and one with fewer threads
    splits less (an AVX2 path's float32 products differed by the row count at 4 threads and
    more, agreed at 1-3)."""
    out = []
    while n > 1:
        n //= 2
        out.append(n)
    return out


def set_threads(n: int | None, by_user: bool | None = None, torch_too: bool = True) -> int:
    """Apply the thread policy; returns the count in use. ``by_user``: whether ``n`` is the
    user's (default: whether it was given, or ``$EDGESPEC_THREADS`` set); a count derived from
    a placement (a verifier's cores) is a default too. ``torch_too``: whether this process
    runs a model in torch; a drafter of MaG, Cacheback or llama.cpp does not, and then torch's
    count is set only where torch is already imported (importing it for the count alone was
    about 2 s of such a drafter's start where torch is installed)."""
    env = os.environ.get("EDGESPEC_THREADS") or ""
    given = n is not None or bool(env)
    if n is None:
        try:
            n = int(env) if env else default_threads()
        except ValueError:
            raise ConfigError(f"EDGESPEC_THREADS must be an integer, got {env[:20]!r}") from None
    if n < 1:
        raise ConfigError(f"--threads must be >= 1, got {n}")
    global _threads, _adjustable
    _threads = n  # what threads_in_use tells llama.cpp, which a board runs without torch
    _adjustable = not (given if by_user is None else by_user)
    if not torch_too and "torch" not in sys.modules:
        return n
    try:
        import torch
    except ImportError:  # a core install (no model runs in torch here)
        return n
    torch.set_num_threads(n)
    return n
