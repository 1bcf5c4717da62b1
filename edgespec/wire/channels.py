"""gRPC servers and channels every role builds: a server with edgespec's message limits,
keepalive and authentication (``convert.TokenAuthInterceptor``), listening with TLS or mutual
TLS when given a certificate, key and client CA (each file checked first, so that a bad one is
named rather than gRPC's "cannot listen"); client channels with the same limits, quick
reconnects and keepalive; a free loopback port.
"""

from __future__ import annotations

import socket
import threading
from collections import deque
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import grpc

from ..config import ConfigError
from .convert import MAX_MESSAGE_BYTES, TokenAuthInterceptor
from .keepalive import client_keepalive_options, server_keepalive_options


def make_server(max_workers: int, token: str | None,
                stream_limits: dict[str, int] | None = None, device_tokens=None) -> grpc.Server:
    """A sync gRPC server with authentication (the shared ``token`` and/or per-device
    ``device_tokens``, see ``TokenAuthInterceptor``); ``stream_limits`` caps open streams per
    method (see grpc_limits)."""
    from .grpc_limits import StreamLimitInterceptor

    interceptors = ([TokenAuthInterceptor(token, device_tokens)]
                    if token or device_tokens else [])
    if stream_limits:
        interceptors.append(StreamLimitInterceptor(stream_limits))
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.so_reuseport", 0), *server_keepalive_options()])


def check_tls_pair(cert: str, key: str) -> None:
    """A server's certificate and key, checked as TLS will use them: PEM files whose key is the
    certificate's (gRPC says only that it cannot listen, the reason on its own stderr)."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.set_ciphers("DEFAULT:@SECLEVEL=0")  # the pair's form, not OpenSSL's key policy
    try:
        context.load_cert_chain(cert, key, password=lambda: b"")  # encrypted: refused, unasked
    except ssl.SSLError as e:
        raise ConfigError(f"--tls-cert {cert} and --tls-key {key} are not a PEM certificate "
                          f"and its private key ({e.reason or e})") from None
    except OSError as e:
        for option, path in (("--tls-cert", cert), ("--tls-key", key)):
            _read(path, option)  # the file that cannot be read, named (ssl gives only errno 2)
        raise ConfigError(f"cannot read the TLS certificate or key: {e}") from None


def check_tls_ca(path: str, option: str) -> None:
    """Refuse (ConfigError, naming ``option``) a CA file that is not PEM certificates: gRPC
    would only say it cannot listen."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as e:
        raise ConfigError(f"{option} {path}: not a PEM certificate ({e.reason or e})") from None
    except OSError as e:
        raise ConfigError(f"{option}: cannot read {path}: {e}") from None


def bind(server: grpc.Server, address: str, tls_cert: str | None = None,
         tls_key: str | None = None, client_ca: str | None = None) -> int:
    """Listen on ``address``; TLS when a certificate and key are given, mutual TLS when
    ``client_ca`` is given too (every client must present a certificate signed by that CA).
    Returns the port."""
    from .reachability import check_address, port_in_use, split_address, why_not_listening

    check_address(address, "--listen")  # gRPC reads a port past 65535, or none, as another
    split = split_address(address)
    if split is not None and split[1] and port_in_use(*split):  # said before gRPC's log line
        raise ConfigError(f"cannot listen on {address}{why_not_listening(*split, '--listen')}")
    if bool(tls_cert) != bool(tls_key):
        raise ConfigError("TLS needs both --tls-cert and --tls-key")
    if client_ca and not tls_cert:
        raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
    if tls_cert and tls_key:  # both or neither (checked above)
        check_tls_pair(tls_cert, tls_key)
        pair = [(_read(tls_key), _read(tls_cert))]
        if client_ca:
            check_tls_ca(client_ca, "--tls-client-ca")
            creds = grpc.ssl_server_credentials(pair, root_certificates=_read(client_ca),
                                                require_client_auth=True)
        else:
            creds = grpc.ssl_server_credentials(pair)
    try:
        port = (server.add_secure_port(address, creds) if tls_cert
                else server.add_insecure_port(address))
    except RuntimeError:  # newer grpc raises where older returned 0
        port = 0
    if port == 0:
        why = why_not_listening(*split, "--listen") if split else ""
        raise ConfigError(f"cannot listen on {address}{why}")
    return port


# A client channel's gRPC arguments, before the caller's own (make_channel's ``options``).
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # reconnect within a second or two of a server restart, not gRPC's default backoff of up
    # to two minutes (a resuming client would wait that long)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000))


def make_channel(address: str, tls_ca: str | None = None, tls: bool = False,
                 aio: bool = False, client_cert: str | None = None,
                 client_key: str | None = None, options: Sequence[tuple[str, Any]] = ()):
    """A client channel (``aio``: a grpc.aio one) with edgespec's message limits; TLS when
    ``tls``, a CA certificate to trust, or a client certificate is given. ``client_cert`` and
    ``client_key`` (PEM files, both or neither): the certificate presented for mutual TLS.
    ``options``: more gRPC channel arguments, ``(name, value)`` pairs merged after edgespec's
    own (``CHANNEL_OPTIONS`` and the keepalive's, ``keepalive.py``): one with the same name
    replaces edgespec's value."""
    merged = dict(CHANNEL_OPTIONS)
    merged.update(client_keepalive_options())
    merged.update(options)  # a caller's option replaces edgespec's of the same name
    args = list(merged.items())
    mod = grpc.aio if aio else grpc
    if bool(client_cert) != bool(client_key):
        raise ConfigError("a client certificate needs both --tls-cert and --tls-key")
    if tls or tls_ca or client_cert:
        creds = grpc.ssl_channel_credentials(
            _read(tls_ca) if tls_ca else None,
            private_key=_read(client_key) if client_key else None,
            certificate_chain=_read(client_cert) if client_cert else None)
        return mod.secure_channel(address, creds, options=args)
    return mod.insecure_channel(address, options=args)


_handed_out: deque[int] = deque(maxlen=64)  # the ports ``free_port`` gave lately
_handing_out = threading.Lock()


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now, and none of the last 64 this
    process was given: the kernel may hand a port it has just freed out again, so two asked
    for in a row (a server's gRPC and HTTP ports) came back the same now and then."""
    with _handing_out:
        for _ in range(100):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                break
        _handed_out.append(port)
        return port


def _read(path: str, option: str = "") -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"{option + ': ' if option else ''}cannot read {path}: "
                          f"{e.strerror}") from None
