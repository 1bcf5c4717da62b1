"""A live ``edgespec serve --http-port`` for the HTTP API's tests (``test_http_api``,
``test_http_finish_and_metrics``, ``test_http_refusals``): the server (with a MaG board attached,
or none), the official ``openai`` client on it, one plain HTTP call, and the target-only
reference of a prompt. Its ``server`` and ``api`` fixtures (the default server, a board
attached) are imported into the modules that share them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from conftest import hf_greedy

from edgespec.wire.channels import free_port
from procs import Proc, start_serve


def call(method: str, url: str, body=None, headers=None, raw: bytes | None = None
         ) -> tuple[int, dict | str]:
    """One plain HTTP call (stdlib): (status, parsed JSON or text)."""
    import urllib.error
    import urllib.request

    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


TOKEN = "h77p"
PROMPT = "abcabcab"
MESSAGES = [{"role": "user", "content": "xyzxyz"}]
N = 40
MAX_BODY = 1_000_000  # the test server's --max-request-bytes


@contextmanager
def http_server(model_dir: Path, tmp: Path, board: bool = True,
                extra: tuple = ()) -> Iterator[dict]:
    """The server on ``model_dir``, with a MaG board attached (``board``) or none, ``extra``
    options added; yields its gRPC address, HTTP base URL, process and the board's metrics URL
    (None without a board). The verifier waits (up to 5 s) for the drafter's answer at every
    step, with a fixed draft length: what is drafted does not depend on the machine's speed."""
    http_port = free_port()
    serve, address = start_serve(model_dir, tmp, token=TOKEN, extra=[
        "--http-port", http_port, "--draft-wait-ms", 5000, "--no-adaptive",
        "--max-request-bytes", MAX_BODY, *extra])
    drafter, drafter_metrics = None, None
    try:
        if board:
            port = free_port()
            drafter = Proc(["drafter", "--cache", address, "--device-id", "board-1",
                            "--drafter", "mag", "--auth-token", TOKEN, "--metrics-port", port],
                           tmp / "drafter-board-1.log")
            drafter.wait_for("attached to")
            drafter_metrics = f"http://127.0.0.1:{port}/metrics"
        yield {"address": address, "base": f"http://127.0.0.1:{http_port}", "serve": serve,
               "drafter_metrics": drafter_metrics}
    finally:
        drafter_code = drafter.stop() if drafter is not None else 0
        code = serve.stop()
    assert (drafter_code, code) == (0, 0)


def openai_client(server: dict) -> openai.OpenAI:
    """The official client on ``server``, its ``model_id`` the served model's."""
    client = openai.OpenAI(base_url=server["base"] + "/v1", api_key=TOKEN, max_retries=0,
                           timeout=120)
    client.model_id = client.models.list().data[0].id
    return client


@pytest.fixture(scope="module")
def server(looping_dir, tmp_path_factory):
    with http_server(looping_dir, tmp_path_factory.mktemp("http")) as s:
        yield s


@pytest.fixture(scope="module")
def api(server):
    return openai_client(server)


def reference(looping, ids, n=N) -> tuple[list[int], str]:
    out = hf_greedy(looping.model, ids, n)
    return out, looping.tokenizer.decode(out, skip_special_tokens=True)
