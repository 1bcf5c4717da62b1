"""What the draft cache's Lua scripts read and write (a step's verdicts packed as
``COMMIT_MANY_LUA`` unpacks them, the shapes of its replies and of ``TAKE_MANY_LUA``'s), and the
records ``RedisSessionStore`` hands back (a session to resume, a drafter's snapshot, a pushed
chunk's outcome, a refusal).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from edgespec.config import SamplingParams
from edgespec.protocol.contract import Branch, Verdict, chunk_branches
from edgespec.protocol.lineage import Lineage

from .codec import pack_tokens


class StoreError(Exception):
    """A refused operation. ``kind``: unknown, stale, finished, position, branch, device (a
    chunk for a session another device drafts for)."""

    KINDS = {-1: "unknown", -2: "stale", -3: "finished", -4: "position", -5: "branch",
             -6: "device"}  # else (-7: the script failed on it) "error"

    def __init__(self, code: int, message: str | bytes):
        super().__init__(message.decode() if isinstance(message, bytes) else message)
        self.kind = self.KINDS.get(code, "error")


@dataclass
class PushResult:
    kept: int
    committed_end: int
    # the chunk told the verifier something: tokens kept, or its drafter newly idle (one with
    # none, repeated, costs the cache a round trip for nothing: paced as a refusal is)
    news: bool = True


# a verdict's numbers as COMMIT_MANY_LUA unpacks them: epoch, accepted, token, done, start,
# first fix token, own branch, wanted
COMMIT_NUMBERS = struct.Struct("<iiIiiIii")
# COMMIT_MANY_LUA's answer to a verdict: COMMIT's (fix 0/1/2 replay, epoch, end), or an error's
# code (< 0) and its message's 1-based index
COMMIT_REPLY = struct.Struct("<iii")
# a session as TAKE_MANY_LUA reads it: epoch (-1: vanished), idle, committed bytes, drafting (a
# drafter alive), the bytes of the draft's first tokens that follow (at most those wanted)
TAKE_HEADER = struct.Struct("<iiiii")
INT = struct.Struct("<i")


def _sized(b: bytes) -> bytes:
    """``b`` as the scripts' ``struct.unpack('<i4c0')`` reads it: its length, then itself."""
    return INT.pack(len(b)) + b


_THREE_EMPTY = _sized(b"") * 3  # a verdict without finish reason or branch: its last fields


def packed_verdict(v: Verdict) -> bytes:
    """A verdict as COMMIT_MANY_LUA reads it: its numbers, its session id, its finish reason,
    its branch's tokens and the inbox event's tokens after the first (the branch's, then the
    verdict's token); a step's usual verdict (no branch, not the last) with its three empty
    fields at once (bench-host: a third of the commit's packing)."""
    fix = v.branch[0] if v.branch else v.token  # the inbox event's first token
    head = COMMIT_NUMBERS.pack(v.epoch, v.n_accepted, v.token, int(v.done), v.start, fix,
                               int(v.own_branch), -1 if v.wanted is None else v.wanted) \
        + _sized(v.session_id.encode())
    if not v.branch and not v.finish_reason:
        return head + _THREE_EMPTY
    more = (*v.branch[1:], v.token) if v.branch else ()
    return head + _sized(v.finish_reason.encode()) + _sized(pack_tokens(v.branch)) \
        + _sized(",".join(map(str, more)).encode())


# a chunk's numbers as PUSH_MANY_LUA unpacks them: epoch, start, idle, window, most branches,
# branches sent
PUSH_NUMBERS = struct.Struct("<iiiiii")
_INT32 = 1 << 31


@dataclass(frozen=True)
class ChunkPush:
    """A drafter's chunk as the store appends it (``RedisSessionStore.push_many``): its chain,
    and its ``branches`` as (absolute position, packed [position, tokens...]) pairs."""

    session_id: str
    epoch: int
    start: int  # 0 <= start < 2^31 (``chunk_checks``)
    tokens: bytes  # packed
    idle: bool
    window: int
    branches: tuple[tuple[int, bytes], ...] = ()
    device: str = ""  # given: stored only if the session is this device's

    @classmethod
    def of(cls, sid: str, epoch: int, start: int, tokens: list[int], idle: bool, window: int,
           branches: Sequence[Branch] = (), device: str = "") -> ChunkPush:
        """A chunk from ``push``'s arguments (``branches``' ``at`` relative to the chunk, stored
        by absolute position: the draft's start moves)."""
        brs = tuple((start + b.at, pack_tokens([start + b.at, *b.tokens]))
                    for b in chunk_branches(tokens, branches, len(tokens)))
        return cls(sid, epoch, start, pack_tokens(tokens), idle, window, brs, device)


def packed_chunk(c: ChunkPush, max_branches: int) -> bytes:
    """A chunk as PUSH_MANY_LUA reads it. An epoch out of 32 bits is no session's: sent as -1,
    refused as stale."""
    epoch = c.epoch if 0 <= c.epoch < _INT32 else -1
    head = PUSH_NUMBERS.pack(epoch, c.start, int(c.idle), c.window, max_branches,
                             len(c.branches)) + _sized(c.session_id.encode()) \
        + _sized(c.tokens) + _sized(c.device.encode())
    if not c.branches:
        return head
    return head + b"".join(INT.pack(pos) + _sized(packed) for pos, packed in c.branches)


@dataclass
class SessionRecord:
    """A session as stored: what a verifier needs to resume it."""

    session_id: str
    prompt: list[int]
    committed: list[int]
    params: SamplingParams
    max_new_tokens: int
    device: str | None
    finish_reason: str | None  # set once the session finished ("stop" or "length")
    epoch: int
    done: bool  # closed, whatever the reason (cancelled and failed sessions are resumable)
    verify: str = ""  # "exact" or "loose" as verified so far ("": recorded before it was kept)
    lineage: Lineage = Lineage()  # the kernel set its output is the decoding of


@dataclass
class SessionSnapshot:
    session_id: str
    tokens: list[int]
    params: SamplingParams
    epoch: int
    # past its last output token: prompt + max_new (None: not said, or a loose session)
    output_end: int | None = None


@dataclass
class DraftRow:
    """A session as ``take_when_ready`` reads it."""

    epoch: int | None  # None: the session vanished
    idle: bool  # its drafter has nothing more until a fix
    drafting: bool  # it has a drafter, attached now
    committed_end: int
    draft_len: int  # tokens in ``draft``: the draft's first, at most those asked for
    draft: bytes  # the first k draft tokens, packed
    branches: list[bytes]  # packed, when branches were asked for

    def ready(self, k: int) -> bool:
        """Waiting longer would not give a longer draft (or the session is gone)."""
        return self.epoch is None or not self.drafting or self.idle or self.draft_len >= k
