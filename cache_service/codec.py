"""How the draft cache keeps its state in Redis: the key layout (``KeyLayout``), the encodings of
tokens, sampling parameters and a drafter's inbox events (``InboxEvent``: one codec for the
fields ``store`` and the commit script write and the service reads), and the translation of
Redis failures into the protocol's ``StoreUnavailable``.

Keys (prefix ``es:`` by default):

    es:s:{sid}            hash: prompt_len, epoch, device, params (JSON, seed included), idle,
                          done, finish (reason), max_new, verify
    es:s:{sid}:tok        string: prompt + committed tokens, packed little-endian uint32
    es:s:{sid}:draft      string: the draft beyond the committed tokens, packed the same way
    es:s:{sid}:br         list: the draft's branches (token trees), each packed [pos, tokens...]
                          (pos absolute: the draft's start moves as commits are held)
    es:dev:{id}:inbox     stream: assignment / commit (fix) / close events for a drafter
    es:dev:{id}:alive     string with a short TTL while the drafter's stream is open
    es:dev:{id}:sessions  set: the device's active sessions
    es:devices            hash: device id -> JSON registration
    es:devices:seen       sorted set: device id -> last seen (registrations idle long are pruned)
    es:target             hash: the verifier's model, tokenizer fingerprint, vocabulary, window
    es:health             string with a short TTL: a server's health probe, written every 5 s
                          (a Redis that refuses writes, full or read-only, serves nothing)
    es:wake               pub/sub channel: a message per pushed chunk with news (tokens kept,
                          or its drafter newly idle), its session's key, wakes the verifier
    es:cb:f, es:cb:lru, es:cb:v   the fleet-wide Cacheback table (``cache_service.fleet_table``),
                          taught every session's output when the verifier closes it
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import numpy as np
import redis
from redis.typing import EncodableT, FieldT

from edgespec.config import SamplingParams
from edgespec.protocol.contract import StoreUnavailable


@dataclass(frozen=True)
class KeyLayout:
    """The Redis keys under one prefix (module docstring)."""

    prefix: str = "es:"

    def session(self, sid: str) -> list[str]:
        """[hash, committed tokens, draft, branches] keys of a session."""
        base = f"{self.prefix}s:{sid}"
        return [base, base + ":tok", base + ":draft", base + ":br"]

    @property
    def session_prefix(self) -> str:
        return f"{self.prefix}s:"

    @property
    def device_prefix(self) -> str:
        return f"{self.prefix}dev:"

    def inbox(self, device: str) -> str:
        return f"{self.prefix}dev:{device}:inbox"

    def alive(self, device: str) -> str:
        return f"{self.prefix}dev:{device}:alive"

    def sessions(self, device: str) -> str:
        return f"{self.prefix}dev:{device}:sessions"

    @property
    def devices(self) -> str:
        return f"{self.prefix}devices"

    @property
    def seen(self) -> str:
        return f"{self.prefix}devices:seen"

    @property
    def target(self) -> str:
        return f"{self.prefix}target"

    @property
    def health(self) -> str:
        return f"{self.prefix}health"

    @property
    def wake(self) -> str:
        return f"{self.prefix}wake"


# the fields of a commit event, in the order the commit script (store_lua.COMMIT_LUA) writes
# them; assign and close events carry the first two (tests/test_cache_store_inbox.py reads
# the script)
COMMIT_FIELDS = ("t", "sid", "epoch", "end", "fix", "tok", "pos", "more", "want")


@dataclass(frozen=True)
class InboxEvent:
    """One entry of a drafter's inbox stream: a session assigned to it, a commit (a fix when
    the draft did not hold the verifier's token: the session rolls back to ``position`` and
    continues with ``token`` and ``more``), or a session closed."""

    kind: str  # "assign", "commit" or "close"
    session_id: str
    epoch: int = 0
    end: int = 0  # commit: the committed end
    fix: bool = False
    token: int = 0  # fix: the verifier's first token, at ``position``
    position: int = 0
    more: tuple[int, ...] = ()  # fix: its further tokens (a branch's)
    wanted: int | None = None  # commit: draft tokens the step asked of the session (None: unsaid)

    def fields(self) -> dict[FieldT, EncodableT]:
        """The stream entry (the commit script writes commits itself, in these fields)."""
        out: dict[FieldT, EncodableT] = {"t": self.kind, "sid": self.session_id}
        if self.kind == "commit":
            out.update(epoch=str(self.epoch), end=str(self.end), fix="1" if self.fix else "0",
                       tok=str(self.token), pos=str(self.position),
                       more=",".join(map(str, self.more)),
                       want=str(-1 if self.wanted is None else self.wanted))
        return out

    @classmethod
    def parse(cls, fields: dict[str, str]) -> "InboxEvent | None":
        """The event of a stream entry's fields; None for a kind this version does not know."""
        kind, sid = fields.get("t"), fields.get("sid", "")
        if kind in ("assign", "close"):
            return cls(kind, sid)
        if kind != "commit":
            return None
        end, epoch = int(fields["end"]), int(fields["epoch"])
        want = int(fields.get("want") or -1)  # absent: a commit written by an older verifier
        wanted = want if want >= 0 else None
        if fields.get("fix") != "1":
            return cls("commit", sid, epoch, end, wanted=wanted)
        more = tuple(int(t) for t in fields.get("more", "").split(",") if t)
        return cls("commit", sid, epoch, end, True, int(fields["tok"]),
                   int(fields.get("pos", end - 1 - len(more))), more, wanted)


def pack_tokens(tokens) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def text(x: bytes | str) -> str:
    """A Redis reply as text (the clients here return bytes; redis-py types replies as either)."""
    return x.decode() if isinstance(x, bytes) else x


def unpack_tokens(blob: bytes | str | None) -> list[int]:
    if isinstance(blob, str):
        blob = blob.encode("latin-1")
    return np.frombuffer(blob or b"", dtype="<u4").astype(np.int64).tolist()


def params_to_json(p: SamplingParams) -> str:
    """The session's sampling settings as the cache keeps them (a resume on another verifier
    reads them back): the penalties and bias only where set, so a session without them reads
    as before."""
    out: dict[str, object] = {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
                              "seed": p.seed}
    if p.presence_penalty:
        out["presence_penalty"] = p.presence_penalty
    if p.frequency_penalty:
        out["frequency_penalty"] = p.frequency_penalty
    if p.logit_bias:
        out["logit_bias"] = [list(pair) for pair in p.logit_bias]
    return json.dumps(out)


def params_from_json(s: str | bytes | None) -> SamplingParams:
    return SamplingParams(**json.loads(s)) if s else SamplingParams()


def raises_store_unavailable(method):
    """The verifier's calls raise ``StoreUnavailable`` when Redis cannot serve them (down,
    restarting, out of memory), so that no role above the store knows it is Redis."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except (redis.RedisError, OSError) as e:
            raise StoreUnavailable(f"the draft cache's Redis: {e}") from e

    return wrapper
