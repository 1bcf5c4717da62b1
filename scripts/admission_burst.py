"""A burst beyond capacity against a real ``edgespec serve``: does every admitted call finish
within its deadline, and is every other call refused at once?

Starts ``edgespec serve`` (the default model unless ``--model``, embedded Redis) and one MaG
drafter, warms it up with a few calls (so the pace is measured), then sends ``--calls``
concurrent SDK calls of ``--tokens`` tokens with ``--deadline`` seconds each, and reports per
call: admitted (and whether it finished within its deadline) or refused (and how long the
refusal took). Prints a table and writes JSON; the CPU it ran on is in both.

    python scripts/admission_burst.py --calls 200 --tokens 16 --deadline 90 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def wait_serving(address: str, timeout: float) -> None:
    import edgespec

    with edgespec.Client(address, timeout=timeout) as c:
        c.status()


def one_call(address: str, prompt: str, tokens: int, deadline: float, out: dict) -> None:
    import edgespec

    began = time.monotonic()
    try:
        with edgespec.Client(address, timeout=deadline) as c:
            res = c.generate(prompt, max_new_tokens=tokens, temperature=0)
        out.update(outcome="finished", seconds=time.monotonic() - began,
                   tokens=len(res.token_ids))
    except edgespec.Overloaded as e:
        out.update(outcome="refused", seconds=time.monotonic() - began,
                   retry_after_s=e.retry_after_s, why=str(e)[:200])
    except edgespec.DeadlineExceeded as e:
        out.update(outcome="deadline_exceeded", seconds=time.monotonic() - began,
                   why=str(e)[:200])
    except edgespec.EdgespecError as e:
        out.update(outcome="failed", seconds=time.monotonic() - began, why=str(e)[:200])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--deadline", type=float, default=90.0)
    p.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    p.add_argument("--max-queue", type=int, default=256,
                   help="the server's queue: deep, so that pace, not depth, decides")
    p.add_argument("--json", default="bench-results/admission-burst.json")
    args = p.parse_args()

    from edgespec.runner.cpu_kind import cpu_kind
    from edgespec.wire.channels import free_port

    port = free_port()
    address = f"127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    log = open(Path(args.json).with_suffix(".log"), "w")  # the server's and drafter's logs
    serve = subprocess.Popen([sys.executable, "-m", "edgespec_cli", "serve", "--listen", address,
                              "--model", args.model, "--threads", str(args.threads),
                              "--max-queue", str(args.max_queue)],
                             stdout=log, stderr=subprocess.STDOUT, env=env)
    drafter = subprocess.Popen([sys.executable, "-m", "edgespec_cli", "drafter", "--cache",
                                address, "--device-id", "board-1", "--drafter", "mag",
                                "--threads", "1"], stdout=log, stderr=subprocess.STDOUT,
                               env=env)
    try:
        wait_serving(address, 600)
        for i in range(4):  # the pace is measured from these
            one_call(address, f"Count from {i} to {i + 20}.", args.tokens, 120, {})
        results = [{} for _ in range(args.calls)]
        prompts = [f"Write one sentence about the number {i}." for i in range(args.calls)]
        threads = [threading.Thread(target=one_call,
                                    args=(address, prompts[i], args.tokens, args.deadline,
                                          results[i]))
                   for i in range(args.calls)]
        began = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - began
    finally:
        for proc in (drafter, serve):
            proc.terminate()
        codes = [proc.wait(timeout=120) for proc in (drafter, serve)]
    by = {k: [r for r in results if r.get("outcome") == k]
          for k in ("finished", "refused", "deadline_exceeded", "failed")}
    refusal_s = sorted(r["seconds"] for r in by["refused"])
    finish_s = sorted(r["seconds"] for r in by["finished"])
    summary = {
        "cpu": cpu_kind().describe(), "threads": args.threads, "calls": args.calls,
        "tokens": args.tokens, "deadline_s": args.deadline, "wall_s": wall,
        "admitted": len(by["finished"]) + len(by["deadline_exceeded"]),
        "finished_in_deadline": len(by["finished"]),
        "missed_deadline": len(by["deadline_exceeded"]), "failed": len(by["failed"]),
        "refused": len(by["refused"]),
        "refused_within_1s": sum(s <= 1.0 for s in refusal_s),
        "slowest_refusal_s": refusal_s[-1] if refusal_s else None,
        "slowest_finish_s": finish_s[-1] if finish_s else None,
        "exit_codes": codes, "command": "python scripts/admission_burst.py " + " ".join(
            sys.argv[1:])}
    print(f"machine: {summary['cpu']}")
    print(f"{'calls':>6} {'admitted':>9} {'in time':>8} {'missed':>7} {'refused':>8} "
          f"{'<=1 s':>6} {'slowest refusal':>16} {'slowest finish':>15}")
    print(f"{args.calls:>6} {summary['admitted']:>9} {summary['finished_in_deadline']:>8} "
          f"{summary['missed_deadline']:>7} {summary['refused']:>8} "
          f"{summary['refused_within_1s']:>6} {summary['slowest_refusal_s'] or 0:>15.2f}s "
          f"{summary['slowest_finish_s'] or 0:>14.1f}s")
    Path(args.json).write_text(json.dumps({"summary": summary, "calls": results}, indent=1))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0 if not by["deadline_exceeded"] and not by["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
