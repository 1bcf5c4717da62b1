"""edgespec: speculative decoding across an edge fleet.

The client SDK is importable from the top: ``edgespec.Client``, ``edgespec.AsyncClient`` and the
``EdgespecError`` family.
"""

__version__ = "0.1.0"

_CLIENT_NAMES = {"Client", "AsyncClient", "GenerateResult", "StreamPiece", "EdgespecError",
                 "InvalidRequest", "NotFound", "PreconditionFailed", "Overloaded",
                 "Unauthenticated", "DeadlineExceeded", "Cancelled", "Unavailable"}


def __getattr__(name):
    if name in _CLIENT_NAMES:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'edgespec' has no attribute {name!r}")
