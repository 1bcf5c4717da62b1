"""An edge drafter's Prometheus metrics (``edgespec:`` prefix, as the verifier's), served by
``edgespec drafter --metrics-port``.

``edgespec:drafter_chunks_sent_total`` (draft chunks sent to the cache, idle ones included);
``edgespec:drafter_draft_tokens_total`` (drafted tokens sent);
``edgespec:drafter_fixes_received_total`` (commits that carried a fix);
``edgespec:drafter_chunks_refused_total{code}`` (chunks the cache answered with a code other
than OK; ``code``: the gRPC status code name);
``edgespec:drafter_link_rtt_seconds`` (histogram: from queuing a chunk on the Attach stream to
receiving its ChunkAck, matched by (session id, start); only chunks that ask for their ack when
stored are timed, one in ``agent.ACK_EVERY``).

The drafting loop's own counts (``edgespec.drafters.chunk_pace.LoopCounts``, read at scrape
time): ``edgespec:drafter_chunks_drafted_total`` (drafting jobs that drafted a token),
``edgespec:drafter_tokens_drafted_total`` (tokens drafted, each once; ``draft_tokens`` counts
every token sent, again when sent again),
``edgespec:drafter_chunks_dropped_total{reason}`` (drafted chunks never sent: ``disagreed``, a
fix threw their tokens away; ``closed``, the session ended meanwhile; ``failed``),
``edgespec:drafter_chunks_resent_total`` (chunks of tokens a fix agreed with, sent again at the
fix's end), ``edgespec:drafter_tokens_kept_total`` (drafted tokens a fix agreed with: kept, not
drafted again), ``edgespec:drafter_tokens_discarded_total`` (drafted tokens not yet in the cache
a fix disagreed with); from a commit to the session's next usable draft:
``edgespec:drafter_commits_seen_total`` (moves of a committed end), ``..._commits_ahead_total``
(those the tokens already sent reached past: usable at once), ``..._commits_served_total`` (those
a later chunk covering the new end served) and
``edgespec:drafter_commit_to_draft_seconds_total{stage}`` (their seconds, ``total`` from the
commit's arrival to the chunk handed on, of which ``queued`` before its job began and
``drafting`` its drafting; the chunk's trip to the cache is ``drafter_link_rtt_seconds``);
gauges ``edgespec:drafter_verifier_step_seconds`` (the step interval the
loop sees in the commits) and ``edgespec:drafter_seconds_per_token`` (its drafting speed), which
size its chunks.

A drafter process is one device, so its series carry no device label: Prometheus adds
``instance`` (and the scrape config may add ``device``). Session ids are never labels.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from edgespec.drafters.draft_book import DraftBook

DROP_REASONS = ("disagreed", "closed", "failed")
# the codes the cache refuses a chunk with (``cache_service.chunk_checks``)
REFUSAL_CODES = ("INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "PERMISSION_DENIED")

RTT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0,
               10.0)
MAX_PENDING = 1 << 14  # chunks awaiting their ack; beyond it those in flight are not timed
_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


class DrafterMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.chunks_sent = Counter("edgespec:drafter_chunks_sent",
                                   "Draft chunks sent to the cache (idle chunks included)",
                                   registry=r)
        self.draft_tokens = Counter("edgespec:drafter_draft_tokens", "Drafted tokens sent",
                                    registry=r)
        self.fixes = Counter("edgespec:drafter_fixes_received",
                             "Commits received that carried a fix", registry=r)
        self.refused = Counter("edgespec:drafter_chunks_refused",
                               "Chunks the cache refused, by gRPC status code", ["code"],
                               registry=r)
        for code in REFUSAL_CODES:  # each series from the start, at 0 until a refusal
            self.refused.labels(code)
        self.rtt = Histogram("edgespec:drafter_link_rtt_seconds",
                             "From queuing a chunk to receiving its ChunkAck",
                             buckets=RTT_BUCKETS, registry=r)
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], deque[float]] = {}  # (session, start) -> times
        self._n_pending = 0
        self.loop = _LoopCollector()
        registry.register(self.loop)

    def watch(self, book: DraftBook) -> None:
        """Read this drafting loop's counts at scrape time."""
        self.loop.book = book

    # -- hooks the agent calls --------------------------------------------------------------------
    def chunk_sent(self, session_id: str, start: int, tokens: int, acked: bool = True) -> None:
        """Called just before the chunk is queued on the stream (so its ack cannot come first);
        ``acked``: the cache answers it even when stored (a quiet chunk's round trip is not
        timed: its ack comes only with a refusal)."""
        self.chunks_sent.inc()
        if tokens:
            self.draft_tokens.inc(tokens)
        if not acked:
            return
        key = (session_id, start)
        with self._lock:
            if self._n_pending >= MAX_PENDING:  # acks that never came: start afresh
                self._pending.clear()
                self._n_pending = 0
            self._pending.setdefault(key, deque()).append(time.monotonic())
            self._n_pending += 1

    def ack_received(self, session_id: str, start: int, code: int) -> None:
        if code != grpc.StatusCode.OK.value[0]:
            self.refused.labels(_CODE_NAMES.get(code, "UNKNOWN")).inc()
        key = (session_id, start)
        with self._lock:
            times = self._pending.get(key)
            if not times:
                return  # not ours, or sent before a reconnection
            sent = times.popleft()
            self._n_pending -= 1
            if not times:
                del self._pending[key]
        self.rtt.observe(time.monotonic() - sent)

    def fix_received(self) -> None:
        self.fixes.inc()

    def link_lost(self) -> None:
        """The stream ended: the chunks in flight will never be acknowledged."""
        with self._lock:
            self._pending.clear()
            self._n_pending = 0


class _LoopCollector(Collector):
    """The drafting loop's counters and pace, read from its book at scrape time (plain ints
    and floats: a read racing the loop is at most one update behind)."""

    def __init__(self) -> None:
        self.book: DraftBook | None = None

    def describe(self):
        return []  # names are checked when collected

    def collect(self):
        book = self.book
        if book is None:
            return
        c = book.counts
        for name, text, v in [
                ("chunks_drafted", "Drafting jobs that drafted at least one token",
                 c.chunks_drafted),
                ("tokens_drafted", "Tokens drafted (each once, sent or not)",
                 c.tokens_drafted),
                ("chunks_resent", "Chunks of drafted tokens a fix agreed with, sent again",
                 c.chunks_resent),
                ("tokens_kept", "Drafted tokens a fix agreed with (kept, not drafted again)",
                 c.tokens_kept),
                ("tokens_discarded", "Drafted tokens not yet in the cache a fix disagreed with",
                 c.tokens_discarded)]:
            yield CounterMetricFamily(f"edgespec:drafter_{name}", text, value=v)
        for name, text, v in [
                ("commits_seen", "Moves of a session's committed end (commits and fixes) seen",
                 c.commits_seen),
                ("commits_ahead", "Commits the tokens already sent reached past (drafted ahead)",
                 c.commits_ahead),
                ("commits_served", "Commits a later chunk served (covering the new end)",
                 c.commits_served)]:
            yield CounterMetricFamily(f"edgespec:drafter_{name}", text, value=v)
        stages = CounterMetricFamily(
            "edgespec:drafter_commit_to_draft_seconds",
            "Seconds from a commit to the chunk that served it, by stage", labels=["stage"])
        for stage, v in (("total", c.served_s), ("queued", c.queued_s),
                         ("drafting", c.drafting_s)):
            stages.add_metric([stage], v)
        yield stages
        dropped = CounterMetricFamily("edgespec:drafter_chunks_dropped",
                                      "Drafted chunks never sent, by why", labels=["reason"])
        for reason in DROP_REASONS:
            dropped.add_metric([reason], c.dropped.get(reason, 0))
        yield dropped
        pace = book.pace
        yield GaugeMetricFamily("edgespec:drafter_verifier_step_seconds",
                                "The verifier's step interval as the commits show it",
                                value=pace.step_s or 0.0)
        yield GaugeMetricFamily("edgespec:drafter_seconds_per_token",
                                "Seconds this drafter takes per drafted token",
                                value=pace.token_s or 0.0)
