"""The engine's host work a session-step counted in instructions, not seconds:
``../decode-layout/host_loop.py`` (bench-host's setting: its InstantRunner, the in-process store,
torch on one thread, the heap frozen as a server's; N sessions x 64 tokens a run, after a
warm-up) run under valgrind's callgrind twice, with LOW and HIGH runs, and the difference of the
two instruction totals divided by the difference of their session-steps. Start-up (imports,
model, prompts, the warm-up) cancels out. Instruction counts do not move with the machine's
load, so two versions of the code compare within a fraction of a percent where bench-host's
wall time (noise of ~1.5 us a session-step on a quiet 2-core machine, far more on a loaded one)
cannot tell them apart. The count holds the runner's own answers (about a tenth of the whole
under py-spy) and whatever other threads run (BLAS's are held to one); the two runs' last
outputs (host_loop's digest) must agree.

    python instructions_per_step.py [--drafter mag] [--sessions 64] [--low 2] [--high 7]
                                    [--json FILE]

Each callgrind run takes about a minute and a quarter on this machine; the two run at once.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HOST_LOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "decode-layout",
                         "host_loop.py")


def measure(drafter: str, n: int, low: int, high: int) -> dict:
    if shutil.which("valgrind") is None:
        sys.exit("instructions_per_step: valgrind is not installed (apt-get install valgrind)")
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1")
    out_dir = tempfile.mkdtemp(prefix="instructions-")
    procs = {}
    for runs in (low, high):
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_dir}/cg.{runs}",
               sys.executable, HOST_LOOP, drafter, str(n), str(runs)]
        procs[runs] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    got = {}
    for runs, p in procs.items():
        out, err = p.communicate()
        if p.returncode != 0:
            sys.exit(f"instructions_per_step: the run of {runs} exited {p.returncode}:\n"
                     f"{err[-2000:]}")
        found = (re.search(r"Collected : (\d+)", err), re.search(r"session_steps (\d+)", out),
                 re.search(r"digest (\w+)", out))
        if not all(found):
            sys.exit(f"instructions_per_step: the run of {runs} printed no count (callgrind's "
                     f"'Collected', its session-steps, its digest):\n{err[-2000:]}")
        got[runs] = (int(found[0].group(1)), int(found[1].group(1)), found[2].group(1))
    shutil.rmtree(out_dir, ignore_errors=True)
    (i_lo, s_lo, d_lo), (i_hi, s_hi, d_hi) = got[low], got[high]
    if d_lo != d_hi:
        sys.exit(f"instructions_per_step: the two runs' outputs differ ({d_lo}, {d_hi})")
    return {"drafter": drafter, "sessions": n, "runs": [low, high],
            "instructions_per_session_step": round((i_hi - i_lo) / (s_hi - s_lo)),
            "session_steps_per_run": (s_hi - s_lo) / (high - low), "output_digest": d_hi}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="mag", help="bench-host's drafter (default: mag)")
    ap.add_argument("--sessions", type=int, default=64, help="sessions (default: 64)")
    ap.add_argument("--low", type=int, default=2, help="runs of the shorter count (default: 2)")
    ap.add_argument("--high", type=int, default=7, help="runs of the longer (default: 7)")
    ap.add_argument("--json", help="where to write the result as JSON")
    args = ap.parse_args()
    if not 1 <= args.low < args.high:  # host_loop divides by its timed runs' session-steps
        ap.error("need 1 <= --low < --high")
    result = measure(args.drafter, args.sessions, args.low, args.high)
    print(f"{result['drafter']}, {result['sessions']} sessions: "
          f"{result['instructions_per_session_step']:,} instructions a session-step "
          f"({result['session_steps_per_run']:.0f} session-steps a run)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
