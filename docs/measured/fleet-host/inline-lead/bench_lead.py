"""`edgespec bench` with the inline drafter's lead replaced (``engine.inline_drafts`` reads
``drafting_loop.lead_cap``): ``none`` (the ask and one token past it), ``board`` (the product's:
2k + 2 within the window), ``twice`` (4k + 4 within the window). Greedy, so every run's tokens
are target-only's; what the lead changes is which draft tokens a step verifies.

    python bench_lead.py twice bench --drafters mag --trees none --loose none --skip-hf \
        --skip-llamacpp --no-fleet-warm --per-category 4 --max-new-tokens 96 --threads 1 \
        --json bench-24q-lead-twice.json
"""

import sys

import edgespec.engine.inline_drafts as inline
from edgespec.drafters.drafting_loop import lead_cap

mode = sys.argv[1]
if mode == "none":
    inline.lead_cap = lambda wanted, window: 0
elif mode == "twice":
    inline.lead_cap = lambda wanted, window: min(window, 2 * lead_cap(wanted, 1 << 30))
elif mode != "board":
    sys.exit(f"unknown lead {mode!r}: none, board or twice")

from edgespec_cli.main import main  # noqa: E402 (after the lead is replaced)

sys.exit(main(sys.argv[2:]))
