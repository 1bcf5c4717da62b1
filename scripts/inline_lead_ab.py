"""Inline MaG chains drafted to one lead against another, in one process, runs alternating:
bench-host's own ``measure`` (the engine, the store and MaG for real, the target answering at
once). Torch on one thread. Prints each side's median host microseconds a session-step and
writes every run's figures as JSON. The leads (the ``lead_cap`` that ``engine.inline_drafts``
reads, replaced):

- ``none``: the ask and one token past it (the thirteenth session's);
- ``board``: the lead a board keeps, 2k + 2 within the window (``draft_lead.lead_cap``; the
  eighteenth session's, and the product's);
- ``twice``: 4k + 4 within the window (tried in the thirty-eighth session, not kept: it cut
  host work and drafted worse chains on real text).

    python scripts/inline_lead_ab.py [ROUNDS] [OUT.json] [SESSIONS] [BEFORE] [AFTER]

(defaults: 6 rounds, inline-lead-ab.json, 64 sessions, none against board: the eighteenth
session's comparison)
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

import edgespec.engine.inline_drafts as inline
from edgespec.drafters.draft_lead import lead_cap
from edgespec_cli.bench.host_cost import measure

LEADS = {"none": lambda wanted, window: 0, "board": lead_cap,
         "twice": lambda wanted, window: min(window, 2 * lead_cap(wanted, 1 << 30))}


def main() -> None:
    if not hasattr(inline, "lead_cap"):  # replacing it would change nothing: say so, not a tie
        sys.exit("inline_lead_ab: engine.inline_drafts reads no lead_cap any more (it drafts "
                 "chains to the window, docs/measured/fleet-host); this script reproduces the "
                 "figures of the sessions that compared leads, with their code (git history)")
    torch.set_num_threads(1)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    out_path = sys.argv[2] if len(sys.argv) > 2 else "inline-lead-ab.json"
    sessions = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    before, after = (sys.argv[4], sys.argv[5]) if len(sys.argv) > 5 else ("none", "board")
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(rounds):
        for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
            inline.lead_cap = LEADS[after if side == "after" else before]
            m = measure("local", "mag", sessions, 64, 0.9)
            runs[side].append({"us_ss": m["host_us_per_session_step"],
                               "tok_s": m["tokens_per_s"], "steps": m["steps"],
                               "take_us": m["us_per_step"]["take"],
                               "commit_us": m["us_per_step"]["commit"],
                               "acceptance": m["acceptance_rate"]})
    inline.lead_cap = lead_cap
    for side, got in runs.items():
        print(f"{side} ({before if side == 'before' else after}): median "
              f"{statistics.median(x['us_ss'] for x in got):.1f} us a session-step, "
              f"{statistics.median(x['tok_s'] for x in got):,.0f} tokens/s, take "
              f"{statistics.median(x['take_us'] for x in got):.0f} us a step; runs "
              f"{[round(x['us_ss'], 1) for x in got]}")
    with open(out_path, "w") as f:
        json.dump({"sessions": sessions, "threads": 1, "before": before, "after": after,
                   **runs}, f, indent=1)


if __name__ == "__main__":
    main()
