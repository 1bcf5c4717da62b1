"""Per-device credentials: each drafter authenticates with its own token.

The tokens file (``--device-tokens FILE`` on the cache) holds one ``device_id: token`` per line;
blank lines and lines starting with ``#`` are skipped, and a ``#`` after whitespace ends a line.
Tokens are any printable ASCII without whitespace; a device id appears once, and no two devices
share a token. Error messages name line numbers, never tokens.

With credentials configured, a drafter sends its own token the usual way (``authorization: Bearer
<token>``) and the cache derives the device from it: a Register for another device id, a PushDraft
that names another device, and a chunk for a session assigned to another device are refused with
PERMISSION_DENIED (see ``edgespec.wire.convert.TokenAuthInterceptor`` for which tokens each service
accepts).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping

from edgespec.config import ConfigError
from edgespec.protocol.ids import check_device_id

_COMMENT = re.compile(r"\s#")  # a '#' after whitespace starts a comment


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def bearer_token(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The token of an ``authorization: Bearer <token>`` metadata entry, else None."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


class DeviceCredentials:
    """Which device a token belongs to. Look-ups go through a SHA-256 digest of the token, so
    their timing tells nothing useful about the tokens held."""

    def __init__(self, tokens: Mapping[str, str]):
        """tokens: device id -> token."""
        self._device_of: dict[bytes, str] = {}
        for device, token in tokens.items():
            check_device_id(device)
            _check_token(token, f"the token of {device}")
            digest = _digest(token)
            if digest in self._device_of:
                raise ConfigError(f"devices {self._device_of[digest]} and {device} share a token")
            self._device_of[digest] = device
        self.devices = frozenset(self._device_of.values())

    @classmethod
    def parse(cls, text: str, source: str = "device tokens") -> "DeviceCredentials":
        tokens: dict[str, str] = {}
        for n, raw in enumerate(text.splitlines(), 1):
            line = _COMMENT.split(raw, 1)[0].strip()
            if not line or line.startswith("#"):
                continue
            device, sep, token = line.partition(":")
            device, token = device.strip(), token.strip()
            if any(c.isspace() for c in token):
                raise ConfigError(f"{source} line {n}: a token cannot hold whitespace")
            if not sep or not device or not token:
                raise ConfigError(f"{source} line {n}: expected 'device_id: token'")
            try:
                check_device_id(device)
            except ConfigError as e:
                raise ConfigError(f"{source} line {n}: {e}") from None
            if device in tokens:
                raise ConfigError(f"{source} line {n}: device {device} is listed twice")
            tokens[device] = token
        if not tokens:
            raise ConfigError(f"{source} lists no device")
        return cls(tokens)

    @classmethod
    def load(cls, path: str) -> "DeviceCredentials":
        """Read a tokens file; ConfigError when it cannot be read or parsed."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read device tokens {path}: {e}") from None
        return cls.parse(text, source=str(path))

    def device_for(self, token: str | None) -> str | None:
        """The device a token belongs to, or None."""
        if not token:
            return None
        return self._device_of.get(_digest(token))

    def device_from_metadata(self, metadata) -> str | None:
        """The device whose token the call's ``authorization`` metadata carries, or None."""
        return self.device_for(bearer_token(metadata))

    def __len__(self) -> int:
        return len(self._device_of)

    def __repr__(self) -> str:  # never the tokens
        return f"DeviceCredentials({len(self)} devices)"


def _check_token(token, what: str) -> None:
    if (not isinstance(token, str) or not token
            or any(not 0x21 <= ord(c) <= 0x7E for c in token)):
        raise ConfigError(f"{what} must be non-empty printable ASCII without whitespace")
