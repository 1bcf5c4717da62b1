"""A soak with link faults of every kind and drafter kills, against real processes: are outputs
still target-only's, do calls survive, how fast do boards come back, and what does a faulty
board cost the healthy ones?

Starts ``edgespec serve --dtype float32`` and ``--boards`` MaG drafters (``edgespec drafter``
processes), each drafter and each of ``--clients`` SDK clients behind its own ``FaultyLink``
relay. Clients loop over Spec-Bench questions, pinned to a board each. Every ``--fault-every``
seconds one fault lands, in turn: a board's link blackholed for 20 s, abandoned, reset, refused
for 10 s, slowed for 25 s; every third fault hits a client's link instead, and every fourth
event kills a drafter with SIGKILL and starts it again. After ``--duration`` seconds every
output is compared with target-only decoding (the runner with no drafter, float32, the same
thread count). Prints a table and writes JSON.

    python scripts/link_soak.py --duration 300 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BOARD_FAULTS = [("blackhole", 20.0), ("abandon", 0.0), ("reset", 0.0), ("refuse", 10.0),
                ("slow", 25.0)]


def p95(xs: list[float]) -> float | None:
    return statistics.quantiles(xs, n=20)[-1] if len(xs) >= 2 else (xs[0] if xs else None)


class Soak:
    def __init__(self, args):
        from edgespec.wire.channels import free_port
        from edgespec_cli.deployment.link_faults import FaultyLink

        self.args = args
        self.address = f"127.0.0.1:{free_port()}"
        self.logdir = Path(args.json).with_suffix("")
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.serve = self._spawn("serve", ["serve", "--listen", self.address, "--dtype",
                                           "float32", "--threads", str(args.threads)])
        self.board_links = [FaultyLink(self.address) for _ in range(args.boards)]
        self.client_links = [FaultyLink(self.address) for _ in range(args.clients)]
        self.drafters: list[subprocess.Popen | None] = [None] * args.boards
        self.calls: list[dict] = []
        self.events: list[dict] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "a")
        return subprocess.Popen([sys.executable, "-m", "edgespec_cli", *argv], stdout=log,
                                stderr=subprocess.STDOUT, env=self.env)

    def start_drafter(self, i: int) -> None:
        self.drafters[i] = self._spawn(f"board-{i}", [
            "drafter", "--cache", self.board_links[i].address, "--device-id", f"board-{i}",
            "--drafter", "mag", "--threads", "1"])

    def status(self) -> dict:
        import edgespec

        with edgespec.Client(self.address, timeout=30) as c:
            return {d["device_id"]: d for d in c.status()["drafters"]}

    def attached(self, i: int) -> bool:
        try:
            d = self.status().get(f"board-{i}")
        except Exception:
            return False
        return bool(d and d["attached"])

    def client_loop(self, j: int, prompts: list[list[int]]) -> None:
        import edgespec

        k = j
        while not self.stop.is_set():
            ids = prompts[k % len(prompts)]
            rec = {"client": j, "board": j % self.args.boards, "prompt": k % len(prompts),
                   "start": time.monotonic()}
            try:
                with edgespec.Client(self.client_links[j].address, timeout=120) as c:
                    out = c.generate(prompt_ids=ids, max_new_tokens=self.args.tokens,
                                     temperature=0, device_id=f"board-{rec['board']}")
                rec.update(ok=True, tokens=out.token_ids, resumed=out.resumed)
            except edgespec.PreconditionFailed:  # its board is away: try again in a moment
                self.stop.wait(0.5)
                continue
            except Exception as e:
                rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            rec["end"] = time.monotonic()
            with self.lock:
                self.calls.append(rec)
            k += self.args.clients

    def faults(self, began: float) -> None:
        n = 0
        while not self.stop.wait(self.args.fault_every):
            n += 1
            now = time.monotonic() - began
            if n % 4 == 0:  # a process kill: SIGKILL a drafter, start it again
                i = (n // 4) % self.args.boards
                proc = self.drafters[i]
                assert proc is not None
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                self.start_drafter(i)
                self.events.append({"at_s": now, "kind": "kill", "board": i,
                                    "back_s": self._back(i, time.monotonic())})
                continue
            fault, span = BOARD_FAULTS[n % len(BOARD_FAULTS)]
            if n % 3 == 0:  # a client's link
                j = n % self.args.clients
                link = self.client_links[j]
                link.apply(fault)
                self.events.append({"at_s": now, "kind": fault, "client": j, "for_s": span,
                                    "end_s": now + span})
                if span:
                    self.stop.wait(span)
                    link.heal()
                continue
            i = n % self.args.boards
            link = self.board_links[i]
            link.apply(fault)
            event = {"at_s": now, "kind": fault, "board": i, "for_s": span, "end_s": now + span}
            self.events.append(event)
            if span:
                self.stop.wait(span)
                link.heal()
            event["back_s"] = self._back(i, time.monotonic())

    def _back(self, i: int, since: float) -> float | None:
        """Seconds from ``since`` (the link healed, or an instant fault) until board i is
        attached again; None if not within 60 s."""
        time.sleep(0.5)  # a fault the status has not noticed yet reads as attached
        while time.monotonic() - since < 60:
            if self.attached(i):
                return time.monotonic() - since
            time.sleep(0.2)
        return None

    def run(self) -> dict:
        from edgespec_cli.bench.run import load_questions
        from edgespec.models.loading import encode_prompt, load_model

        target = load_model(self.args.model, dtype="float32")
        prompts = [encode_prompt(target.tokenizer, q["prompt"])
                   for q in load_questions([], 0, full=True)[:60]]
        for link in self.board_links + self.client_links:
            link.start()
        import edgespec

        with edgespec.Client(self.address, timeout=600) as c:
            c.status()
        for i in range(self.args.boards):
            self.start_drafter(i)
        deadline = time.monotonic() + 120
        while not all(self.attached(i) for i in range(self.args.boards)):
            if time.monotonic() > deadline:
                raise SystemExit("the boards did not attach")
            time.sleep(0.5)
        began = time.monotonic()
        clients = [threading.Thread(target=self.client_loop, args=(j, prompts), daemon=True)
                   for j in range(self.args.clients)]
        for t in clients:
            t.start()
        faults = threading.Thread(target=self.faults, args=(began,), daemon=True)
        faults.start()
        self.stop.wait(self.args.duration)
        self.stop.set()
        for t in clients:
            t.join(180)
        faults.join(120)
        codes = self._shut_down()
        return self._report(target, prompts, began, codes)

    def _shut_down(self) -> list[int]:
        procs = [p for p in self.drafters if p is not None] + [self.serve]
        for p in procs:
            p.terminate()
        codes = [p.wait(timeout=120) for p in procs]
        for link in self.board_links + self.client_links:
            link.stop()
        return codes

    def _report(self, target, prompts, began: float, codes: list[int]) -> dict:
        import torch

        from edgespec.engine.local import LocalGenerator
        from edgespec.runner.cpu_kind import cpu_kind

        torch.set_num_threads(self.args.threads)
        gen = LocalGenerator(target, drafter="none")
        refs: dict[int, list[int]] = {}
        different = 0
        for c in self.calls:
            if c.get("ok"):
                if c["prompt"] not in refs:
                    refs[c["prompt"]] = gen.generate(prompts[c["prompt"]],
                                                     self.args.tokens).token_ids
                different += c["tokens"] != refs[c["prompt"]]
        windows = [(e["at_s"], max(e.get("end_s", e["at_s"]), e["at_s"]) + 15, e.get("board"))
                   for e in self.events if "board" in e]
        quiet, faulted_other = [], []
        for c in self.calls:
            if not c.get("ok"):
                continue
            s, e = c["start"] - began, c["end"] - began
            overlap = [w for w in windows if s < w[1] and e > w[0]]
            latency = c["end"] - c["start"]
            if not overlap:
                quiet.append(latency)
            elif all(w[2] != c["board"] for w in overlap):
                faulted_other.append(latency)
        backs = [e["back_s"] for e in self.events if e.get("back_s") is not None]
        report = {
            "cpu": cpu_kind().describe(), "duration_s": self.args.duration,
            "boards": self.args.boards, "clients": self.args.clients, "calls": len(self.calls),
            "identical": sum(1 for c in self.calls if c.get("ok")) - different,
            "different": different, "failed": sum(1 for c in self.calls if not c.get("ok")),
            "faults": len(self.events),
            "slowest_back_s": max(backs) if backs else None,
            "not_back": sum(1 for e in self.events if "board" in e and e.get("back_s") is None),
            "p95_quiet_s": p95(quiet), "p95_other_board_faulted_s": p95(faulted_other),
            "exit_codes": codes, "events": self.events,
            "errors": [c["error"] for c in self.calls if not c.get("ok")][:10],
            "command": "python scripts/link_soak.py " + " ".join(sys.argv[1:])}
        q, f = report["p95_quiet_s"], report["p95_other_board_faulted_s"]
        report["p95_ratio"] = f / q if q and f else None
        return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--boards", type=int, default=3)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--fault-every", type=float, default=25.0)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    p.add_argument("--json", default="bench-results/link-soak.json")
    args = p.parse_args()
    report = Soak(args).run()
    print(f"machine: {report['cpu']}")
    print(f"{'calls':>6} {'identical':>9} {'different':>9} {'failed':>6} {'faults':>6} "
          f"{'slowest back':>12} {'not back':>8} {'p95 quiet':>9} {'p95 other faulted':>17}")
    fmt = lambda x: "-" if x is None else f"{x:.1f}s"  # noqa: E731
    print(f"{report['calls']:>6} {report['identical']:>9} {report['different']:>9} "
          f"{report['failed']:>6} {report['faults']:>6} {fmt(report['slowest_back_s']):>12} "
          f"{report['not_back']:>8} {fmt(report['p95_quiet_s']):>9} "
          f"{fmt(report['p95_other_board_faulted_s']):>17}")
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0 if not report["different"] and not report["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
