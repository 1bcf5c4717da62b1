"""What a board's failed first attach says about its settings: an address that can never work
ends the ``edgespec drafter`` command with one line (status 2) instead of retrying for ever.
Read from a plain probe of the address (``edgespec.wire.reachability.probe``) made when the
first attach fails UNAVAILABLE: once a board has attached, any failure is an outage to wait out.
"""

from __future__ import annotations

from edgespec.wire.reachability import CONNECT_GRACE_S, Probe


def settings_refusal(cache: str, found: Probe, tls: bool, closed_for_s: float,
                     details: str) -> str | None:
    """The error to stop with, or None to retry: ``found`` the probe's kind, ``tls`` whether
    the board speaks TLS, ``closed_for_s`` for how long the probes have found a TLS server up
    ("closed", in a row: a server loading its model is "silent" until it serves, and a board
    started beside it is not refused at the server's first answer), ``details`` gRPC's words
    for the last failure."""
    if found == "answered":  # something that is not HTTP/2: a wrong port, not an outage
        return (f"{cache} answers, but not as a gRPC server: the server's --http-port or "
                f"--metrics-port? give --cache the cache's gRPC address (serve's --listen)")
    if found == "h2" and tls:  # a plaintext gRPC server: every TLS handshake fails, for ever
        return (f"the cache at {cache} serves plaintext gRPC, this drafter TLS: a TLS mismatch "
                f"(drop --tls/--tls-ca, or start the cache with --tls-cert)")
    if found == "closed" and not tls:  # a TLS server closes a plaintext connection unanswered
        return (f"the cache at {cache} closes a plaintext connection without answering: a TLS "
                f"server? give the drafter --tls (the system's roots) or --tls-ca FILE")
    if found == "closed" and closed_for_s >= CONNECT_GRACE_S:  # up, the handshake failing
        return (f"the cache at {cache} speaks TLS but the TLS handshake keeps failing "
                f"({details.strip()[:300]}): is its certificate signed by the CA given "
                f"(--tls-ca; without it, the system's roots), and for this host name?")
    return None
