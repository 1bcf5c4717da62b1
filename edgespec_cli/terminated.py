"""SIGTERM as an exception, for the commands: ``Terminated`` is raised in the main thread as
KeyboardInterrupt is for SIGINT, so that a command's ``finally`` blocks and context managers run
(an embedded Redis stopped and its folder removed, Ray shut down, the processes a benchmark
started stopped) before ``main`` answers 143. Python's default ended the process on the spot.

A command with a handler of its own (a server's drain, a drafter's clean stop) replaces it for
as long as that is set; a library that sets one (``ray.init`` installs a handler that calls
``sys.exit``) is undone around the call (``keeping_sigterm``)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

STATUS = 128 + signal.SIGTERM  # what a shell shows for a process SIGTERM ended


class Terminated(BaseException):
    """SIGTERM, raised where the main thread was when it came."""


def raise_terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one cuts no cleanup short
    raise Terminated


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def catch_sigterm():
    """``raise_terminated`` as SIGTERM's handler where it has Python's default (a program that
    runs ``main`` with a handler of its own keeps it); the handler it replaced, else None."""
    if not _main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, raise_terminated)


@contextmanager
def keeping_sigterm() -> Iterator[None]:
    """SIGTERM's handler as it was before the block, whatever the block sets (``ray.init``'s
    ``sys.exit(signum)`` would end a command with status 15, no cleanup line, and a second
    signal cutting its cleanup short)."""
    before = signal.getsignal(signal.SIGTERM) if _main_thread() else None
    try:
        yield
    finally:
        if before is not None:  # None too where the handler was set outside Python
            signal.signal(signal.SIGTERM, before)
