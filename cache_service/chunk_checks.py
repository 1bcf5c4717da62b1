"""What a drafter's chunk must be before the cache stores it: its session id well formed and
assigned to the device that sends it, its shape (a chain, or a tree of ``edgespec.wire.trees``)
and size within the window, its token ids in the target's vocabulary, and its epoch and start
where the store's session stands (the last two, and the session's device, checked by the push's
own script: one round trip a chunk). A chunk that is not is refused (``ChunkRefused``) with the
gRPC status code the drafter's ack carries.
"""

from __future__ import annotations

import grpc

from edgespec.config import ConfigError
from edgespec.protocol.contract import Branch, check_draft_ids
from edgespec.protocol.ids import check_session_id
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.wire.trees import MAX_BRANCH_NODES, TREE_VERSION, tree_from_wire

from .store import RedisSessionStore, StoreError
from .store_records import ChunkPush, PushResult

DEVICE_METADATA = "x-edgespec-device"  # PushDraft's device, without per-device credentials
MAX_POSITION = 1 << 31  # a chunk's positions (its start, its branches'): past any context served
# the store's refusals of a push (``StoreError.kind``) as the ack's status codes
STORE_REFUSALS = {"unknown": grpc.StatusCode.NOT_FOUND,
                  "stale": grpc.StatusCode.FAILED_PRECONDITION,
                  "finished": grpc.StatusCode.FAILED_PRECONDITION,
                  "position": grpc.StatusCode.FAILED_PRECONDITION}


class ChunkRefused(Exception):
    """A chunk refused, with the status code its ack carries."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def chunk_draft(chunk: pb.DraftChunk, window: int) -> tuple[list[int], list[Branch]]:
    """A chunk's chain and branches (tree chunks, ``edgespec.wire.trees``), its size and shape
    checked before any work."""
    bad = grpc.StatusCode.INVALID_ARGUMENT
    if chunk.tree_version not in (0, TREE_VERSION):
        raise ChunkRefused(bad, f"tree_version {chunk.tree_version} is not known to this cache "
                                f"(0: a chain, {TREE_VERSION}: a chain with branches)")
    if not 0 <= chunk.start < MAX_POSITION:  # a tree's positions are stored as uint32
        raise ChunkRefused(bad, f"start {chunk.start} is not a position (0 <= start < 2^31)")
    if len(chunk.tokens) > window + (MAX_BRANCH_NODES if chunk.tree_version else 0):
        raise ChunkRefused(bad, f"a chunk holds at most {window} tokens (the window)"
                           + (f" and {MAX_BRANCH_NODES} branch tokens"
                              if chunk.tree_version else ""))
    if not chunk.tree_version:
        if chunk.tree_parents:
            raise ChunkRefused(bad, "a chain chunk (tree_version 0) has no tree_parents")
        return _within_positions(chunk.start, list(chunk.tokens)), []
    try:
        tokens, branches = tree_from_wire(list(chunk.tokens), list(chunk.tree_parents))
    except ValueError as e:
        raise ChunkRefused(bad, f"malformed tree chunk: {e}") from None
    if len(tokens) > window:
        raise ChunkRefused(bad, f"a chunk holds at most {window} tokens (the window)")
    return _within_positions(chunk.start, tokens), branches


def _within_positions(start: int, chain: list[int]) -> list[int]:
    """``chain``, once every position it covers is below 2^31: a branch hangs from one of
    them, and the store keeps a branch's position as a signed 32-bit number (a chunk past it
    failed the whole batch of chunks it was stored with: every other board's in it too)."""
    if start + len(chain) > MAX_POSITION:
        raise ChunkRefused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"a chunk of {len(chain)} tokens at start {start} runs past position "
                           "2^31 - 1")
    return chain


def check_and_push(store: RedisSessionStore, device: str, chunk: pb.DraftChunk, vocab: int,
                   window: int, per_device: bool) -> tuple[pb.ChunkAck, bool]:
    """Store ``device``'s chunk (its draft for one of its sessions) once it is checked, or raise
    ``ChunkRefused`` with the status code the drafter is answered with. What the chunk holds is
    checked here, before any round trip; that the session exists and is the device's, with the
    push, in one script. ``per_device``: the cache knows the device by its token (a session of
    another device's is PERMISSION_DENIED, else FAILED_PRECONDITION). A round trip of its own
    (an Attach stream's chunks are stored together: ``chunk_intake``). Returns its ack and
    whether it told the verifier anything (``PushResult.news``)."""
    checked = checked_chunk(store, device, chunk, vocab, window)
    res: PushResult | StoreError
    try:
        res = store.push_chunk(checked)
    except StoreError as e:
        res = e
    ack = chunk_ack(chunk, checked, res, per_device)
    assert isinstance(res, PushResult)  # chunk_ack raised for a refusal
    return ack, res.news


def checked_chunk(store: RedisSessionStore, device: str, chunk: pb.DraftChunk, vocab: int,
                  window: int) -> ChunkPush:
    """``chunk`` as the store appends it, once what it holds is checked (else ``ChunkRefused``)."""
    try:
        sid = check_session_id(chunk.session_id)
    except ConfigError as e:
        raise ChunkRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    if not device:
        if store.session_device(sid) is None:
            raise ChunkRefused(grpc.StatusCode.NOT_FOUND, f"unknown session {sid!r}")
        raise ChunkRefused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"a chunk needs its device (metadata {DEVICE_METADATA!r})")
    tokens, branches = chunk_draft(chunk, window)
    try:
        check_draft_ids(chunk.tokens, vocab)  # the chain's and the branches' nodes
    except ValueError as e:
        raise ChunkRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    return ChunkPush.of(sid, chunk.epoch, chunk.start, tokens, chunk.idle, window, branches,
                        device)


def chunk_ack(chunk: pb.DraftChunk, checked: ChunkPush, outcome: PushResult | StoreError,
              per_device: bool) -> pb.ChunkAck:
    """The ack of a stored chunk, or ``ChunkRefused`` for the store's refusal of it."""
    if isinstance(outcome, StoreError):
        sid, device, kind = checked.session_id, checked.device, outcome.kind
        if kind == "device":
            code = (grpc.StatusCode.PERMISSION_DENIED if per_device
                    else grpc.StatusCode.FAILED_PRECONDITION)
            raise ChunkRefused(code, f"session {sid} is not assigned to {device!r}")
        if kind == "unknown":
            raise ChunkRefused(grpc.StatusCode.NOT_FOUND, f"unknown session {sid!r}")
        raise ChunkRefused(STORE_REFUSALS.get(kind, grpc.StatusCode.INTERNAL), str(outcome))
    return pb.ChunkAck(session_id=checked.session_id, start=chunk.start, kept=outcome.kept,
                       committed_end=outcome.committed_end, code=grpc.StatusCode.OK.value[0])
