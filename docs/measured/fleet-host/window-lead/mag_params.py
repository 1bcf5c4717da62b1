"""MaG's parameters replayed on Spec-Bench (``lead_replay``'s references and runner), a fixed
draft length, each parameter moved alone from its default: tokens a forward against draft tokens
a forward. ``a``: the first 20 questions of each category, ``b``: the next 20. Torch on one
thread (the runner answers at once: nothing here is timed).

    python mag_params.py a > mag-params-a.txt
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
GRID = [{}, *({"tokens_per_match_token": n} for n in (1, 3, 4)),
        *({"min_ngram": n} for n in (2, 3)),
        *({"bigram_min_share": s} for s in (0.3, 0.7, 1.01)),
        *({"max_ngram": n} for n in (4, 16))]


def questions(half: str) -> tuple[list[dict], set[int]]:
    refs = json.loads((HERE / "refs-40.json").read_text())
    by: dict[str, list[dict]] = {}
    for q in refs["questions"]:
        by.setdefault(q["category"], []).append(q)
    picked = [q for c in sorted(by) for q in (by[c][:20] if half == "a" else by[c][20:])]
    return picked, set(refs["stop_ids"])


def replay(qs: list[dict], stop_ids: set[int], k: int, **params) -> tuple[float, float, float]:
    """(tokens a forward, draft tokens a forward, accepted a draft token) of MaG(**params)."""
    from edgespec.drafters.mag import MaGDrafter

    counts = lead_replay.replay_counts(qs, stop_ids, MaGDrafter(**params), k).values()
    tokens, steps, drafted, accepted = (sum(c[i] for c in counts) for i in range(4))
    return tokens / steps, drafted / steps, accepted / max(drafted, 1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    import lead_replay

    half = sys.argv[1]
    qs, stop_ids = questions(half)
    for k in (4, 8):
        for params in GRID:
            tf, df, acc = replay(qs, stop_ids, k, **params)
            print(f"half {half} k={k} {str(params):40s} tok/fwd {tf:.4f} draft/fwd {df:.3f} "
                  f"acc {acc:.3f}", flush=True)
