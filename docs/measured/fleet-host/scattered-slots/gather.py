"""Interleaved micro-bench: reading 17 scattered slots' first 400 positions from one KV cache
layer of the default model's shape (3 kv heads, head_dim 64, bfloat16, 80 slots x 2,448
positions), by advanced indexing with a trailing slice (before) and by index_select over the
narrowed view (after). Torch on one thread. Run: python gather.py"""
import statistics
import time

import torch

torch.set_num_threads(1)
k = torch.zeros(80, 3, 2448, 64, dtype=torch.bfloat16)
slots = torch.tensor(list(range(16)) + [40])


def old():
    return k[slots, :, :400]


def new():
    return k[:, :, :400].index_select(0, slots)


assert torch.equal(old(), new())
res: dict[str, list[float]] = {"old": [], "new": []}
for rnd in range(20):
    pair = (("old", old), ("new", new)) if rnd % 2 else (("new", new), ("old", old))
    for name, f in pair:
        t = time.perf_counter()
        for _ in range(200):
            f()
        res[name].append((time.perf_counter() - t) / 200 * 1e6)
for n, v in res.items():
    print(f"{n}: median {statistics.median(v):.0f} us, min {min(v):.0f} us")
