"""The verifier's Prometheus metrics, named as vLLM names its own with the ``edgespec:`` prefix.

Speculative decoding (counted per verification step, once per committed verdict):
``edgespec:spec_decode_num_drafts_total`` (verified non-empty drafts),
``edgespec:spec_decode_num_draft_tokens_total``, ``edgespec:spec_decode_num_accepted_tokens_total``,
``edgespec:spec_decode_num_accepted_tokens_per_pos_total{position}`` and
``edgespec:spec_decode_num_drafted_tokens_per_pos_total{position}`` (verified drafts that held
a token there, a tree by its longest path: the acceptance at a position is the first over the
second); per device at a session's
end: ``edgespec:device_draft_tokens_total{device}``,
``edgespec:device_accepted_tokens_total{device}``, ``edgespec:device_drafts_total{device}``.
Requests: ``edgespec:prompt_tokens_total``, ``edgespec:generation_tokens_total``,
``edgespec:request_success_total{finished_reason}``, ``edgespec:request_failure_total``. Latency
histograms: ``edgespec:time_to_first_token_seconds``, ``edgespec:inter_token_latency_seconds``,
``edgespec:e2e_request_latency_seconds``. Batches: ``edgespec:batch_size_sessions``,
``edgespec:batch_size_tokens``,
``edgespec:step_seconds{phase="prefill"|"wait"|"forward"|"commit"}``,
``edgespec:rested_steps_total`` (steps whose drafters rested: drafting measured slower than
resting at that batch size, ``edgespec.engine.drafting_worth``),
``edgespec:steps_run_ahead_total`` (steps whose forward was launched during the step before,
``edgespec.engine.decode_ahead``: their ``forward`` phase is the wait for their verdicts),
``edgespec:forward_failures_total`` (a step's forwards that raised: a batch's, whose sessions
are then verified one by one, a session's alone, a prefill's).
Gauges read at scrape time:
``edgespec:num_requests_running``, ``edgespec:num_requests_waiting``,
``edgespec:num_requests_prefilling``, ``edgespec:kv_slots_free``. The server's cost:
``edgespec:server_cpu_seconds_total`` (CPU seconds of this process and its children, an embedded
Redis included, read from /proc at scrape time): its rate over
``edgespec:generation_tokens_total``'s is the CPU seconds a committed token costs, and
``edgespec:generation_tokens_total`` over ``edgespec:batch_size_sessions_count`` the tokens a
verification forward commits. Drafters' link health, per device (``edgespec.engine.lateness``):
``edgespec:drafter_late{device}``, ``edgespec:drafter_missed_deadline_total{device}``,
``edgespec:drafter_unwaited_steps_total{device}``, ``edgespec:drafter_marked_late_total{device}``,
``edgespec:drafter_waited_seconds_total{device}``, and per session and step
``edgespec:drafter_session_steps_total{device}``,
``edgespec:drafter_ready_drafts_total{device}``, ``edgespec:drafter_verified_drafts_total{device}``,
``edgespec:drafter_empty_drafts_total{device,after}`` (asked, held none; ``after``:
``opening``, ``fix``, ``again`` or ``other``); ``edgespec:request_refused_deadline_total``: new
calls refused for their deadline (``pace``).
Kernels (``edgespec.runner.kernel_set``): ``edgespec:kernel_set_info{fingerprint, kernels,
products, attention, device}`` (value 1) and ``edgespec:sessions_kernels_switched_total``, the
sessions continued here whose output so far another kernel set decoded.
CUDA graphs (``edgespec.runner.step_graphs``, a GPU verifier): ``edgespec:cuda_graph_buckets``,
``edgespec:cuda_graphs_captured``, ``edgespec:cuda_graphs_failed`` (1: steps run eagerly) and
``edgespec:cuda_graph_replays_total``.
The verifier's own drafts for boards' empty ones (``--fill-drafts``):
``edgespec:fill_draft_tokens_total{device}``, ``edgespec:fill_accepted_tokens_total{device}``
(finished sessions; counted in ``spec_decode_num_draft_tokens_total`` too).
The draft head (``--head``): ``edgespec:head_draft_tokens_total``,
``edgespec:head_accepted_tokens_total``, and gauges ``edgespec:head_version`` and
``edgespec:head_held_out_tokens_per_step`` (``--learn`` moves both). ``--auto``:
``edgespec:auto_stack_steps_total{stack}`` (none, drafter, head, drafter+head). Lossy modes
(``--verify loose``, ``--verify pad:DIR``): ``edgespec:lenient_accepted_tokens_total{mode}``, the
accepted draft tokens exact verification would have rejected (finished sessions), and
``edgespec:lossy_requests_total{mode}``.

Label cardinality stays bounded: a device id may be a label (a fleet has a bounded number of
boards, and the cache forgets boards gone for long), a session id never is.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as Counter_
from collections import OrderedDict, deque
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from edgespec.config import LOSSY_MODES
from .metric_collectors import CpuCollector, DeviceLabels, GraphCollector, LinkCollector

disable_created_metrics()  # no "_created" series next to every counter and histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MAX_POSITIONS = 32  # per-position acceptance counted for draft positions below this
# devices whose finished sessions' drafts the Status RPC reads (the least recently finished
# forgotten first: ids come from devices, the table stays bounded)
MAX_TRACKED_DEVICES = 4096


class VerifierMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = self.registry = registry
        self.batch_counts: Counter_[int] = Counter_()  # sessions per forward -> forwards (exact)
        self.step_totals = {"steps": 0, "wait_s": 0.0, "forward_s": 0.0, "commit_s": 0.0,
                            "drafted": 0, "accepted": 0, "rested": 0}
        # steps of one token a row (rested, or nothing drafted), the server alone's kind of
        # step, by rows: {rows: [steps, forward seconds]}
        self.plain_by_rows: dict[int, list] = {}
        self.committed = 0  # tokens committed over all sessions (the Status RPC's cost)
        self.rested_steps = Counter("edgespec:rested_steps",
                                    "Verification steps whose drafters rested: drafting "
                                    "measured fewer tokens a second than resting",
                                    registry=r)
        self.steps_run_ahead = Counter("edgespec:steps_run_ahead",
                                       "Verification steps whose forward was launched during "
                                       "the step before (decode steps run ahead)", registry=r)
        self.forward_failures = Counter("edgespec:forward_failures",
                                        "Forwards that raised: a batch's (its sessions then "
                                        "verified one by one), a session's alone, a prefill's",
                                        registry=r)
        self.num_drafts = Counter("edgespec:spec_decode_num_drafts",
                                  "Verified non-empty drafts", registry=r)
        self.draft_tokens = Counter("edgespec:spec_decode_num_draft_tokens",
                                    "Draft tokens verified", registry=r)
        self.accepted_tokens = Counter("edgespec:spec_decode_num_accepted_tokens",
                                       "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter("edgespec:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the draft",
                                        ["position"], registry=r)
        self.drafted_per_pos = Counter("edgespec:spec_decode_num_drafted_tokens_per_pos",
                                       "Verified drafts that held a token, by position",
                                       ["position"], registry=r)
        self.device_drafts = Counter("edgespec:device_drafts", "Verified drafts by drafter",
                                     ["device"], registry=r)
        self.device_draft_tokens = Counter("edgespec:device_draft_tokens",
                                           "Draft tokens verified, by drafter", ["device"],
                                           registry=r)
        self.device_accepted = Counter("edgespec:device_accepted_tokens",
                                       "Draft tokens accepted, by drafter", ["device"],
                                       registry=r)
        self.prompt_tokens = Counter("edgespec:prompt_tokens", "Prompt tokens admitted",
                                     registry=r)
        self.generation_tokens = Counter("edgespec:generation_tokens",
                                         "Tokens generated (committed)", registry=r)
        self.success = Counter("edgespec:request_success", "Finished requests",
                               ["finished_reason"], registry=r)
        self.failure = Counter("edgespec:request_failure", "Requests that failed", registry=r)
        self.refused_pace = Counter(
            "edgespec:request_refused_deadline",
            "New calls refused at once because the measured pace and the work ahead would not "
            "finish them within their deadline", registry=r)
        self.ttft = Histogram("edgespec:time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("edgespec:inter_token_latency_seconds",
                             "Time between committed tokens", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("edgespec:e2e_request_latency_seconds", "Request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.batch_sessions = Histogram("edgespec:batch_size_sessions",
                                        "Sessions per verification forward",
                                        buckets=SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram("edgespec:batch_size_tokens",
                                      "Tokens per verification forward", buckets=SIZE_BUCKETS,
                                      registry=r)
        self.step_seconds = Histogram("edgespec:step_seconds",
                                      "Verification step time by phase", ["phase"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("edgespec:num_requests_running", "Sessions in KV slots",
                             registry=r)
        self.waiting = Gauge("edgespec:num_requests_waiting", "Requests queued for a slot",
                             registry=r)
        self.kv_free = Gauge("edgespec:kv_slots_free", "Free KV slots", registry=r)
        self.prefilling = Gauge("edgespec:num_requests_prefilling",
                                "Sessions in KV slots waiting for their prompts' prefill",
                                registry=r)
        self.fill_tokens = Counter("edgespec:fill_draft_tokens",
                                   "Tokens the verifier drafted itself for its boards' empty "
                                   "drafts (--fill-drafts; finished sessions)", ["device"],
                                   registry=r)
        self.fill_accepted = Counter("edgespec:fill_accepted_tokens",
                                     "Of the verifier's fill tokens, those accepted (finished "
                                     "sessions)", ["device"], registry=r)
        self.head_tokens = Counter("edgespec:head_draft_tokens",
                                   "Tokens the verifier's draft head proposed (finished "
                                   "sessions)", registry=r)
        self.head_accepted = Counter("edgespec:head_accepted_tokens",
                                     "Draft-head tokens accepted (finished sessions)",
                                     registry=r)
        self.auto_stacks = Counter("edgespec:auto_stack_steps",
                                   "--auto: session steps by the draft sources chosen "
                                   "(finished sessions)", ["stack"], registry=r)
        self.lenient_tokens = Counter("edgespec:lenient_accepted_tokens",
                                      "Accepted draft tokens that exact verification would "
                                      "have rejected, by lossy mode (finished sessions)",
                                      ["mode"], registry=r)
        self.lossy_requests = Counter("edgespec:lossy_requests",
                                      "Finished sessions verified in a lossy mode", ["mode"],
                                      registry=r)
        self.head_version = Gauge("edgespec:head_version",
                                  "The serving draft head's version (0: as loaded; --learn "
                                  "adds one a swap)", registry=r)
        self.head_held_out = Gauge("edgespec:head_held_out_tokens_per_step",
                                   "The serving head's tokens per step where last measured "
                                   "(distill's validation, then --learn's held-out traffic)",
                                   registry=r)
        self.model_info = Gauge("edgespec:model_info", "The target that serves (value 1)",
                                ["dtype"], registry=r)
        self.kernel_set_info = Gauge(
            "edgespec:kernel_set_info", "The runner's kernel set (value 1): its fingerprint, "
            "kernels, products, attention and device", ["fingerprint", "kernels", "products",
                                                        "attention", "device"], registry=r)
        self.kernels_switched = Counter(
            "edgespec:sessions_kernels_switched",
            "Sessions continued here though other kernels decoded their output so far (a "
            "resume or re-creation from a replica with another kernel set fingerprint): their "
            "output differs from either's target-only decoding from that position", registry=r)
        self.handed_over = Counter(
            "edgespec:sessions_handed_over", "Running sessions handed to an attached drafter: "
            "admitted while none had room (no_board), or their drafter gone for "
            "--handover-after, 30 s by default (board_gone)", ["reason"], registry=r)
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) for throughput
        # device -> [drafts, drafted, accepted], the most recently finished last
        self._by_device: OrderedDict[str, list[int]] = OrderedDict()
        self.device_labels = DeviceLabels()
        self._head = [0, 0]  # head tokens proposed, accepted
        self._lock = threading.Lock()
        r.register(CpuCollector())

    def bind_model(self, dtype: str, kernel_set=None) -> None:
        """The served target's dtype, as a label of ``edgespec:model_info``, and its runner's
        ``KernelSet`` as ``edgespec:kernel_set_info``'s labels."""
        self.model_info.labels(dtype=dtype).set(1)
        if kernel_set is not None:
            self.kernel_set_info.labels(
                fingerprint=kernel_set.fingerprint, kernels=kernel_set.kernels,
                products=kernel_set.products, attention=kernel_set.attention,
                device=kernel_set.device).set(1)

    def bind_head(self, head) -> None:
        """Gauges of a ``HeadProposer``, read at scrape time."""
        self.head_version.set_function(lambda: head.version)
        self.head_held_out.set_function(lambda: head.held_out)

    def head_totals(self) -> tuple[int, int]:
        """(proposed, accepted) head tokens so far."""
        with self._lock:
            return self._head[0], self._head[1]

    def bind_links(self, snapshot) -> None:
        """Each drafter's link health read at scrape time: ``snapshot() -> {device:
        DrafterLink}`` (``edgespec.engine.lateness``)."""
        self.registry.register(LinkCollector(snapshot, self.device_labels))

    def bind_graphs(self, state) -> None:
        """The runner's CUDA graphs read at scrape time: ``state() -> GraphState`` or None
        without graphs (``edgespec.runner.step_graphs``)."""
        self.registry.register(GraphCollector(state))

    def bind_load(self, load, free_slots, prefilling=None) -> None:
        """Gauges read at scrape time: ``load() -> (running, waiting)``, ``free_slots()``,
        ``prefilling()`` (of the running, those whose prompts are being prefilled)."""
        self.running.set_function(lambda: load()[0])
        self.waiting.set_function(lambda: load()[1])
        self.kv_free.set_function(free_slots)
        if prefilling is not None:
            self.prefilling.set_function(prefilling)

    # -- hooks the scheduler calls ------------------------------------------------------------
    def step(self, report) -> None:
        """One verification step (``edgespec.engine.spec_engine.StepReport``)."""
        self.batch_sessions.observe(report.sessions)
        self.batch_counts[report.sessions] += 1
        totals = self.step_totals
        totals["steps"] += 1
        totals["wait_s"] += report.take_s
        totals["forward_s"] += report.forward_s
        totals["commit_s"] += report.commit_s
        totals["drafted"] += report.drafted
        totals["accepted"] += report.accepted
        if report.rested:
            totals["rested"] += 1
            self.rested_steps.inc()
        if report.ran_ahead:
            self.steps_run_ahead.inc()
        # (a step that only delivered an earlier step's verdicts ran no forward: not counted)
        # (a step run ahead's forward time is what was left of it: not a plain step's cost)
        if report.tokens == report.sessions and report.forward_s > 0 and not report.ran_ahead:
            plain = self.plain_by_rows.setdefault(report.sessions, [0, 0.0])
            plain[0] += 1
            plain[1] += report.forward_s
        self.batch_tokens.observe(report.tokens)
        self.step_seconds.labels("wait").observe(report.take_s)
        self.step_seconds.labels("forward").observe(report.forward_s)
        self.step_seconds.labels("commit").observe(report.commit_s)
        self.num_drafts.inc(report.drafts)
        self.draft_tokens.inc(report.drafted)
        self.accepted_tokens.inc(report.accepted)
        for pos, n in enumerate(report.accepted_per_pos[:MAX_POSITIONS]):
            if n:
                self.accepted_per_pos.labels(str(pos)).inc(n)
        for pos, n in enumerate(report.drafted_per_pos[:MAX_POSITIONS]):
            if n:
                self.drafted_per_pos.labels(str(pos)).inc(n)

    def prefilled(self, seconds: float) -> None:
        """A step's chunked prefill (before its verification)."""
        self.step_seconds.labels("prefill").observe(seconds)

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def tokens(self, n: int, since_last_s: float | None, since_start_s: float) -> None:
        """``n`` tokens committed for a session; ``since_last_s`` None for its first ones."""
        self.generation_tokens.inc(n)
        if since_last_s is None:
            self.ttft.observe(since_start_s)
        else:
            self.itl.observe(since_last_s / max(n, 1))
        now = time.monotonic()
        with self._lock:
            self.committed += n
            self._recent.append((now, n))
            while self._recent and self._recent[0][0] < now - 60:
                self._recent.popleft()

    def finished(self, device: str | None, stats, reason: str, latency_s: float,
                 earlier: Sequence[tuple[str, tuple[int, ...]]] = ()) -> None:
        """A session ended well. ``earlier``: the boards it had before ``device`` (it was
        handed over), each with its share of the session's board figures (``board_figures``)
        as the hand-over found it: each board credited with its own, ``device`` the rest."""
        self.success.labels(reason).inc()
        self.e2e.observe(latency_s)
        self.head_tokens.inc(stats.head_tokens)
        self.head_accepted.inc(stats.head_accepted)
        for stack, n in stats.stacks.items():
            self.auto_stacks.labels(stack).inc(n)
        if stats.lossy:
            mode = stats.verify if stats.verify in LOSSY_MODES else "loose"
            self.lossy_requests.labels(mode).inc()
            self.lenient_tokens.labels(mode).inc(stats.lenient_tokens)
        with self._lock:
            self._head[0] += stats.head_tokens
            self._head[1] += stats.head_accepted
        for board, share in earlier:
            self._credit_device(board, *share)
        self._credit_device(device, *board_share(stats, earlier))

    def _credit_device(self, device: str | None, drafts: int, tokens: int, accepted: int,
                       fill_tokens: int, fill_accepted: int) -> None:
        """``device``'s share of a finished session's drafts (``board_figures``)."""
        if device and (drafts or fill_tokens):
            # drafters may choose their ids: the series stay bounded, a device past the first
            # MAX_DEVICES counted under "other" (its own figures still in Status); the board's
            # own drafts and the verifier's fills for its empty ones counted apart
            label = self.device_labels.of(device)
            self.device_drafts.labels(label).inc(drafts)
            self.device_draft_tokens.labels(label).inc(tokens)
            self.device_accepted.labels(label).inc(accepted)
            if fill_tokens:
                self.fill_tokens.labels(label).inc(fill_tokens)
                self.fill_accepted.labels(label).inc(fill_accepted)
            with self._lock:
                agg = self._by_device.get(device)
                if agg is None:
                    agg = self._by_device[device] = [0, 0, 0]
                    if len(self._by_device) > MAX_TRACKED_DEVICES:
                        self._by_device.popitem(last=False)
                else:
                    self._by_device.move_to_end(device)
                agg[0] += drafts
                agg[1] += tokens
                agg[2] += accepted

    def failed(self) -> None:
        self.failure.inc()

    def refused_for_pace(self) -> None:
        self.refused_pace.inc()

    # -- reads for the Status RPC ---------------------------------------------------------------
    def tokens_per_s_last_minute(self) -> float:
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._recent if t >= now - 60]
        return sum(n for _, n in recent) / 60.0

    def server_cost(self) -> dict:
        """What the server has spent since it started: its CPU seconds (None where /proc
        cannot be read), committed tokens, verification forwards, draft tokens verified and
        accepted."""
        from edgespec.runner.cpu_time import process_tree_cpu_s

        t = self.step_totals
        with self._lock:
            committed = self.committed
        return {"cpu_s": process_tree_cpu_s(), "committed_tokens": committed,
                "forwards": int(t["steps"]), "draft_tokens": int(t["drafted"]),
                "accepted_tokens": int(t["accepted"])}

    def device_draft_counts(self, device: str) -> tuple[int, int, int]:
        """(drafts verified, their tokens, those accepted) of the sessions this drafter served,
        once each finished."""
        with self._lock:
            drafts, drafted, accepted = self._by_device.get(device, (0, 0, 0))
        return drafts, drafted, accepted


def board_figures(stats) -> tuple[int, ...]:
    """A session's board figures: its board's drafts verified, their tokens, those accepted,
    and the verifier's fill tokens for its empty drafts, those accepted."""
    return (stats.drafter_drafts, stats.drafter_tokens, stats.drafter_accepted,
            stats.fill_tokens, stats.fill_accepted)


def board_share(stats, earlier: Sequence[tuple[str, tuple[int, ...]]] = ()
                ) -> tuple[int, ...]:
    """The session's ``board_figures`` less the shares of its ``earlier`` boards: its current
    board's (the one it has, or is handed from)."""
    rest = board_figures(stats)
    for _, share in earlier:
        rest = tuple(a - b for a, b in zip(rest, share))
    return rest


def acceptance(drafts: int, drafted: int, accepted: int) -> tuple[float, float]:
    """(acceptance rate, mean acceptance length) of ``drafts`` drafts of ``drafted`` tokens,
    ``accepted`` of them accepted (0 and 1 where there are none)."""
    rate = accepted / drafted if drafted else 0.0
    return rate, (1 + accepted / drafts) if drafts else 1.0
