"""A board every one of whose chunks the verifier overtakes, run as its own process by the tests
(tests/test_slow_board.py): an edge drafter agent, over real gRPC to the cache, whose MaG drafter
returns each chunk only once the verifier has committed past the chunk's start (a step decoded the
session without it) or after ``--hold-s`` (an empty draft at once: it is no chunk, and says that
none is coming). Such a board is slower than the verifier's step by
construction, whatever the machine's speed: the case where every chunk used to be dropped by the
fix that overtook it.

    python tests/overtaken_board.py --cache ADDRESS --device-id ID --auth-token T

It stops on SIGTERM and prints its drafting loop's counts as one JSON line (``counts: {...}``)
before it exits with status 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading

from drafter_node.agent import DrafterAgent
from drafter_node.edge_drafter import build_edge_drafter
from edgespec.drafters import Drafter, DraftSession


class OvertakenDrafter(Drafter):
    """``inner``'s chunks, each held until the verifier committed past its start."""

    def __init__(self, inner: Drafter, hold_s: float):
        self.inner, self.hold_s = inner, hold_s
        self.name, self.wait_ms, self.uses_fleet = inner.name, inner.wait_ms, inner.uses_fleet
        self.agent: DrafterAgent | None = None

    def open(self, tokens, params) -> DraftSession:
        session = self.inner.open(tokens, params)
        propose_tree = session.propose_tree

        def overtaken(k: int, width: int):
            start = len(session.tokens)
            out = propose_tree(k, width)
            agent = self.agent
            assert agent is not None
            if len(out):  # an empty draft is no chunk: it says at once that none is coming
                with agent.cond:
                    agent.cond.wait_for(lambda: _committed_past(agent, session, start),
                                        timeout=self.hold_s)
            return out

        session.propose_tree = overtaken  # type: ignore[method-assign]
        return session


def _committed_past(agent: DrafterAgent, session: DraftSession, start: int) -> bool:
    """Whether the verifier committed past ``start`` in the session ``session`` drafts for
    (or the session is gone)."""
    for t in agent.book.targets.values():
        if t.draft is session:
            return t.closed or t.committed_end > start
    return True


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", required=True)
    p.add_argument("--device-id", required=True)
    p.add_argument("--auth-token", required=True)
    p.add_argument("--hold-s", type=float, default=30.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    inner, fingerprint = build_edge_drafter("mag")
    drafter = OvertakenDrafter(inner, args.hold_s)
    # chunks of the cache's size always: this drafter's time is the verifier's, not its own
    agent = DrafterAgent(args.cache, args.device_id, drafter, fingerprint, token=args.auth_token,
                         pace=False)
    drafter.agent = agent
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    runner = threading.Thread(target=agent.run)
    runner.start()
    while runner.is_alive():
        runner.join(0.2)
    with agent.cond:
        c = agent.book.counts
        counts = {**vars(c), "dropped": dict(c.dropped)}
    print("counts: " + json.dumps(counts), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
