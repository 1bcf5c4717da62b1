"""Interleaved: a verification forward of the default model (bfloat16, one thread) with the
attention's query columns unpadded (tile 1, what the probes choose on this session's AVX-512 Xeon)
and padded to 16 (the tile before), at several rows x tokens and contexts; the outputs' bits
compared. Run from this folder: python tiles.py"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scattered-slots"))
from timing import default_runner  # noqa: E402

r = default_runner(64, 2048)
print(f"chosen: tile {r.col_tile}, products at most {r.attention_cols} columns")


def forward_ms(rows: int, tokens: int, n: int) -> tuple[float, torch.Tensor]:
    slots = list(range(rows))
    for s in slots:
        r.cache.lengths[s] = n
    took, out = 0.0, None
    for _ in range(2):
        t = time.perf_counter()
        out = r.forward(slots, [[5 + i for i in range(tokens)]] * rows, "all")
        took = (time.perf_counter() - t) * 1e3
        for s in slots:
            r.rollback(s, n)
    return took, out


shapes = [(1, 1, 300), (16, 1, 300), (16, 1, 1000), (16, 4, 1000), (64, 1, 300), (4, 9, 1500)]
res: dict[tuple, dict[int, list[float]]] = {s: {1: [], 16: []} for s in shapes}
same: dict[tuple, bool] = {}
for _ in range(5):
    for shape in shapes:
        outs = {}
        for tile in (16, 1):
            r.col_tile = tile
            ms, outs[tile] = forward_ms(*shape)
            res[shape][tile].append(ms)
        same[shape] = torch.equal(outs[1], outs[16])
print("rows x tokens @ keys | tile 16 ms | tile 1 ms | tile 1 / 16 | same bits")
for (b, t, n), v in res.items():
    a, u = statistics.median(v[16]), statistics.median(v[1])
    print(f"{b} x {t} @ {n} | {a:.1f} | {u:.1f} | {u / a:.2f} | {same[(b, t, n)]}")
