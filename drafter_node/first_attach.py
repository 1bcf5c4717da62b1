"""What a board's failed first attach says about its settings: an address that can never work
ends the ``edgespec drafter`` command with one line (status 2) instead of retrying for ever.
Read from a plain probe of the address (``edgespec.wire.reachability.probe``) made when the
first attach fails UNAVAILABLE: once a board has attached, any failure is an outage to wait out.

Only what is sure stops a board (a board that exits stays down under a service manager's start
limit): something that answers but not as HTTP/2, a plaintext gRPC server reached with TLS, and
a server that completes a TLS handshake reached without TLS. A TLS handshake of the board's that
fails (an untrusted certificate, say) is retried, its cause logged: a TLS cache answers
UNAVAILABLE through a good handshake too (draining, its Redis unreachable, no verifier yet), and
a proxy in front of a cache does for a backend that is down.
"""

from __future__ import annotations

from edgespec.wire.reachability import Probe, speaks_tls


def settings_refusal(cache: str, found: Probe, tls: bool) -> str | None:
    """The error to stop with, or None to retry: ``found`` the probe's kind, ``tls`` whether
    the board speaks TLS."""
    if found == "answered":  # something that is not HTTP/2: a wrong port, not an outage
        return (f"{cache} answers, but not as a gRPC server: the server's --http-port or "
                f"--metrics-port? give --cache the cache's gRPC address (serve's --listen)")
    if found == "h2" and tls:  # a plaintext gRPC server: every TLS handshake fails, for ever
        return (f"the cache at {cache} serves plaintext gRPC, this drafter TLS: a TLS mismatch "
                f"(drop --tls/--tls-ca, or start the cache with --tls-cert)")
    # closed unanswered: a TLS server, or a forwarder whose backend is not up; only a completed
    # TLS handshake says which
    if found == "closed" and not tls and speaks_tls(cache):
        return (f"the cache at {cache} speaks TLS, this drafter plaintext: give the drafter "
                f"--tls (the system's roots) or --tls-ca FILE")
    return None


def handshake_hint(details: str) -> str | None:
    """What to check when gRPC says this board's TLS handshake failed, else None."""
    if "handshake failed" not in details.lower():
        return None
    return ("is the cache's certificate signed by the CA given (--tls-ca; without it, the "
            "system's roots) and for the host name in --cache? does the server ask for a "
            "client certificate (--tls-client-ca: give --tls-cert and --tls-key)?")
