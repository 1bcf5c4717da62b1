"""Which kernel set decoded a session's output: kept with the session, carried across resumes.

A session's output is target-only decoding on the kernel set that produced it (the runner's
``KernelSet``: kernels, products, attention, dtype, device, versions; named by a fingerprint).
When a session moves to a verifier whose kernel set differs (a resume on another replica, a
re-creation after the cache lost it), the tokens committed so far stay what they are and the
rest is decoded on the other set, which may round a logit differently: the output is then
target-only decoding on the first set up to ``differs_from``, and its continuation on another
after it. ``Lineage`` records that, so that the SDK's result and the verifier's metrics say it
instead of passing the joined output off as one decoding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FINGERPRINT = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class Lineage:
    """``kernels``: the fingerprint of the kernel set whose decoding the output is ("": not
    recorded, a session of an older verifier). ``differs_from``: the output position from which
    another kernel set decoded it (0: none; the tokens before it are ``kernels``' decoding)."""

    kernels: str = ""
    differs_from: int = 0

    @property
    def mixed(self) -> bool:
        return self.differs_from > 0


def continued_on(lineage: Lineage | None, here: str, committed: int) -> Lineage:
    """The lineage of a session that continues on the kernel set ``here`` with ``committed``
    output tokens already decoded (by ``lineage``'s set). Unchanged on the same set or once mixed
    (the first place it differs stays the place); on another set, mixed from ``committed`` when
    there is output already, else simply ``here``'s (nothing was decoded elsewhere)."""
    if lineage is None or not lineage.kernels:
        return Lineage(here)
    if lineage.mixed or lineage.kernels == here:
        return lineage
    return Lineage(lineage.kernels, committed) if committed > 0 else Lineage(here)


def joined(held: Lineage | None, reported: Lineage, received: int) -> Lineage:
    """What a client knows after a stream's first response ``reported`` a lineage, holding
    ``held`` from earlier streams and ``received`` output tokens: a verifier's report of a
    difference is taken (the earliest, where both report one); a verifier that reports another
    set and no difference (one whose cache kept no record) differs from ``received`` on."""
    if held is None:
        return reported
    if held.mixed or reported.mixed:
        return min((x for x in (held, reported) if x.mixed), key=lambda x: x.differs_from)
    return continued_on(held, reported.kernels, received)


def checked_lineage(kernels: str, differs_from: int, committed: int) -> Lineage | None:
    """A client's account of the output it holds (re-creating a session the cache lost), or
    None when it gave none. ValueError on a malformed one: a fingerprint that is not 16 hex
    digits, a position outside the output it sends."""
    if not kernels:
        if differs_from:
            raise ValueError("kernels_differ_from needs the kernel_set it differs from")
        return None
    if not FINGERPRINT.fullmatch(kernels):
        raise ValueError("kernel_set must be 16 lowercase hex digits (a verifier's fingerprint)")
    if not 0 <= differs_from <= committed:
        raise ValueError(f"kernels_differ_from must be in [0, {committed}] (the committed "
                         "tokens sent)")
    return Lineage(kernels, differs_from)
