"""The draft cache's Prometheus metrics (``edgespec:`` prefix, as the verifier's).

``edgespec:drafters_attached`` (gauge: Attach streams open now);
``edgespec:drafter_attaches_total{device}`` (registrations accepted, reconnections included);
``edgespec:cache_chunks_total{result="ok"|"refused", code}`` (draft chunks received, on an
Attach stream or by PushDraft; ``code`` is the gRPC status code name of the answer: ``OK`` for
a stored chunk, ``FAILED_PRECONDITION`` for a stale or misplaced one, ...);
``edgespec:cache_draft_tokens_total`` (draft tokens stored).

Label values stay bounded: gRPC code names only, and device ids, the first
``MAX_DEVICE_LABELS`` of them (any later one is counted under ``other``: drafters choose their
ids); a session id is never a label.
"""

from __future__ import annotations

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

MAX_DEVICE_LABELS = 256  # as the verifier's metrics (verifier_node.metric_collectors.MAX_DEVICES)


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.attached = Gauge("edgespec:drafters_attached", "Drafter Attach streams open now",
                              registry=r)
        self.attaches = Counter("edgespec:drafter_attaches",
                                "Drafter registrations accepted, by device", ["device"],
                                registry=r)
        self.chunks = Counter("edgespec:cache_chunks",
                              "Draft chunks received, by result and gRPC status code",
                              ["result", "code"], registry=r)
        self.draft_tokens = Counter("edgespec:cache_draft_tokens", "Draft tokens stored",
                                    registry=r)
        self.chunks.labels("ok", grpc.StatusCode.OK.name)  # the usual series exist from start
        self._devices: set[str] = set()  # those with their own label

    # -- hooks the service calls ------------------------------------------------------------------
    def attach(self, device: str) -> None:
        self.attached.inc()
        if device not in self._devices:
            if len(self._devices) >= MAX_DEVICE_LABELS:
                device = "other"  # drafters choose their ids: the series stay bounded
            else:
                self._devices.add(device)
        self.attaches.labels(device).inc()

    def detach(self) -> None:
        self.attached.dec()

    def chunk_stored(self, kept: int) -> None:
        self.chunks.labels("ok", grpc.StatusCode.OK.name).inc()
        self.draft_tokens.inc(kept)

    def chunk_refused(self, code: grpc.StatusCode, n: int = 1) -> None:
        name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
        self.chunks.labels("refused", name).inc(n)
