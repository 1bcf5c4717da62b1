"""Interleaved: a decode forward of B rows at n keys on slots 0..B-1 (a run) read as the
cache's view (before) and as a compact copy (landed). Default model, bfloat16, one thread,
capacity 2,048. Run: python layout.py "[(1, 64), (16, 128), (64, 300)]" """
import statistics
import sys

import reads
from timing import decode_ms, default_runner

r = default_runner(64, 2048)
for B, n in eval(sys.argv[1]):
    res: dict[str, list[float]] = {"view": [], "copy": []}
    for _ in range(6):
        for name in res:
            reads.use(name)
            res[name].append(decode_ms(r, list(range(B)), n))
    v, c = (statistics.median(res[k]) for k in ("view", "copy"))
    print(f"B={B:3d} n={n:5d}  view {v:7.1f} ms  copied {c:7.1f} ms  copied/view {c / v:.3f}")
