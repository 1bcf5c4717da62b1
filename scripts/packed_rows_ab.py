"""A verification step whose rows hold drafts of unequal lengths, packed (the runner's eager
path: the products on the rows' own tokens) against padded (every row as wide as the widest:
the same layers called without ``real``), the default model in float32 on one torch thread,
300-token contexts: both sides' logits checked equal at every row's own tokens, then five rounds
alternating, medians printed (and written to the JSON file given).

    python scripts/packed_rows_ab.py [out.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from edgespec.models.loading import load_model
from edgespec.runner.step_rows import DraftShape, Scored, StepRows
from edgespec.runner.target_runner import TargetRunner

CASES = {"4 rows, drafts 8,0,0,2": [8, 0, 0, 2], "4 rows, drafts 5,5,5,5": [5, 5, 5, 5],
         "8 rows, drafts 6,1,0,0,3,0,0,0": [6, 1, 0, 0, 3, 0, 0, 0],
         "2 rows, drafts 4,0": [4, 0], "8 rows, drafts 2,2,1,1,0,0,0,0": [2, 2, 1, 1, 0, 0, 0, 0]}
ROUNDS = 5


def padded(r: TargetRunner, rows: StepRows) -> Scored:
    with torch.inference_mode():
        x, _ = r.eager.chains(rows.slots, rows.tokens, rows.start_index, max(rows.starts),
                              slot_index=rows.slot_index)
        return r._scored(x)


def main() -> int:
    torch.set_num_threads(1)
    r = TargetRunner(load_model("default", dtype="float32").model, n_slots=8, max_len=1024)
    g = torch.Generator().manual_seed(0)
    slots = [r.new_slot() for _ in range(8)]
    for s in slots:
        r.prefill(s, torch.randint(0, 40000, (300,), generator=g).tolist())
    out = {}
    for name, ks in CASES.items():
        B = len(ks)
        shape = DraftShape.of([(list(range(1000, 1000 + k)), list(range(-1, k - 1)))
                               for k in ks])
        rows = StepRows.build(slots[:B], [r.cache.lengths[s] for s in slots[:B]], [7] * B,
                              shape, r.device)
        a, b = r.score_rows(rows), padded(r, rows)
        assert all(torch.equal(a.logits[i, :k + 1], b.logits[i, :k + 1])
                   for i, k in enumerate(ks))
        times: dict[str, list[float]] = {"packed": [], "padded": []}
        for _ in range(ROUNDS):
            for side, run in (("padded", lambda: padded(r, rows)),
                              ("packed", lambda: r.score_rows(rows))):
                t0 = time.perf_counter()
                run()
                times[side].append(1e3 * (time.perf_counter() - t0))
        med = {k: statistics.median(v) for k, v in times.items()}
        tokens, padded_tokens = sum(ks) + B, B * (1 + max(ks))
        out[name] = {"ms": times, "median_ms": med, "tokens": tokens,
                     "padded_tokens": padded_tokens}
        print(f"{name:34s} padded {med['padded']:7.1f} ms  packed {med['packed']:7.1f} ms  "
              f"{med['padded'] / med['packed']:.2f}x  ({tokens} of {padded_tokens} token-rows)")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"threads": 1, "context": 300, "dtype": "float32", "cases": out}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
