"""Host work a session-step of two checkouts of the project, in alternating processes:
``host_loop.py`` (bench-host's engine and InstantRunner, one settings' generate_many run many
times in one process, torch on one thread) against ``BASE`` (a checkout of the code before,
e.g. ``git worktree add /tmp/base 26e1465``) and this checkout.

    python docs/measured/fleet-host/decode-layout/ab.py BASE ROUNDS OUT.json
"""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MAIN = os.path.abspath(os.path.join(HERE, "..", "..", "..", ".."))
SETTINGS = [("none", 64, 60), ("none", 1, 300), ("mag", 64, 30), ("mag", 1, 300)]


def one(tree: str, drafter: str, n: int, reps: int) -> float:
    out = subprocess.run([sys.executable, os.path.join(HERE, "host_loop.py"), drafter, str(n),
                          str(reps)], cwd=tree, env={**os.environ, "PYTHONPATH": tree},
                         capture_output=True, text=True, check=True).stdout
    return float(out.split()[0])  # host microseconds a session-step (wall)


def main() -> None:
    base, rounds, path = os.path.abspath(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    runs: dict = {}
    for drafter, n, reps in SETTINGS:
        key = f"{drafter} x {n}"
        got = runs[key] = {"before": [], "after": []}
        for r in range(rounds):
            for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
                got[side].append(one(base if side == "before" else MAIN, drafter, n, reps))
        print(key, got, flush=True)
    with open(path, "w") as f:
        json.dump({"threads": 1, "unit": "host us a session-step", "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
