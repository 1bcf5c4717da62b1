"""MaG's suffix match (``edgespec.drafters.suffix_match``), its ways timed on the same contexts:
on an array, every candidate narrowed together (the baseline: how it always matched before),
and candidates compared one by one up to ``SCAN_CANDIDATES`` of them; and on the list, the
candidates read from the tokens' places (``listed_suffix_match``: MaG's way now), the index kept
as the list grows from one context to the next (a session's), its upkeep in the time.

Contexts: every second prefix (from 16 tokens) of Spec-Bench questions and their references
(every 12th of the 480, the default model's tokenizer), and the prefixes of a context that
repeats a 24-token cycle with 10% of its tokens random (what ``bench-host``'s target writes):
each of 64-192 tokens (bench-host's: a 64-token prompt and 128 new), and every third of
64-1,200 tokens (past ~420 tokens more than 16 candidates: the old way, unchanged). Both ways
give the same answer everywhere (checked here too). Pure host work, NumPy's elementwise
operations (single-threaded). Prints a table and writes JSON.

    python scripts/suffix_match_bench.py --json bench-results/suffix-match.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgespec.drafters import suffix_match as mag  # noqa: E402


def spec_bench_texts(every: int = 12) -> list[np.ndarray]:
    from transformers import AutoTokenizer

    from edgespec.models.loading import resolve_model_path
    from edgespec_cli.bench.run import load_questions

    path, _ = resolve_model_path("default")
    tok = AutoTokenizer.from_pretrained(str(path))
    out = []
    for q in load_questions([], 0, full=True)[::every]:
        ref = q.get("reference") or ""
        ref = " ".join(map(str, ref)) if isinstance(ref, list) else str(ref)
        out.append(np.array(tok(q["prompt"] + " " + ref)["input_ids"], dtype=np.int64))
    return out


def repeating_context(length: int = 1200, cycle: int = 24, noise: float = 0.1) -> np.ndarray:
    rng = random.Random(0)
    return np.array([i % cycle if rng.random() > noise else rng.randrange(512)
                     for i in range(length)], dtype=np.int64)


def time_way(contexts: list[np.ndarray], scan: int, repeats: int) -> tuple[float, list]:
    """Microseconds a match (the best of ``repeats`` passes) and the answers."""
    mag.SCAN_CANDIDATES = scan
    best, answers = float("inf"), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        answers = [mag.longest_suffix_match(c, 8, 1) for c in contexts]
        best = min(best, (time.perf_counter() - t0) / len(contexts))
    return 1e6 * best, answers


def time_listed(contexts: list[np.ndarray], repeats: int) -> tuple[float, list]:
    """``time_way`` for the listed match: each context a list, its places kept from the one
    before (a longer prefix of the same text appends, another text is indexed anew)."""
    lists = [c.tolist() for c in contexts]
    best, answers = float("inf"), []
    for _ in range(repeats):
        places, array = mag.TokenPlaces(), mag.TokenArray()
        got = []
        t0 = time.perf_counter()
        for tokens in lists:
            got.append(mag.listed_suffix_match(tokens, places.of(tokens), 8, 1,
                                               lambda t=tokens: array.of(t)))
        best = min(best, (time.perf_counter() - t0) / len(lists))
        answers = got
    return 1e6 * best, answers


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="passes; the fastest is reported")
    p.add_argument("--json", type=Path, default=Path("bench-results/suffix-match.json"))
    args = p.parse_args()
    default = mag.SCAN_CANDIDATES
    repeating = repeating_context()
    sets = {"spec-bench": [t[:n] for t in spec_bench_texts() for n in range(16, len(t), 2)],
            "rep-64-192": [repeating[:n] for n in range(64, 193)],
            "rep-64-1200": [repeating[:n] for n in range(64, 1200, 3)]}
    rows = []
    for name, contexts in sets.items():
        together, ref = time_way(contexts, 0, args.repeats)
        one_by_one, got = time_way(contexts, default, args.repeats)
        listed, by_places = time_listed(contexts, args.repeats)
        if got != ref or by_places != ref:
            print(f"{name}: the two ways disagree", file=sys.stderr)
            return 1
        rows.append({"contexts": name, "matches": len(contexts), "together_us": together,
                     "one_by_one_us": one_by_one, "speedup": together / one_by_one,
                     "listed_us": listed, "listed_speedup": together / listed})
    mag.SCAN_CANDIDATES = default
    print(f"MaG suffix match, max_ngram 8; one by one up to {default} candidates")
    print(f"{'contexts':12s} {'matches':>8s} {'together us':>12s} {'one by one us':>14s} "
          f"{'speedup':>8s} {'listed us':>10s} {'speedup':>8s}")
    for r in rows:
        print(f"{r['contexts']:12s} {r['matches']:8d} {r['together_us']:12.2f} "
              f"{r['one_by_one_us']:14.2f} {r['speedup']:7.2f}x {r['listed_us']:10.2f} "
              f"{r['listed_speedup']:7.2f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"scan_candidates": default, "rows": rows}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
