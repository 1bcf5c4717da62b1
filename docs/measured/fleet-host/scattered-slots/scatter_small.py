"""Interleaved: a decode forward of 16 rows on slots 0-14 and 16 (a gather) at n keys, read by
advanced indexing (before) and index_select (landed). Default model, bfloat16, one thread.
Run: python scatter_small.py "[64, 128]" """
import statistics
import sys

import reads
from timing import decode_ms, default_runner

r = default_runner(80, 2048)
ss = list(range(15)) + [16]
for n in eval(sys.argv[1]):
    res: dict[str, list[float]] = {"old": [], "gather": []}
    for _ in range(8):
        for name in res:
            reads.use(name)
            res[name].append(decode_ms(r, ss, n))
    print(n, {k: round(statistics.median(v), 1) for k, v in res.items()})
