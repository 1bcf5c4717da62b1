"""What a simulation run records: one ``RequestRecord`` per request, one ``RunRecord`` per
batching mode and device count. The report is computed from these alone."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field


SERVER_ONLY = "server-only"  # the baseline mode: no boards, the verifier decoding alone


def mode_name(batching: str) -> str:
    """A run's mode as reports and charts name it: batching on or off, or the baseline."""
    return "server only (no boards)" if batching == SERVER_ONLY else f"batching {batching}"


def board_share(stats: dict) -> tuple[int, int]:
    """(draft tokens, accepted) of a session's own drafter, from its final stats: the wire's
    ``drafter_*`` counts; a verifier older than them, which sends none, had no head or fill
    drafts to count apart when it counted neither (its totals are the drafter's)."""
    own = int(stats.get("drafter_tokens", 0)), int(stats.get("drafter_accepted", 0))
    if own[0] or stats.get("head_tokens") or stats.get("fill_tokens"):
        return own
    return int(stats.get("drafted", 0)), int(stats.get("accepted", 0))


@dataclass
class RequestRecord:
    device_id: str
    profile: str  # the device profile's name
    category: str  # the Spec-Bench category of the prompt
    prompt_ids: list[int]
    sent_at: float  # time.monotonic() when the request was sent
    token_times: list[float] = field(default_factory=list)  # monotonic arrival of each token
    tokens: list[int] = field(default_factory=list)  # output token ids, in order
    session_id: str = ""
    drafted: int = 0  # draft tokens the verifier checked for this session
    accepted: int = 0  # of which accepted
    mean_acceptance_length: float = 0.0  # tokens committed per verification step
    # the board's own share of drafted / accepted: the verifier's head and fill drafts left out
    board_drafted: int = 0
    board_accepted: int = 0
    error: str | None = None  # set when the request failed (then it counts no tokens)

    @property
    def done_at(self) -> float | None:
        return self.token_times[-1] if self.token_times else None

    def read(self, pieces: Iterable) -> None:
        """Record a stream's pieces (the SDK's ``StreamPiece``s) as they arrive: each token's
        arrival time, and the final piece's acceptance figures."""
        for piece in pieces:
            now = time.monotonic()
            self.tokens.extend(piece.token_ids)
            self.token_times.extend([now] * len(piece.token_ids))
            if piece.stats:
                self.drafted = int(piece.stats.get("drafted", 0))
                self.accepted = int(piece.stats.get("accepted", 0))
                self.board_drafted, self.board_accepted = board_share(piece.stats)
                self.mean_acceptance_length = float(
                    piece.stats.get("mean_acceptance_length", 0.0))


@dataclass
class RunRecord:
    # "on": sessions batched in one forward; "off": one session per forward; "server-only":
    # batched, no boards (the verifier decodes alone)
    batching: str
    devices: int
    started: float  # monotonic, when the first request was sent
    ended: float  # monotonic, when the last request ended
    requests: list[RequestRecord]
    batch_sizes: dict[int, int]  # sessions in a verification forward -> forwards of that size
    max_sessions: int = 0  # the verifier's KV slots in this run
    # the verifier's steps: {"steps", "wait_s", "forward_s", "commit_s"} summed over the run
    step_totals: dict = field(default_factory=dict)
    # the partition schedule as applied: {"fault", "links", "device", "at_s", "healed_at_s"}
    link_faults: list[dict] = field(default_factory=list)
    # each side's cores and CPU seconds over the run: {"split": text or None, "server":
    # {"cpus", "cpu_s", "verifier_cpu_s", "cache_cpu_s"}, "boards": {"cpus", "cpu_s"}}
    cpu: dict = field(default_factory=dict)
    # each drafter's loop counts at the end (``LoopCounts`` as a dict), by device id
    boards: dict = field(default_factory=dict)
    round: int = 1  # with --repeat: which of the ``rounds`` runs of this mode and count
    rounds: int = 1
