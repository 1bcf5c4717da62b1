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
import urllib.request
from pathlib import Path

from edgespec.config import ConfigError
from edgespec.runner.cpu_kind import cpu_kind
from edgespec.wire.convert import free_port
from verifier_node.metrics import MAX_POSITIONS

from ..deployment.cpu_share import (BOUND_SHARE, busy_share, pin_pid, pin_process,
                                    process_tree_cpu_s, split_cpus)
from .distributed import spawn_edgespec, wait_for_line
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


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics endpoint: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def delta(after: dict, before: dict, name: str, /, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def refused_chunks(after: dict, before: dict) -> dict[str, float]:
    """The draft chunks the cache refused between two scrapes, by gRPC status code name."""
    out: dict[str, float] = {}
    for (name, labels), value in after.items():
        tags = dict(labels)
        if name == "edgespec:cache_chunks_total" and tags.get("result") == "refused":
            got = value - before.get((name, labels), 0.0)
            if got:
                out[tags.get("code", "")] = got
    return out


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
    results = [_measure_fleet(args, split, threads, s, b, questions, out_dir) for s, b in fleets]
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


def plot_report(report: dict, path: str) -> str:
    """Two panels: tokens/s and ITL p99 per setting, server-only against edge drafting, each
    bar labelled with its value; the settings and the drafter in the caption."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleets = report["fleets"]
    names = [f"{f['sessions']} session{'s' * (f['sessions'] > 1)}\n{f['boards']} "
             f"board{'s' * (f['boards'] > 1)}" for f in fleets]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, key, label in ((axes[0], "tokens_per_s", "system tokens/s"),
                           (axes[1], "itl_p99_ms", "ITL p99 (ms)")):
        for i, (side, color) in enumerate((("server_only", "tab:green"), ("edge", "tab:blue"))):
            ys = [f[side][key] or 0.0 for f in fleets]
            bars = ax.bar([x + (i - 0.5) * 0.4 for x in range(len(fleets))], ys, 0.4,
                          color=color, label="server only" if side == "server_only"
                          else f"edge drafting ({report['config']['drafter']})")
            ax.bar_label(bars, labels=[f"{y:.3g}" for y in ys], fontsize=7, padding=2)
        ax.set_xticks(range(len(fleets)), names, fontsize=8)
        ax.set_ylabel(label)
        ax.margins(y=0.15)
        ax.legend(fontsize=7)
    c = report["config"]
    fig.text(0.01, 0.01, f"{c['split']}; model {c['model']}; {c['questions']} Spec-Bench "
             f"questions, {c['max_new_tokens']} new tokens; same requests both ways",
             fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _measure_fleet(args, split, threads: int, sessions: int, boards: int, questions,
                   out_dir: Path) -> dict:
    import edgespec

    port, metrics_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    tag = f"{sessions}x{boards}"
    serve = _Proc(["serve", "--listen", address, "--model", args.model, "--dtype", args.dtype,
                   "--device", args.device, "--threads", threads, "--max-sessions", sessions,
                   "--metrics-port", metrics_port, *args.serve_arg],
                  out_dir / f"bench-edge-{tag}-serve.log", split.server)
    procs: list[_Proc] = []
    try:
        serve.wait_for("listening on")
        with edgespec.Client(address, timeout=900) as client:
            ids = _fitting(_encode(args.model, [q["prompt"] for q in questions]),
                           args.max_new_tokens)
            client.generate(prompt_ids=ids[0], max_new_tokens=8)  # warm-up
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
            edge = _serve_requests(client, ids, sessions, args.max_new_tokens, devices, serve,
                                   metrics_port, list(zip(devices, board_ports, procs)))
    finally:
        for p in [*procs, serve]:
            p.stop()
    return _compare(sessions, boards, alone, edge, split)


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

    def client_thread(i: int) -> None:
        for k in range(i, len(ids), sessions):
            rec = RequestRecord(devices[i % len(devices)] if devices else "server", "", "",
                                ids[k], time.monotonic())
            rec.read(client.stream(prompt_ids=ids[k], raw=True, max_new_tokens=max_new_tokens,
                                   device_id=None if devices is None else rec.device_id))
            records[k] = rec

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
        per_board.append(_board_figures(dev, before, after, b_before, b_after,
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


def _board_figures(dev: str, before: dict, after: dict, b_before: dict, b_after: dict,
                   cpu_s: float | None, wall: float) -> dict:
    steps = delta(after, before, "edgespec:drafter_session_steps_total", device=dev)
    ready = delta(after, before, "edgespec:drafter_ready_drafts_total", device=dev)
    verified = delta(after, before, "edgespec:drafter_verified_drafts_total", device=dev)
    empty = {a: delta(after, before, "edgespec:drafter_empty_drafts_total", device=dev, after=a)
             for a in ("opening", "fix", "again", "other")}
    waited = delta(after, before, "edgespec:drafter_waited_seconds_total", device=dev)
    accepted = delta(after, before, "edgespec:device_accepted_tokens_total", device=dev)
    fill = {"tokens": delta(after, before, "edgespec:fill_draft_tokens_total", device=dev),
            "accepted": delta(after, before, "edgespec:fill_accepted_tokens_total", device=dev)}
    board: dict = {k: delta(b_after, b_before, f"edgespec:drafter_{k}_total")
                   for k in ("chunks_sent", "draft_tokens", "chunks_drafted", "tokens_drafted",
                             "chunks_resent", "tokens_kept", "tokens_discarded",
                             "fixes_received")}
    board["chunks_dropped"] = {r: delta(b_after, b_before, "edgespec:drafter_chunks_dropped_total",
                                        reason=r) for r in ("disagreed", "closed", "failed")}
    board["commit_to_draft"] = _commit_to_draft(b_before, b_after)
    return {"device": dev, "session_steps": steps,
            "ready_share": ready / steps if steps else None,
            "verified_share": verified / steps if steps else None,
            "empty_drafts": empty,  # session steps asked, given none, by what came before
            "fill": fill,  # the verifier's own drafts for those (--fill-drafts)
            "waited_s": waited, "accepted_tokens": accepted, "cpu_s": cpu_s, **board,
            "wasted_tokens": max(0.0, board["draft_tokens"] - accepted)}


def _commit_to_draft(b_before: dict, b_after: dict) -> dict | None:
    """A board's time from a commit to the session's next usable draft, from its /metrics
    (``drafter_node/metrics.py``): simulate's ``commit_to_draft`` figures, and the mean round
    trip of a chunk to the cache; None when the board saw no commit."""
    from edgespec_cli.simulate.report import commit_to_draft

    def d(name: str, **labels) -> float:
        return delta(b_after, b_before, f"edgespec:drafter_{name}", **labels)

    out = commit_to_draft({  # the drafting loop's counts (``LoopCounts``), as the board sent them
        "commits_seen": d("commits_seen_total"), "commits_ahead": d("commits_ahead_total"),
        "commits_served": d("commits_served_total"),
        **{f"{stage}_s": d("commit_to_draft_seconds_total", stage=label)
           for stage, label in (("served", "total"), ("queued", "queued"),
                                ("drafting", "drafting"))}})
    if out is not None:
        acks = d("link_rtt_seconds_count")
        out["link_rtt_ms"] = 1000 * d("link_rtt_seconds_sum") / acks if acks else None
    return out


def _trimmed(counts: list[float]) -> list[int]:
    """Counts by position, without the trailing zeros."""
    out = [int(c) for c in counts]
    while out and not out[-1]:
        out.pop()
    return out


def _compare(sessions: int, boards: int, alone: dict, edge: dict, split) -> dict:
    from edgespec_cli.simulate.report import inter_token_latencies, nearest_rank

    def figures(run: dict) -> dict:
        recs = run["records"]
        tokens = sum(len(r.tokens) for r in recs)
        itl = [x for r in recs for x in inter_token_latencies(r)]
        return {"tokens": tokens, "wall_s": run["wall_s"],
                "tokens_per_s": tokens / run["wall_s"] if run["wall_s"] else None,
                "itl_p50_ms": _ms(nearest_rank(itl, 50)), "itl_p99_ms": _ms(nearest_rank(itl, 99)),
                "server_cpu_ms_per_token": None if not tokens or run["server_cpu_s"] is None
                else 1000 * run["server_cpu_s"] / tokens,
                "tokens_per_forward": tokens / run["forwards"] if run["forwards"] else None,
                # the boards' own drafts (a --fill-drafts fill's left out): their acceptance
                "drafted": sum(r.board_drafted for r in recs),
                "accepted": sum(r.board_accepted for r in recs),
                "steps": run["forwards"], "step_ms": run["step_ms"],
                "chunks_refused": run["chunks_refused"],
                "drafted_per_pos": _trimmed(run["drafted_per_pos"]),
                "accepted_per_pos": _trimmed(run["accepted_per_pos"])}

    a, e = figures(alone), figures(edge)
    board_cpu = [b["cpu_s"] for b in edge["boards"]]
    busy = None if None in board_cpu else busy_share(sum(board_cpu), edge["wall_s"],
                                                       len(split.boards))
    return {"sessions": sessions, "boards": boards, "server_only": a, "edge": e,
            "throughput_ratio": _ratio(e["tokens_per_s"], a["tokens_per_s"]),
            "server_cpu_per_token_ratio": _ratio(e["server_cpu_ms_per_token"],
                                                 a["server_cpu_ms_per_token"]),
            "boards_busy": busy,
            "bound_by_boards": busy is not None and busy >= BOUND_SHARE,
            "per_board": edge["boards"],
            "identical": [r.tokens for r in alone["records"]] ==
            [r.tokens for r in edge["records"]]}


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000 * x


def _ratio(a, b):
    return a / b if a is not None and b else None


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_table(report: dict) -> str:
    from edgespec_cli.simulate.report import commit_to_draft_line

    lines = [f"{'fleet':<7} {'alone tok/s':>11} {'edge tok/s':>10} {'ratio':>6} "
             f"{'ITL p99 ms':>14} {'server ms/tok':>14} {'tok/fwd':>9} {'same':>5}"]
    for f in report["fleets"]:
        a, e = f["server_only"], f["edge"]
        lines.append(
            f"{f['sessions']}x{f['boards']:<5} {_f(a['tokens_per_s']):>11} "
            f"{_f(e['tokens_per_s']):>10} {_f(f['throughput_ratio'], 2):>6} "
            f"{_f(a['itl_p99_ms'], 0):>6}/{_f(e['itl_p99_ms'], 0):<7} "
            f"{_f(a['server_cpu_ms_per_token'], 1):>6}/{_f(e['server_cpu_ms_per_token'], 1):<7} "
            f"{_f(a['tokens_per_forward'], 2):>4}/{_f(e['tokens_per_forward'], 2):<4} "
            f"{f['identical']!s:>5}")
    lines.append("(ITL, server CPU and tokens a forward: server-only / edge drafting)")
    for f in report["fleets"]:
        for name, side in (("server-only", f["server_only"]), ("edge", f["edge"])):
            ms = side["step_ms"]
            refused = side.get("chunks_refused") or {}
            lines.append(f"  {f['sessions']}x{f['boards']} {name:<11} ms a step: wait "
                         f"{_f(ms['wait'], 1)}, forward {_f(ms['forward'], 1)}, commit "
                         f"{_f(ms['commit'], 1)} ({side['steps']:.0f} steps)"
                         + ("; chunks the cache refused: " + ", ".join(
                             f"{n:.0f} {code}" for code, n in sorted(refused.items()))
                            if refused else ""))
    for f in report["fleets"]:
        for b in f["per_board"]:
            lines.append(
                f"  {f['sessions']}x{f['boards']} {b['device']}: of {b['session_steps']:.0f} "
                f"session steps, the whole draft in when taken in "
                f"{_f(100 * b['ready_share'] if b['ready_share'] is not None else None, 0)}%, "
                f"a draft verified (waited for, or in part) in "
                f"{_f(100 * b['verified_share'] if b['verified_share'] is not None else None, 0)}"
                f"%; chunks sent "
                f"{b['chunks_sent']:.0f} (resent {b['chunks_resent']:.0f}), tokens kept "
                f"across fixes {b['tokens_kept']:.0f}, discarded {b['tokens_discarded']:.0f}; "
                f"draft tokens sent {b['draft_tokens']:.0f}, accepted "
                f"{b.get('accepted_tokens', 0):.0f}, wasted {b.get('wasted_tokens', 0):.0f}; "
                f"steps waited for it {b.get('waited_s', 0):.1f} s")
            e = b.get("empty_drafts")
            if e and sum(e.values()):
                lines.append(f"    asked for a draft and given none: {sum(e.values()):.0f} "
                             f"session steps: at the session's opening {e['opening']:.0f}, "
                             f"after a fix {e['fix']:.0f}, again (the step before had none) "
                             f"{e.get('again', 0):.0f}, otherwise {e['other']:.0f}")
            fill = b.get("fill")
            if fill and fill["tokens"]:
                lines.append(f"    the verifier's own drafts for its empty ones (--fill-drafts): "
                             f"{fill['tokens']:.0f} tokens, {fill['accepted']:.0f} accepted")
            c = b.get("commit_to_draft")
            if c:
                lines.append(f"    {commit_to_draft_line(c)}, then the chunk's round trip to "
                             f"the cache {_f(c['link_rtt_ms'], 1)} ms")
        if f["bound_by_boards"]:
            lines.append(f"  {f['sessions']}x{f['boards']}: BOUND BY the boards' cores "
                         f"({_f(100 * f['boards_busy'], 0)}% busy)")
    return "\n".join(lines)
