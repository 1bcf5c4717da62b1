"""A board slower than the verifier's step still gets its drafts verified (real processes, real
gRPC, the embedded Redis).

The board (tests/overtaken_board.py) returns each chunk only once the verifier has committed
past the chunk's start: every chunk is overtaken by the step that decoded its first position
without it, on any machine, fast or loaded. Before drafts survived a commit they agree with, each
such chunk was dropped by the fix that overtook it and no draft was ever verified (every step
waited out its deadline, then decoded alone). Now the fix, which agrees with the chunk's first
token (the looping target's output is what MaG drafts), keeps the rest, sent again at the fix's
end under its epoch, and the next step verifies it. The verifier waits for every draft
(``--late-after 0``) with one token fewer than a chunk (``--max-draft 3``, ``--chunk 4``), so
what is verified does not depend on timing: only how long the first deadline takes does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import hf_greedy

import edgespec
from procs import start_serve

pytestmark = pytest.mark.slow  # processes: not the fast tier

TOKEN = "sl0w"
PROMPTS = [[1, 10, 11, 12, 13, 10, 11, 12, 13, 10], [1, 30, 31, 30, 31, 30]]
N = 28
BOARD = Path(__file__).with_name("overtaken_board.py")


@pytest.fixture(scope="module")
def refs(looping):
    return [hf_greedy(looping.model, p, N) for p in PROMPTS]


def test_boards_whose_every_chunk_is_overtaken_get_drafts_verified(looping_dir, refs, tmp_path):
    # no fill (the default fills a board's empty draft with the verifier's own MaG, which drafts
    # this looping target right: the steps would verify the fills, not the boards' kept tokens)
    serve, address = start_serve(looping_dir, tmp_path, token=TOKEN, extra=[
        "--late-after", 0, "--draft-wait-ms", 1000, "--no-adaptive", "--max-draft", 3,
        "--chunk", 4, "--window", 8, "--fill-drafts", "none"])
    # one session a board: a board drafts one chunk at a time, and one held for a session's
    # commit would hold another session's step (the step waits for every draft) to its deadline
    devices = [f"slow-{i}" for i in range(len(PROMPTS))]
    boards = {d: _start_board(address, d, tmp_path) for d in devices}
    try:
        with edgespec.Client(address, token=TOKEN, timeout=240) as c:
            for d, board in boards.items():
                _wait_attached(c, d, board, tmp_path / f"{d}.log")

            def run(i):
                return c.generate(prompt_ids=PROMPTS[i], max_new_tokens=N,
                                  device_id=devices[i])

            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                results = list(pool.map(run, range(len(PROMPTS))))
            status = {d["device_id"]: d for d in c.status()["drafters"]}
    finally:
        codes = {}
        for d, board in boards.items():
            board.terminate()
            codes[d] = board.wait(timeout=60)
        serve_code = serve.stop()
    assert serve_code == 0, serve.text()[-3000:]
    for i, (res, ref) in enumerate(zip(results, refs)):
        assert res.token_ids == ref and res.device_id == devices[i]
    for d in devices:
        text = (tmp_path / f"{d}.log").read_text()
        assert codes[d] == 0, text
        # the verifier verified the board's drafts ...
        assert int(status[d]["verified_drafts"]) > 0 and int(status[d]["ready_drafts"]) > 0
        # ... because tokens were kept across the fixes that overtook their chunks
        counts = json.loads(text.split("counts: ", 1)[1].splitlines()[0])
        assert counts["tokens_kept"] > 0 and counts["chunks_resent"] > 0, text
    assert all(r.stats["accepted"] > 0 for r in results)


def _start_board(address: str, device: str, tmp_path: Path) -> subprocess.Popen:
    with open(tmp_path / f"{device}.log", "w") as log:
        return subprocess.Popen([sys.executable, str(BOARD), "--cache", address, "--device-id",
                                 device, "--auth-token", TOKEN],
                                stdout=log, stderr=subprocess.STDOUT, cwd=BOARD.parent)


def _wait_attached(client, device: str, board: subprocess.Popen, log_path: Path) -> None:
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(d["device_id"] == device and d["attached"]
               for d in client.status()["drafters"]):
            return
        assert board.poll() is None, log_path.read_text()
        time.sleep(0.2)
    raise TimeoutError(f"{device} never attached:\n{log_path.read_text()}")
