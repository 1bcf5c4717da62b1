"""The verifier's metrics read at scrape time (prometheus_client ``Collector``s), and the rule
that bounds their ``device`` label.

``LinkCollector``: each drafter's link health and drafts per device, from the engine's
``Lateness`` book (``edgespec.engine.lateness``); ``GraphCollector``: the CUDA graphs' state
(``edgespec.runner.step_graphs``); ``CpuCollector``: the server's CPU seconds, read from /proc.
``DeviceLabels``: one rule for every per-device family (``VerifierMetrics`` keeps one).
"""

from __future__ import annotations

import threading

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from edgespec.engine.lateness import DrafterLink

MAX_DEVICES = 256  # distinct device labels; later ones are counted under "other"


class DeviceLabels:
    """The ``device`` label of every per-device series: the first ``MAX_DEVICES`` devices seen
    (finishing a drafted session, or in a step) keep their own for the process's life, the
    rest share "other"; one rule for every family, so a board's series are all its own or all
    under "other"."""

    def __init__(self, cap: int = MAX_DEVICES):
        self.cap = cap
        self._own: set[str] = set()
        self._lock = threading.Lock()

    def of(self, device: str) -> str:
        with self._lock:
            if device not in self._own and len(self._own) < self.cap:
                self._own.add(device)
            return device if device in self._own else "other"


def _fold(into: DrafterLink, link: DrafterLink) -> None:
    """``link``'s counts added to ``into``'s (its late flag aside)."""
    for attr, value in vars(link).items():
        if not isinstance(value, bool):
            setattr(into, attr, getattr(into, attr) + value)


class GraphCollector(Collector):
    """``edgespec:cuda_graph_buckets``, ``edgespec:cuda_graphs_captured``,
    ``edgespec:cuda_graphs_failed`` (1 when a capture failed: steps run eagerly) and
    ``edgespec:cuda_graph_replays_total``; nothing without graphs."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        g = self.state()
        if g is None:
            return
        for name, text, value in (
                ("cuda_graph_buckets", "CUDA graph shapes the runner captures at start",
                 g.buckets),
                ("cuda_graphs_captured", "CUDA graph shapes captured", g.captured),
                ("cuda_graphs_failed", "1 when capturing failed and steps run eagerly",
                 1.0 if g.failed else 0.0)):
            family = GaugeMetricFamily(f"edgespec:{name}", text)
            family.add_metric([], value)
            yield family
        replays = CounterMetricFamily("edgespec:cuda_graph_replays", "Steps replayed from a "
                                      "CUDA graph")
        replays.add_metric([], g.replays)
        yield replays

    def describe(self):
        return []


class CpuCollector(Collector):
    """``edgespec:server_cpu_seconds_total``: this process's and its children's CPU seconds
    (never less than it last said: a child that exited and was not waited for, an orphan
    adopted by init, takes its seconds out of the tree)."""

    def __init__(self) -> None:
        self._most = 0.0

    def collect(self):
        from edgespec.runner.cpu_time import process_tree_cpu_s

        seconds = process_tree_cpu_s()
        if seconds is not None:
            seconds = self._most = max(self._most, seconds)
            yield CounterMetricFamily("edgespec:server_cpu_seconds",
                                      "CPU seconds of this server process and its children "
                                      "(an embedded Redis included)", value=seconds)

    def describe(self):
        return []


class LinkCollector(Collector):
    """Per drafter, from the verifier's steps: ``edgespec:drafter_late{device}`` (1 while its
    sessions are not waited for), ``edgespec:drafter_missed_deadline_total{device}`` (steps its
    drafts were not ready when taken), ``edgespec:drafter_unwaited_steps_total{device}`` and
    ``edgespec:drafter_marked_late_total{device}``; per session and step,
    ``edgespec:drafter_session_steps_total{device}``,
    ``edgespec:drafter_ready_drafts_total{device}`` (its draft was ready when taken) and
    ``edgespec:drafter_verified_drafts_total{device}`` (its draft held tokens);
    ``edgespec:drafter_waited_seconds_total{device}``: the steps' waits while a draft of it was
    waited for; ``edgespec:drafter_empty_drafts_total{device,after}``: session steps asked for
    a draft that held none, by what came before (``opening``, ``fix``, ``again``, ``other``:
    ``engine/lateness.EmptyDrafts``)."""

    def __init__(self, snapshot, labels: DeviceLabels):
        self.snapshot, self.labels = snapshot, labels
        # the boards summed under "other" as last seen, and the counts of those the steps'
        # table has since forgotten (kept there: a counter never goes back)
        self._others: dict[str, DrafterLink] = {}
        self._gone = DrafterLink()
        self._lock = threading.Lock()

    def _split(self, links: dict[str, DrafterLink]) -> tuple[list, DrafterLink | None, int]:
        """(the boards with series of their own, the rest summed or None, how many of the
        rest are late)."""
        own, late = [], 0
        with self._lock:
            for device in [d for d in self._others if d not in links]:
                _fold(self._gone, self._others.pop(device))
            other = DrafterLink()
            _fold(other, self._gone)
            for device, link in links.items():
                if self.labels.of(device) == "other":
                    self._others[device] = link
                    _fold(other, link)
                    late += link.late
                else:
                    own.append((device, link))
            summed = bool(self._others) or any(vars(self._gone).values())
        return own, other if summed else None, late

    def collect(self):
        own, other, late_others = self._split(self.snapshot())
        late = GaugeMetricFamily("edgespec:drafter_late", "1 while the verifier does not wait "
                                 "for this drafter's drafts (they missed its last deadlines)",
                                 labels=["device"])
        counters = [(CounterMetricFamily(f"edgespec:{name}", text, labels=["device"]), attr)
                    for name, text, attr in (
                        ("drafter_missed_deadline", "Steps that took this drafter's drafts "
                         "before all were ready: its deadline missed, or (late, or a step "
                         "that waited for none) not waited for", "missed"),
                        ("drafter_unwaited_steps", "Steps that verified this drafter's "
                         "sessions without waiting for its drafts", "unwaited"),
                        ("drafter_marked_late", "Times this drafter was found late",
                         "marked_late"),
                        ("drafter_session_steps", "Sessions of this drafter's verified in "
                         "steps (one a session and step)", "session_steps"),
                        ("drafter_ready_drafts", "Session steps whose draft from this "
                         "drafter was ready when taken", "ready_drafts"),
                        ("drafter_verified_drafts", "Session steps that verified a draft "
                         "from this drafter (it held tokens)", "verified_drafts"),
                        ("drafter_waited_seconds", "Seconds the verifier's steps waited while "
                         "a draft of this drafter was waited for", "waited_s"))]
        empty = CounterMetricFamily("edgespec:drafter_empty_drafts", "Session steps asked for "
                                    "a draft from this drafter that held none, by what came "
                                    "before: the session's opening, a fix after a verified "
                                    "draft, an empty draft again, or none of these",
                                    labels=["device", "after"])
        shown = [(device, link, float(link.late)) for device, link in own]
        if other is not None:  # past the first MAX_DEVICES: "other" (late: how many are)
            shown.append(("other", other, float(late_others)))
        for device, link, is_late in shown:
            late.add_metric([device], is_late)
            for family, attr in counters:
                family.add_metric([device], getattr(link, attr))
            for after, count in (("opening", link.empty_opening), ("fix", link.empty_after_fix),
                                 ("again", link.empty_again), ("other", link.empty_other)):
                empty.add_metric([device, after], count)
        yield late
        for family, _ in counters:
            yield family
        yield empty

    def describe(self):
        return []
