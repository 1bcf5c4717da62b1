"""One decode forward of the runner over given slots at given contexts, timed, for the scripts
beside this one (the cache's lengths set directly: the keys' values do not change the time)."""
import time

import torch

from edgespec.models.loading import load_model
from edgespec.runner.target_runner import TargetRunner


def default_runner(n_slots: int, max_len: int) -> TargetRunner:
    torch.set_num_threads(1)
    r = TargetRunner(load_model("default", "cpu", "auto").model, n_slots=n_slots,
                     max_len=max_len)
    for _ in range(n_slots):
        r.new_slot()
    return r


def decode_ms(r: TargetRunner, slots: list[int], n: int) -> float:
    """A warm-up forward, then one timed, of one token a slot at n keys (rolled back)."""
    for s in slots:
        r.cache.lengths[s] = n
    took = 0.0
    for _ in range(2):
        t = time.perf_counter()
        r.forward(slots, [[5]] * len(slots), "none")
        took = (time.perf_counter() - t) * 1e3
        for s in slots:
            r.rollback(s, n)
    return took
