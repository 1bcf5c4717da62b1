"""``edgespec bench-edge``: edge drafting against the same server serving alone, as processes.

The question a user asks before buying boards: does drafting on them let this server serve
more? Per fleet setting (``--fleets``, SESSIONSxBOARDS), one ``edgespec serve`` confined to the
server's cores (its torch threads one a core) and the same Spec-Bench requests sent twice by
SESSIONS concurrent clients: first with no board attached (server-only: the verifier decodes
every session alone, batched, one token a session a step), then with BOARDS ``edgespec drafter``
processes on the boards' cores, session i pinned to board i mod BOARDS. The clients run here, on
the boards' cores. A warm-up call precedes each (and each board). Reported per setting: system
tokens/s both ways and their ratio, inter-token latency p50/p99, the server's CPU seconds per
committed token (its process tree, from /proc), tokens per verification forward, and, from both
sides' ``/metrics``, each board's session steps with a ready draft and with a verified draft,
its chunks sent and dropped, tokens kept across fixes, its CPU use, and whether the boards'
cores bound the run. Every output is compared, token for token, between the two runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from edgespec.config import ConfigError
from edgespec.runner.cpu_kind import cpu_kind
from edgespec.wire.channels import free_port
from verifier_node.metrics import MAX_POSITIONS

from ..deployment.cpu_share import pin_pid, pin_process, process_tree_cpu_s, split_cpus
from .distributed import spawn_edgespec, stops_its_processes_on_sigterm, wait_for_line
from .edge_report import (board_figures, compare_runs, delta, format_table, plot_report,
                          refused_chunks, scrape)
from .run import add_question_args, load_questions


def add_bench_edge_args(p) -> None:
    add_question_args(p)
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="most tokens generated per request (default: %(default)s)")
    p.add_argument("--fleets", default="1x1,4x2", metavar="SxB[,SxB...]",
                   help="settings to measure: S sessions at once drafted by B boards "
                        "(default: %(default)s)")
    p.add_argument("--drafter", metavar="SPEC", default="llamacpp:default",
                   help="every board's drafter (default: %(default)s)")
    p.add_argument("--board-threads", type=int, default=1,
                   help="each board's threads (default: %(default)s)")
    p.add_argument("--server-cpus", metavar="CPUS", default=None,
                   help="the server's cores (default: the first half of this machine's)")
    p.add_argument("--board-cpus", metavar="CPUS", default=None,
                   help="the boards' and the clients' cores (default: the rest)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="pass ARG on to edgespec serve, e.g. --serve-arg=--late-after=0 "
                        "(repeatable)")
    p.add_argument("--board-arg", action="append", default=[], metavar="ARG",
                   help="pass ARG on to every board's edgespec drafter, e.g. "
                        "--board-arg=--tree-width=2 (repeatable)")
    p.add_argument("--json", dest="json_out", default="bench-results/bench-edge.json",
                   metavar="FILE", help="where to write the JSON results (default: %(default)s)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw throughput and p99 inter-token latency per setting, edge "
                        "drafting against server-only, into this PNG (default: none)")


def parse_fleets(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        try:
            s, b = (int(x) for x in part.strip().lower().split("x"))
        except ValueError:
            raise ConfigError(f"--fleets takes SESSIONSxBOARDS like 4x2, got {part!r}") from None
        if s < 1 or b < 1:
            raise ConfigError(f"--fleets: sessions and boards must be >= 1, got {part!r}")
        out.append((s, b))
    return out


class _Proc:
    """An ``edgespec`` process on given cores, logging to a file."""

    def __init__(self, args: list, log: Path, cpus):
        self.log = log
        self.popen = spawn_edgespec(args, log)
        pin_pid(self.popen.pid, cpus)  # before the interpreter has started any thread

    def wait_for(self, needle: str, timeout: float = 300) -> None:
        wait_for_line(self.log, needle, self.popen, timeout)

    def cpu_s(self) -> float | None:
        return process_tree_cpu_s(self.popen.pid)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.popen.kill()


@stops_its_processes_on_sigterm
def run_bench_edge(args) -> int:
    from edgespec_cli.cli_args import check_model_arg

    from edgespec.drafters import EDGE_KINDS
    from edgespec.drafters.spec_check import check_drafter_arg

    check_model_arg(args.model)
    # the boards' drafter, checked before the server-only measurement, not after it
    check_drafter_arg(args.drafter, allowed=EDGE_KINDS)
    if args.board_threads < 1:
        raise ConfigError(f"--board-threads must be >= 1, got {args.board_threads}")
    if args.max_new_tokens < 1:  # 0 on the wire would be the server's default
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    fleets = parse_fleets(args.fleets)
    split = split_cpus(args.server_cpus, args.board_cpus)
    if split is None:
        raise ConfigError("bench-edge needs two cores or more: the server's and the boards'")
    pin_process(split.boards)  # the clients: the users' side
    questions = load_questions(args.categories, args.per_category, False)
    if not questions:
        raise ConfigError("no questions selected")
    out_dir = Path(args.json_out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = len(split.server) if args.threads is None else args.threads
    print(f"bench-edge: {split.describe()}; the server's torch threads: {threads}",
          file=sys.stderr, flush=True)
    results, t0 = [], time.perf_counter()
    for i, (s, b) in enumerate(fleets, 1):
        print(f"[{i}/{len(fleets)}] fleet {s}x{b}: {s} session(s) at a time, {b} board(s)",
              file=sys.stderr, flush=True)
        results.append(_measure_fleet(args, split, threads, s, b, questions, out_dir))
        took = time.perf_counter() - t0
        print(f"[{i}/{len(fleets)}] fleet {s}x{b} done: {took:.0f} s so far, eta "
              f"{took / i * (len(fleets) - i):.0f} s", file=sys.stderr, flush=True)
    report = {"config": {"model": args.model, "drafter": args.drafter,
                         "max_new_tokens": args.max_new_tokens, "questions": len(questions),
                         "split": split.describe(), "server_threads": threads,
                         "board_threads": args.board_threads, "serve_args": args.serve_arg,
                         "board_args": args.board_arg,
                         "cpu": cpu_kind().as_json()},
              "fleets": results}
    print(f"machine: {cpu_kind().describe()}")
    print(format_table(report))
    Path(args.json_out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json_out}", file=sys.stderr)
    if args.plot:
        print(f"wrote {plot_report(report, args.plot)}", file=sys.stderr)
    return 0 if all(r["identical"] for r in results) else 1


def _measure_fleet(args, split, threads: int, sessions: int, boards: int, questions,
                   out_dir: Path) -> dict:
    import edgespec

    port, metrics_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    tag = f"{sessions}x{boards}"
    serve: _Proc | None = None
    procs: list[_Proc] = []  # the boards'; each process stopped in the ``finally``
    try:
        serve = _Proc(["serve", "--listen", address, "--model", args.model, "--dtype",
                       args.dtype, "--device", args.device, "--threads", threads,
                       "--max-sessions", sessions, "--metrics-port", metrics_port,
                       *args.serve_arg], out_dir / f"bench-edge-{tag}-serve.log", split.server)
        serve.wait_for("listening on")
        with edgespec.Client(address, timeout=900) as client:
            ids = _fitting(_encode(args.model, [q["prompt"] for q in questions]),
                           args.max_new_tokens)
            client.generate(prompt_ids=ids[0], max_new_tokens=8)  # warm-up
            print(f"  {tag}: the server alone, {len(ids)} requests", file=sys.stderr,
                  flush=True)
            alone = _serve_requests(client, ids, sessions, args.max_new_tokens, None, serve,
                                    metrics_port, [])
            devices = [f"board-{i}" for i in range(boards)]
            board_ports = [free_port() for _ in devices]
            for dev, mport in zip(devices, board_ports):
                procs.append(_Proc(["drafter", "--cache", address, "--device-id", dev,
                                    "--drafter", args.drafter, "--threads",
                                    args.board_threads, "--metrics-port", mport,
                                    *args.board_arg],
                                   out_dir / f"bench-edge-{tag}-{dev}.log", split.boards))
            for p in procs:
                p.wait_for("attached to")
            for dev in devices:
                client.generate(prompt_ids=ids[0], max_new_tokens=8, device_id=dev)
            print(f"  {tag}: with {boards} board(s) drafting, {len(ids)} requests",
                  file=sys.stderr, flush=True)
            edge = _serve_requests(client, ids, sessions, args.max_new_tokens, devices, serve,
                                   metrics_port, list(zip(devices, board_ports, procs)))
    finally:
        for proc in [*procs, serve]:
            if proc is not None:
                proc.stop()
    return compare_runs(sessions, boards, alone, edge, split)


def _fitting(ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The prompts that fit a session's context with their output (the server's default)."""
    from edgespec.config import EngineConfig

    limit = EngineConfig().max_context
    fit = [p for p in ids if len(p) + max_new_tokens <= limit]
    if len(fit) < len(ids):
        print(f"bench-edge: {len(ids) - len(fit)} prompt(s) longer than {limit} tokens with "
              f"their output left out", file=sys.stderr, flush=True)
    if not fit:
        raise ConfigError(f"no prompt fits {limit} tokens with --max-new-tokens {max_new_tokens}")
    return fit


def _encode(model: str, prompts: list[str]) -> list[list[int]]:
    """The prompts through the model's chat template, as the server would encode them."""
    from transformers import AutoTokenizer

    from edgespec.models.loading import encode_prompt, resolve_model_path

    path, gguf = resolve_model_path(model)
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf)
    return [encode_prompt(tokenizer, p) for p in prompts]


def _serve_requests(client, ids: list[list[int]], sessions: int, max_new_tokens: int,
                    devices: list[str] | None, serve: _Proc, metrics_port: int,
                    boards: list) -> dict:
    """Every prompt once, ``sessions`` at a time (client thread i sends prompts i, i +
    sessions, ... pinned to board i mod boards); the figures of the run."""
    from edgespec_cli.simulate.records import RequestRecord

    records: list[RequestRecord | None] = [None] * len(ids)
    finished, lock, step = [0], threading.Lock(), max(1, len(ids) // 10)  # progress, in tenths

    def client_thread(i: int) -> None:
        for k in range(i, len(ids), sessions):
            rec = RequestRecord(devices[i % len(devices)] if devices else "server", "", "",
                                ids[k], time.monotonic())
            rec.read(client.stream(prompt_ids=ids[k], raw=True, max_new_tokens=max_new_tokens,
                                   device_id=None if devices is None else rec.device_id))
            records[k] = rec
            with lock:
                finished[0] += 1
                if finished[0] % step == 0 or finished[0] == len(ids):
                    print(f"    {finished[0]}/{len(ids)} requests done", file=sys.stderr,
                          flush=True)

    before = scrape(metrics_port)
    board_before = [(scrape(p), proc.cpu_s()) for _, p, proc in boards]
    cpu0, t0 = serve.cpu_s(), time.monotonic()
    workers = [threading.Thread(target=client_thread, args=(i,)) for i in range(sessions)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall, cpu1 = time.monotonic() - t0, serve.cpu_s()
    after = scrape(metrics_port)
    done = [r for r in records if r is not None]
    per_board = []
    for (dev, port, proc), (b_before, b_cpu0) in zip(boards, board_before):
        b_after, b_cpu1 = scrape(port), proc.cpu_s()
        per_board.append(board_figures(dev, before, after, b_before, b_after,
                                       None if b_cpu0 is None or b_cpu1 is None
                                       else b_cpu1 - b_cpu0, wall))
    forwards = delta(after, before, "edgespec:batch_size_sessions_count")
    # verified drafts by position: held a token there, and had it accepted (the projection's
    # acceptance by position, ``simulate/projection.py``)
    per_pos = {what: [delta(after, before, f"edgespec:spec_decode_num_{what}_tokens_per_pos_total",
                            position=str(i)) for i in range(MAX_POSITIONS)]
               for what in ("drafted", "accepted")}
    step_ms = {phase: 1000 * delta(after, before, "edgespec:step_seconds_sum", phase=phase)
               / forwards if forwards else None for phase in ("wait", "forward", "commit")}
    return {"records": done, "wall_s": wall,
            "server_cpu_s": None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
            "forwards": forwards, "step_ms": step_ms, "boards": per_board,
            "chunks_refused": refused_chunks(after, before),
            "drafted_per_pos": per_pos["drafted"], "accepted_per_pos": per_pos["accepted"]}
