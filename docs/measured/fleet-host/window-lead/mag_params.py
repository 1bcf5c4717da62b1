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
    from edgespec.config import EngineConfig, SamplingParams
    from edgespec.drafters.mag import MaGDrafter
    from edgespec.engine.spec_engine import Request, SpecEngine

    runner = lead_replay._reference_runner()(qs, 16)
    cfg = EngineConfig(max_sessions=16, max_draft=k, adaptive=False, rest_drafters=False)
    tokens = steps = drafted = accepted = 0
    with SpecEngine(runner, MaGDrafter(**params), cfg, stop_ids) as engine:
        for i in range(0, len(qs), 16):
            batch = qs[i:i + 16]
            results = engine.generate_many([Request(list(q["prompt"]), 96, SamplingParams())
                                            for q in batch])
            for q, r in zip(batch, results):
                assert r.token_ids == q["output"], q["id"]  # the replay is target-only's
                tokens += len(r.token_ids)
                steps += r.stats.steps
                drafted += r.stats.draft_tokens
                accepted += r.stats.accepted_tokens
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
