"""The target's greedy choice on the CPU: torch's ``argmax`` over the vocabulary against NumPy's
(``edgespec.verify.target_choice.last_argmax``, what the verification runs on the CPU), on float32
logits of a step's shapes: rows x positions x vocabulary, at bench-host's 512-token vocabulary
and the default model's 49,152. Both give the same indices (checked here on every shape, and in
tests/test_verification.py on ties and NaNs). Torch on one thread (set here); the best of
``--repeats`` passes of ``--loops`` calls each. Prints a table and writes JSON.

    python scripts/argmax_bench.py --json bench-results/argmax.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgespec.verify.target_choice import last_argmax  # noqa: E402

SHAPES = [(1, 1, 512), (64, 1, 512), (64, 5, 512), (1, 1, 49152), (1, 5, 49152),
          (16, 5, 49152), (64, 5, 49152)]


def best_us(fn, loops: int, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        times.append((time.perf_counter() - t0) / loops)
    return 1e6 * min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loops", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="bench-results/argmax.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'rows x positions x vocabulary':>30} {'torch us':>10} {'numpy us':>10} {'ratio':>7}")
    for shape in SHAPES:
        x = torch.randn(*shape, generator=g)
        if not torch.equal(x.argmax(-1), last_argmax(x)):
            print(f"different indices at {shape}", file=sys.stderr)
            return 1
        t = best_us(lambda: x.argmax(-1), args.loops, args.repeats)
        n = best_us(lambda: last_argmax(x), args.loops, args.repeats)
        rows.append({"shape": list(shape), "torch_us": t, "numpy_us": n, "ratio": t / n})
        print(f"{' x '.join(map(str, shape)):>30} {t:>10.1f} {n:>10.1f} {t / n:>6.1f}x")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": 1, "torch": torch.__version__,
                               "numpy": np.__version__, "results": rows}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
