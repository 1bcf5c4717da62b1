"""Interleaved: a decode forward of 17 rows at 400 keys on slots 0-15 and 40 (a gather) read as
before and as landed, and on slots 0-16 (a run) read as a view and as a compact copy. Default
model, bfloat16, one thread. Run from the repository: python slots.py"""
import statistics

import reads
from timing import decode_ms, default_runner

r = default_runner(80, 1024)
scattered, run = list(range(16)) + [40], list(range(17))
cases = {"gather, advanced indexing (before)": (scattered, "old"),
         "gather, index_select": (scattered, "gather"),
         "run, view (before)": (run, "view"),
         "run, copied": (run, "copy")}
res: dict[str, list[float]] = {k: [] for k in cases}
for _ in range(8):
    for name, (ss, read) in cases.items():
        reads.use(read)
        res[name].append(decode_ms(r, ss, 400))
for n, v in res.items():
    print(f"{n:<36} median {statistics.median(v):6.1f} ms  min {min(v):6.1f}  max {max(v):6.1f}")
