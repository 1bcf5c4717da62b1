"""``edgespec bench-net``: the engine options it is given reach the verifier it spawns (so the
in-process engine and ``edgespec serve`` run the same settings), and end to end on the tiny
looping model, a real ``edgespec serve`` and a MaG ``edgespec drafter`` as processes, every
output identical to the in-process engine's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from edgespec_cli.bench.distributed import serve_engine_args
from edgespec_cli.main import build_parser


def _parsed(*argv: str):
    return build_parser().parse_args(list(argv))


def test_the_engine_options_given_reach_the_spawned_verifier_as_given():
    args = _parsed("bench-net", "--model", "m", "--window", "3", "--max-draft", "5",
                   "--draft-wait-ms", "2.5", "--no-adaptive", "--threads", "1",
                   "--prefill-budget", "64", "--no-cuda-graphs")
    forwarded = serve_engine_args(args)
    serve = _parsed("serve", "--model", "m", *forwarded)
    for name in ("window", "max_draft", "draft_wait_ms", "no_adaptive", "threads",
                 "prefill_budget", "cuda_graphs", "max_context", "chunk", "tree_nodes",
                 "late_after"):
        assert getattr(serve, name) == getattr(args, name), name
    assert serve.window == 3 and serve.no_adaptive is True and serve.cuda_graphs is False
    assert serve.fill_drafts == "none"  # as the in-process engine: the same engine both ways
    # options left unset stay unset: the server's own defaults (its draft wait, its graphs)
    plain = serve_engine_args(_parsed("bench-net", "--model", "m"))
    assert "--draft-wait-ms" not in plain and "--threads" not in plain
    assert not any("cuda-graphs" in a for a in plain)


@pytest.mark.slow
def test_the_distributed_path_against_the_in_process_engine_as_processes(looping_dir,
                                                                         tmp_path):
    out = tmp_path / "bench-net.json"
    # --dtype auto (the default): settled once, in process, and given to the server as settled
    # (the server's own probe, at its own thread count, may choose another and differ)
    r = subprocess.run(
        [sys.executable, "-m", "edgespec_cli", "bench-net", "--model", str(looping_dir),
         "--threads", "1", "--categories", "qa", "--per-category", "2",
         "--max-new-tokens", "12", "--window", "3", "--no-adaptive", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["results"]
    assert len(rows) == 2 and all(row["identical"] for row in rows)
    assert all(row["tokens"] == 12 for row in rows)
    assert all(row["distributed_tokens_per_s"] > 0 and row["inprocess_tokens_per_s"] > 0
               for row in rows)
