"""One layer's attention (bfloat16, one thread) at query-column tiles 16, 8, 4 and 1, medians of
20 calls, and whether every tile gives the same bits. Run: python attention_tiles.py"""
import time

import torch

from edgespec.runner.attention import invariant_attention

torch.set_num_threads(1)


def timed(B: int, T: int, n: int, tile: int, dt=torch.bfloat16, reps: int = 20):
    g = torch.Generator().manual_seed(0)
    kvh, grp, hd = 3, 3, 64  # the default model's layout
    q = torch.randn(B, kvh, grp, T, hd, generator=g).to(dt)
    keys = torch.randn(B, kvh, n, hd, generator=g).to(dt)
    values = torch.cat([torch.randn(B, kvh, n, hd, generator=g), torch.ones(B, kvh, n, 1)],
                       -1).to(dt)
    visible = (torch.arange(n)[None, None] <= (n - 10 + torch.arange(T))[None, :, None]
               ).expand(B, T, n).contiguous()
    for _ in range(3):
        invariant_attention(q, keys, values, visible, tile)
    times, out = [], None
    for _ in range(reps):
        t = time.perf_counter()
        out = invariant_attention(q, keys, values, visible, tile)
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1e3, out


for B, T, n in [(1, 1, 512), (16, 1, 512), (16, 1, 1536), (64, 1, 512), (16, 3, 512),
                (16, 9, 512)]:
    r = {tile: timed(B, T, n, tile) for tile in (16, 8, 4, 1)}
    same = all(torch.equal(r[16][1], v[1]) for v in r.values())
    print(f"{B} x {T} @ {n}: " + ", ".join(f"tile {t} {v[0]:.2f} ms" for t, v in r.items()),
          f"same bits: {same}")
