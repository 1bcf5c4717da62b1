"""Inline MaG chains drafted one token past the ask (before) against drafted to the lead a board
keeps (after, ``drafting_loop.lead_cap``), in one process, runs alternating: bench-host's own
``measure`` (the engine, the store and MaG for real, the target answering at once). Torch on one
thread. Prints each side's median host microseconds a session-step and writes every run's
figures as JSON.

    python scripts/inline_lead_ab.py [ROUNDS] [OUT.json] [SESSIONS]
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

import edgespec.engine.inline_drafts as inline
from edgespec_cli.bench.host_cost import measure


def main() -> None:
    torch.set_num_threads(1)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    out_path = sys.argv[2] if len(sys.argv) > 2 else "inline-lead-ab.json"
    sessions = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    lead = inline.lead_cap
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(rounds):
        for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
            # before: no lead, so each chain is the ask and one token past it
            inline.lead_cap = lead if side == "after" else (lambda wanted, window: 0)
            m = measure("local", "mag", sessions, 64, 0.9)
            runs[side].append({"us_ss": m["host_us_per_session_step"],
                               "tok_s": m["tokens_per_s"], "steps": m["steps"],
                               "take_us": m["us_per_step"]["take"],
                               "commit_us": m["us_per_step"]["commit"]})
    inline.lead_cap = lead
    for side, got in runs.items():
        print(f"{side}: median {statistics.median(x['us_ss'] for x in got):.1f} us a "
              f"session-step, {statistics.median(x['tok_s'] for x in got):,.0f} tokens/s, take "
              f"{statistics.median(x['take_us'] for x in got):.0f} us a step; runs "
              f"{[round(x['us_ss'], 1) for x in got]}")
    with open(out_path, "w") as f:
        json.dump({"sessions": sessions, "threads": 1, **runs}, f, indent=1)


if __name__ == "__main__":
    main()
