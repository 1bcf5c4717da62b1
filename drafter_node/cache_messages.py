"""What the draft cache sends a drafter agent, recorded in the drafting loop's book: its
registration (the window, the chunk size, the target's vocabulary), sessions assigned and
closed, commits and fixes, and the acks of the chunks sent. Everything the cache sends is
checked as a board checks untrusted input: a message out of order ends the link, a session
whose token ids are outside the target's vocabulary is refused (the verifier decodes it alone).
``CacheMessages`` is the part of ``agent.DrafterAgent`` that reads the cache's messages.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import grpc

from edgespec.config import ConfigError, SamplingParams
from edgespec.drafters import Drafter
from edgespec.drafters.draft_book import DraftBook, DraftTarget
from edgespec.protocol.contract import check_draft_ids
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.wire.convert import params_from_pb

if TYPE_CHECKING:  # prometheus_client is needed only where metrics are kept
    from .metrics import DrafterMetrics

log = logging.getLogger("edgespec.drafter")


class CacheMessages:
    """Reads the cache's messages into ``book`` under ``cond`` (``_apply``, called by the
    link's receiving thread)."""

    cache: str
    device_id: str
    max_sessions: int  # sessions drafted for at once (0: no limit)
    drafter: Drafter
    book: DraftBook
    cond: threading.Condition
    connected: threading.Event
    metrics: DrafterMetrics | None
    window: int | None
    chunk: int | None
    vocab: int | None
    cache_batches: bool
    tree_width: int
    attaches: int
    refused: int
    _outage_since: float | None

    def refuse(self, sid: str, target: DraftTarget, start: int, why: str) -> None:
        raise NotImplementedError

    def _send_idle(self, sid: str, target: DraftTarget, start: int) -> None:
        raise NotImplementedError

    def _apply(self, msg: pb.CacheMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind in ("assignment", "commit", "closed") and not self.connected.is_set():
            # the window and the vocabulary come with it: a cache out of order costs the link
            raise ConnectionError(f"the cache sent {kind!r} before 'registered'")
        with self.cond:
            if kind == "registered":
                reg = msg.registered
                self.window = self.window or reg.window
                self.chunk = self.chunk or (self.window if self.drafter.cheap else reg.chunk)
                self.vocab = reg.vocab_size or None
                self.cache_batches = reg.batches
                self.attaches += 1
                self.connected.set()
                self._outage_since = None
                log.info("attached to %s as %s (target %s; drafting with %s, %s)", self.cache,
                         self.device_id, reg.target_model, self.drafter.name,
                         f"trees of width {self.tree_width}" if self.tree_width > 1 else "chains")
            elif kind == "assignment":
                self._apply_assignment(msg.assignment)
            elif kind == "commit":
                self._apply_commit(msg.commit)
            elif kind == "closed":
                self.book.close(msg.closed.session_id)
            elif kind == "ack":
                if self.metrics is not None:
                    self.metrics.ack_received(msg.ack.session_id, msg.ack.start, msg.ack.code)
                if msg.ack.code != grpc.StatusCode.OK.value[0]:
                    log.debug("chunk refused: %s", msg.ack.message)
                    self._forget_if_gone(msg.ack)
                    if self.tree_width > 1 and "tree" in msg.ack.message and \
                            msg.ack.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]:
                        log.warning("the cache refuses tree chunks (%s): drafting chains",
                                    msg.ack.message)
                        self.tree_width = 1
            self.cond.notify_all()

    def _forget_if_gone(self, ack: pb.ChunkAck) -> None:
        """A session the cache no longer has, or has finished, whose close we never got (the
        verifier died, say): drop it so that it does not hold a KV slot for ever."""
        if ack.code == grpc.StatusCode.NOT_FOUND.value[0] or "finished" in ack.message:
            self.book.close(ack.session_id)

    def _apply_batch(self, batch: pb.CacheBatch, link) -> None:
        """A CacheBatch's messages, in order; a batch inside it breaks the protocol."""
        for msg in batch.messages:
            if msg.WhichOneof("kind") == "batch":
                raise ConnectionError("the cache sent a batch inside a batch")
            link.heard(msg)
            self._apply(msg)

    def _apply_assignment(self, a: pb.Assignment) -> None:
        try:
            params = params_from_pb(a.sampling)
            self._check_ids(a.tokens)
            self._check_room(a.session_id)
        except ConfigError as e:  # not a session this drafter can draft for
            self.book.assign(a.session_id, list(a.tokens), SamplingParams(), a.epoch)
            self._refuse_session(a.session_id, len(a.tokens), str(e))
            return
        self.book.assign(a.session_id, list(a.tokens), params, a.epoch,
                         a.output_end if a.HasField("output_end") else None)

    def _check_room(self, sid: str) -> None:
        """A session beyond ``max_sessions`` drafted for at once (0: no limit) is refused: a
        cache that assigns more than the board registered for (a hostile one sent 30 sessions
        of 1.3M tokens to a board of 8: 1.5 GB) does not fill the board's memory."""
        if self.max_sessions > 0 and sum(
                1 for s, t in self.book.targets.items()
                if s != sid and not t.refused) >= self.max_sessions:
            raise ConfigError(f"the cache assigned more sessions than this board drafts for "
                              f"at once (--max-sessions {self.max_sessions})")

    def _check_ids(self, tokens) -> None:
        """Token ids the cache sends are the target's: outside its vocabulary, no drafter's
        model may read them (on a GPU an embedding read past its end breaks the device)."""
        if self.vocab is None:
            return
        try:
            check_draft_ids(tokens, self.vocab)  # the stores' own check of ids entering
        except ValueError as e:
            raise ConfigError(f"the cache sent token ids outside the target's vocabulary: "
                              f"{e}") from None

    def _refuse_session(self, sid: str, start: int | None, why: str) -> None:
        """Draft no more for ``sid``; its idle chunk sent at ``start`` (None: by the caller)."""
        target = self.book.targets[sid]
        target.opening, target.refused, target.idle = None, True, True
        log.warning("drafter %s refuses session %s: %s", self.device_id, sid, why)
        if start is None:
            self.refused += 1
        else:
            self.refuse(sid, target, start, why)

    def _apply_commit(self, c: pb.Commit) -> None:
        if c.is_fix and self.metrics is not None:
            self.metrics.fix_received()
        if c.is_fix and c.session_id in self.book.targets:
            try:
                self._check_ids((c.fix_token, *c.fix_more))
            except ConfigError as e:  # the fix is not applied; its idle chunk follows, under
                self._refuse_session(c.session_id, None, str(e))  # the fix's epoch
        if c.is_fix:
            self.book.fix(c.session_id, c.epoch, c.fix_position, (c.fix_token, *c.fix_more))
        target = self.book.commit(c.session_id, c.epoch, c.committed_end,
                                  c.wanted if c.HasField("wanted") else None)
        if target is not None and target.refused and c.epoch >= target.epoch:
            # the verifier decodes it alone, and a commit may have reset the cache's idle flag
            # (a fix does): say it again
            self._send_idle(c.session_id, target, target.committed_end)
