"""How a request to a live `edgespec serve --http-port` finishes, and what the server counts of
it: a stop string's cut and its ``stop`` finish; /metrics (parsed with prometheus_client's
parser) agreeing with the generation just made and holding every metric the Grafana dashboard
reads; `edgespec status` after a generation; a client that disconnects, or an operator's
cancel, ending the session as ``cancelled``, and that error marked not to be retried. The
completions themselves: tests/test_http_api.py."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

import edgespec
from prometheus_client.parser import text_string_to_metric_families

from edgespec.models.loading import encode_prompt
from edgespec.wire.channels import free_port
from http_harness import N, PROMPT, TOKEN, api, call, reference, server  # noqa: F401
from procs import FROZEN_DRAFTER_ENV, start_drafter, start_serve

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier


def test_stop_string_cuts_the_text_before_it(server, api, looping):
    ids = encode_prompt(looping.tokenizer, PROMPT, raw=True)
    _, ref_text = reference(looping, ids)
    stop = ref_text[6:8]
    expected = ref_text[: ref_text.find(stop)]
    for stream in (False, True):
        kw = dict(model=api.model_id, prompt=PROMPT, max_tokens=N, temperature=0, stop=[stop])
        if stream:
            chunks = list(api.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = api.completions.create(**kw)
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert (text, finish) == (expected, "stop")
    before = _metrics(server)
    r = api.completions.create(model=api.model_id, prompt=PROMPT, max_tokens=N, temperature=0,
                               stop=[stop])
    after = _metrics(server)
    key = "edgespec:request_success_total{finished_reason=%s}"
    assert after.get(key % "stop", 0) - before.get(key % "stop", 0) == 1
    assert after.get(key % "cancelled", 0) == before.get(key % "cancelled", 0)
    # usage counts the tokens up to the one that completes the stop string, not its chunk
    stop_ids = encode_prompt(looping.tokenizer, ref_text[: ref_text.find(stop) + len(stop)],
                             raw=True)
    assert r.usage.completion_tokens == len(stop_ids)


def _metrics(server) -> dict[str, float]:
    text = call("GET", server["base"] + "/metrics")[1]
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


def test_metrics_agree_with_the_generation_just_made(server, api):
    """The live metrics count what the response says was generated, drafted and accepted. A
    step's counters are added once the step returns, and the step may finish the request
    first, and adds them one counter after another: all of them are awaited (up to 60 s),
    not raced."""
    before = _metrics(server)
    r = api.completions.create(model=api.model_id, prompt=PROMPT, max_tokens=N, temperature=0)
    stats = r.model_extra["edgespec"]
    after = _metrics(server)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    def per_position() -> float:
        return sum(v - before.get(k, 0) for k, v in after.items()
                   if k.startswith("edgespec:spec_decode_num_accepted_tokens_per_pos_total"))

    deadline = time.monotonic() + 60
    while (delta("edgespec:spec_decode_num_draft_tokens_total") < stats["drafted"]
           or delta("edgespec:spec_decode_num_accepted_tokens_total") < stats["accepted"]
           or per_position() < stats["accepted"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        after = _metrics(server)

    assert delta("edgespec:generation_tokens_total") == r.usage.completion_tokens
    assert delta("edgespec:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("edgespec:spec_decode_num_draft_tokens_total") == stats["drafted"]
    assert delta("edgespec:spec_decode_num_accepted_tokens_total") == stats["accepted"]
    assert stats["drafted"] > 0  # the verifier waited for every draft: MaG drafts this prompt
    assert per_position() == stats["accepted"]
    assert delta(f"edgespec:request_success_total{{finished_reason={r.choices[0].finish_reason}}}"
                 ) == 1
    assert delta("edgespec:time_to_first_token_seconds_count") == 1
    assert after["edgespec:spec_decode_num_accepted_tokens_total"] <= \
        after["edgespec:spec_decode_num_draft_tokens_total"]
    assert after["edgespec:kv_slots_free"] == 8 and after["edgespec:num_requests_running"] == 0
    assert after["edgespec:model_info{dtype=float32}"] == 1


def test_every_metric_the_dashboard_reads_is_in_the_live_metrics(server, api):
    from test_metrics_names import NAME, dashboard_queries

    api.completions.create(model=api.model_id, prompt=PROMPT, max_tokens=N, temperature=0)
    exposed = set()
    for url in (server["base"] + "/metrics", server["drafter_metrics"]):
        for family in text_string_to_metric_families(call("GET", url)[1]):
            exposed.update(s.name for s in family.samples)
    dash = json.loads((Path(__file__).resolve().parent.parent / "deploy" / "grafana" /
                       "edgespec.json").read_text())
    used = {name for q in dashboard_queries(dash) for name in NAME.findall(q)}
    assert used and not used - exposed, sorted(used - exposed)


def test_status_command_after_a_generation(server, api):
    done = api.completions.create(model=api.model_id, prompt=PROMPT, max_tokens=10,
                                  temperature=0)
    cmd = [sys.executable, "-m", "edgespec_cli", "status", "--address", server["address"],
           "--auth-token", TOKEN]
    r = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["healthy"] and st["kv_slots"] == 8 and st["free_kv_slots"] == 8
    assert st["dtype"] == "float32"  # what served (the test server pins float32)
    assert st["runner"]["kernels"] == "eager" and st["runner"]["device"] == "cpu"
    assert not st["runner"].get("graph_buckets")  # no CUDA graphs on a CPU
    [board] = [d for d in st["drafters"] if d["device_id"] == "board-1"]
    assert board["attached"] and board["draft_model"] == "mag"
    # whether the board's drafts came in time is how a race falls on a loaded machine (a
    # suite on two cores saw none accepted): the figures' ranges, not their values
    assert 0 <= board["acceptance_rate"] <= 1 and board["mean_acceptance_length"] >= 1
    assert st["tokens_per_s_last_minute"] > 0
    cost = st["cost"]  # the server's since start (int64 fields as strings)
    assert cost["cpu_s"] > 0 and int(cost["committed_tokens"]) >= 10
    assert 0 < int(cost["forwards"]) <= int(cost["committed_tokens"])
    assert 0 <= int(cost["accepted_tokens"]) <= int(cost["draft_tokens"])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert "CPU ms a committed token" in r.stdout and "tokens a forward" in r.stdout
    assert r.returncode == 0 and "board-1" in r.stdout and "KV slots free: 8/8" in r.stdout
    assert "float32" in r.stdout
    assert "runner: eager kernels on cpu, no CUDA graphs" in r.stdout
    # the kernel set: its fingerprint is the OpenAI responses' system_fingerprint
    fingerprint = st["runner"]["kernel_set"]
    assert re.fullmatch(r"[0-9a-f]{16}", fingerprint) and done.system_fingerprint == fingerprint
    assert f"kernel set {fingerprint}: eager kernels, packed products" in r.stdout
    # into a pipe whose reader has gone (`| head -n 0`): the read end closed before the command
    # starts, so its first write surely fails; quiet, SIGPIPE's status, as a Unix tool's
    read, write = os.pipe()
    os.close(read)
    try:
        piped = subprocess.run(cmd, stdout=write, stderr=subprocess.PIPE, text=True,
                               timeout=120)
    finally:
        os.close(write)
    assert piped.returncode == 141 and piped.stderr == "", piped.stderr
    # no token: a fixable mistake (2), the message naming what to give
    r = subprocess.run(cmd[:-2], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--auth-token" in r.stderr and "Traceback" not in r.stderr


def test_a_client_that_disconnects_cancels_its_session(looping_dir, tmp_path):
    """A drafter frozen with SIGSTOP keeps its stream open, so each step waits 50 ms for it: a
    2000-token generation takes over 100 s and is surely running when the client leaves."""
    http_port = free_port()
    serve, address = start_serve(looping_dir, tmp_path, token=TOKEN, extra=[
        "--http-port", http_port, "--draft-wait-ms", 50, "--max-context", 4096,
        "--late-after", 0, "--keep-drafting"], env=FROZEN_DRAFTER_ENV)
    frozen = start_drafter(address, "frozen", tmp_path, "mag", token=TOKEN,
                           env=FROZEN_DRAFTER_ENV)
    try:
        frozen.wait_for("attached to")
        frozen.popen.send_signal(signal.SIGSTOP)
        base = f"http://127.0.0.1:{http_port}"
        model = call("GET", base + "/v1/models",
                     headers={"Authorization": f"Bearer {TOKEN}"})[1]["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 2000, "temperature": 0,
                "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        while True:
            line = resp.fp.readline().decode()
            assert line, f"the stream ended before any text:\n{serve.text()[-3000:]}"
            if line.startswith("data: ") and '"text": "' in line and '"text": ""' not in line:
                break  # a first piece of text: the session runs; now leave
        conn.sock.close()
        conn.close()
        cancelled = "edgespec:request_success_total{finished_reason=cancelled}"

        def wait_for(what, ok):
            deadline = time.monotonic() + 60
            while not ok(m := _metrics({"base": base})):
                assert time.monotonic() < deadline, f"{what}:\n{serve.text()[-3000:]}"
                time.sleep(0.1)
            return m

        m = wait_for("the abandoned stream kept running", lambda m: m.get(cancelled) == 1)
        generated = m["edgespec:generation_tokens_total"]
        # a non-streamed request whose client goes away before the answer
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": False}),
                     {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        wait_for("the second session never ran",
                 lambda m: m["edgespec:generation_tokens_total"] > generated)
        conn.sock.close()
        conn.close()
        m = wait_for("the abandoned request kept running", lambda m: m.get(cancelled) == 2)
        assert m["edgespec:num_requests_running"] == 0
        # a stream whose session the server cancels (an operator's Cancel) ends in an error, not
        # in a finish that would pass its text for a whole answer
        api = openai.OpenAI(base_url=base + "/v1", api_key=TOKEN, max_retries=0, timeout=120)
        stream = api.completions.create(model=model, prompt=PROMPT, max_tokens=2000,
                                        temperature=0, stream=True)
        finishes, told = [], False
        with pytest.raises(openai.APIError, match="cancelled on the server"):
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text and not told:
                    with edgespec.Client(address, token=TOKEN, timeout=60) as c:
                        told = c.cancel(chunk.id.removeprefix("cmpl-"))
                finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
        assert told and finishes == []
        wait_for("the cancelled session", lambda m: m.get(cancelled) == 3)
        # a stream of two choices whose client leaves: both sessions are cancelled
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({**body, "n": 2}),
                     {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        while '"text": "' not in (line := resp.fp.readline().decode()) or '"text": ""' in line:
            assert line, f"the stream ended before any text:\n{serve.text()[-3000:]}"
        conn.sock.close()
        conn.close()
        m = wait_for("the abandoned choices kept running", lambda m: m.get(cancelled) == 5)
        assert m["edgespec:num_requests_running"] == 0
    finally:
        frozen.popen.send_signal(signal.SIGCONT)
        codes = frozen.stop(), serve.stop()
    assert codes == (0, 0)


def test_an_error_a_retry_would_undo_tells_openai_clients_not_to_retry():
    """A non-streamed request whose session an operator cancelled ends in a 503 that OpenAI's
    SDKs would send again (they retry a 5xx): it says ``x-should-retry: false``, which they obey;
    other errors leave the client's retry policy alone."""
    from verifier_node.api_errors import error_response

    cancelled = error_response(503, "the session was cancelled", "server_error", retry=False)
    loading = error_response(503, "the model is still loading", "service_unavailable")
    assert cancelled.headers["x-should-retry"] == "false"
    assert "x-should-retry" not in loading.headers
