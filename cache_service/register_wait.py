"""An Attach stream's wait for its first message, the drafter's Register, bounded.

gRPC counts an Attach stream against ``--max-drafters`` from its first byte, but the cache
learns which board it is only from its Register (or, with per-device tokens, from its token).
A stream that never registers would hold its slot for as long as its client keeps the
connection up: a board holding every slot with streams that send nothing keeps every other
board out, whatever token it holds (found by a hostile board's probe: four silent streams of
one token's holder kept another board out of a cache of four slots for as long as they
lasted). So a stream gets ``wait_s`` to register, and, where the token names the device, a
device has one stream waiting at a time: a newer one replaces the older, as a newer registered
stream replaces an older one.
"""

from __future__ import annotations

import logging
import threading

import grpc

from edgespec.v1 import edgespec_pb2 as pb
from edgespec.wire.request_parsing import MalformedRequest

log = logging.getLogger("edgespec.cache")

REGISTER_WAIT_S = 10.0  # how long an Attach stream may take to send its Register


class RegisterWait:
    """The streams waiting for their Register: their deadline, and one at a time per device
    where the caller's token names it."""

    def __init__(self, wait_s: float = REGISTER_WAIT_S):
        self.wait_s = wait_s
        self._waiting: dict[str, grpc.ServicerContext] = {}  # device -> its waiting stream
        self._lock = threading.Lock()

    def waiting(self) -> set[str]:
        """The devices with a stream waiting for its Register (those its token names)."""
        with self._lock:
            return set(self._waiting)

    def first_message(self, it, context: grpc.ServicerContext, device: str | None
                      ) -> pb.DrafterMessage | None | bool:
        """The stream's first message (None: it ended without one), or False where the call
        is over without it: no message within ``wait_s`` (the call is then cancelled), a
        newer stream of the same ``device`` (the token's, None: not known before Register)
        replaced it, or its client left."""
        if device is not None:
            with self._lock:
                older, self._waiting[device] = self._waiting.get(device), context
            if older is not None:  # the older stream's wait ends; its slot is free
                older.cancel()
        late = threading.Event()

        def give_up() -> None:  # said before the call ends: its client hears it after
            late.set()
            log.warning("an Attach stream from %s sent no Register within %.0f s: closed",
                        context.peer() or "?", self.wait_s)
            context.cancel()

        timer = threading.Timer(self.wait_s, give_up)
        timer.daemon = True
        timer.start()
        try:
            first = next(it, None)
        except MalformedRequest:  # the call already ended INVALID_ARGUMENT, saying why
            raise
        except grpc.RpcError:  # cancelled: by the timer, a newer stream, or its client leaving
            first = None
        finally:
            timer.cancel()
            if device is not None:
                with self._lock:
                    if self._waiting.get(device) is context:
                        del self._waiting[device]
        if late.is_set() or (first is None and not context.is_active()):
            return False
        return first
