"""A draft head in the distributed verifier (``edgespec serve --head``), real processes on
loopback: sessions with and without a board drafter stay identical to target-only, the head's
drafts are accepted, and status and metrics report the head. (``--auto`` on the wire: its
per-stack steps cross in Stats, tested in test_stack_choice.)"""

from __future__ import annotations

import time
import urllib.request

import pytest
from conftest import hf_greedy

import edgespec
from procs import free_port, start_drafter, start_serve
from test_heads import _harvest, _prompts

from edgespec.heads.harvest import work_list
from edgespec.heads.training import TargetTensors, TrainSettings, train_head

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier

TOKEN = "s3cret"
PROMPTS = [[1, 10, 11, 12, 13, 10, 11], [1, 50, 51, 52, 53, 54], [1, 30, 31, 30, 31, 30]]


@pytest.fixture(scope="module")
def head_dir(looping, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-head")
    assert _harvest(looping.model, root / "data", work_list(_prompts(12), 0, 0.8, seed=1))
    train_head(TargetTensors.of_model(looping.model, "looping"), root / "data", root / "eagle",
               TrainSettings(kind="eagle", vocab=64, steps=120, batch=8, span=16, context=8,
                             depth=4, lr=3e-3), say=lambda m: None)
    return root / "eagle"


def test_serve_with_a_head_is_lossless_with_and_without_a_board(looping, looping_dir,
                                                                 head_dir, tmp_path):
    http = free_port()
    serve, address = start_serve(looping_dir, tmp_path, token=TOKEN,
                                 extra=["--head", head_dir, "--http-port", http])
    drafter = start_drafter(address, "mag-1", tmp_path, "mag")
    try:
        drafter.wait_for("attached to")
        refs = [hf_greedy(looping.model, p, 40) for p in PROMPTS]
        with edgespec.Client(address, token=TOKEN, timeout=120) as c:
            with_board = [c.generate(prompt_ids=p, max_new_tokens=40, device_id="mag-1")
                          for p in PROMPTS]
            assert drafter.stop() == 0
            # the server sees the board's stream end a moment after the process does: until
            # then a session without a device may still be placed on it
            deadline = time.monotonic() + 60
            while any(d["attached"] for d in c.status()["drafters"]):
                assert time.monotonic() < deadline, "the stopped board still shows attached"
                time.sleep(0.2)
            alone = [c.generate(prompt_ids=p, max_new_tokens=40) for p in PROMPTS]
            status = c.status()
        for res in (with_board, alone):
            assert [r.token_ids for r in res] == refs
        assert all(r.device_id == "" for r in alone)
        assert sum(r.stats["head_accepted"] for r in alone) > 0
        head = status["head"]
        assert head["kind"] == "eagle" and head["source"] == str(head_dir)
        assert int(head["accepted_tokens"]) == sum(r.stats["head_accepted"]
                                                   for r in with_board + alone)
        text = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10).read()
        assert b"edgespec:head_accepted_tokens_total" in text
    finally:
        drafter.stop()
        rc = serve.stop()
    assert rc == 0, serve.text()[-2000:]
