"""The distributed system on loopback with real processes: one `edgespec serve`, four drafters
(two MaG, one tiny model drafter, one drafting token trees), concurrent clients, over the
embedded Redis. An external Redis by URL serves `test_verifier_and_cache_run_as_separate_processes`
here; the store's contract suite (``test_cache_store``, ``test_store_contract``) runs over both
kinds, so the cluster's tests are not run a second time over the external one (a minute of the
suite's time)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from conftest import hf_greedy

import edgespec
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from procs import start_drafter, start_serve

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier

TOKEN = "s3cret"
PROMPTS = [
    [1, 10, 11, 12, 13, 10, 11, 12, 13, 10],
    [1, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61],
    [1, 30, 31, 30, 31, 30],
    [1, 20, 21, 22, 20, 21],
    [1, 70, 71, 72, 73, 74],
    [1, 40, 41, 40, 41, 40, 41],
]


@pytest.fixture(scope="module")
def cluster(looping_dir, tiny_draft_dir, tmp_path_factory):
    """serve over the embedded Redis (the module docstring says where the external one is
    tested) and its four drafters."""
    tmp = tmp_path_factory.mktemp("cluster")
    # every step waits (up to 5 s) until the drafter has answered, with a fixed draft length:
    # what gets drafted and accepted then does not depend on how fast the machine is
    serve, address = start_serve(looping_dir, tmp, None, token=TOKEN,
                                 extra=["--draft-wait-ms", 5000, "--no-adaptive"])
    drafters = {name: start_drafter(address, name, tmp, spec, extra=extra)
                for name, spec, extra in
                [("mag-1", "mag", ()), ("mag-2", "mag", ()),
                 ("model-1", f"model:{tiny_draft_dir}", ()),
                 ("tree-1", "mag+cacheback", ("--tree-width", "4"))]}
    for d in drafters.values():
        d.wait_for("attached to")
    state = {"address": address, "serve": serve, "drafters": drafters, "model": looping_dir}
    yield state
    codes = {name: d.stop() for name, d in drafters.items()}
    codes["serve"] = state["serve"].stop()
    assert set(codes.values()) == {0}, codes


@pytest.fixture(scope="module")
def refs(looping):
    return [hf_greedy(looping.model, p, 60) for p in PROMPTS]


def client(cluster, **kw):
    return edgespec.Client(cluster["address"], token=TOKEN, timeout=120, **kw)


def test_six_concurrent_sessions_identical_to_target_only(cluster, refs):
    def run(i):
        with client(cluster) as c:
            device = "model-1" if i == 5 else None  # one session on the model drafter
            return c.generate(prompt_ids=PROMPTS[i], max_new_tokens=60, device_id=device)

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(run, range(6)))
    for res, ref in zip(results, refs):
        assert res.token_ids == ref
        assert res.finish_reason in ("stop", "length")
    assert {r.device_id for r in results} >= {"mag-1", "mag-2", "model-1"}
    assert sum(r.stats["drafted"] for r in results) > 0
    # the looping target's output cycles: MaG's drafts get accepted through the whole path
    assert sum(r.stats["accepted"] for r in results) > 60


def test_a_tree_drafting_device_gives_target_only_output(cluster, refs):
    """`edgespec drafter --tree-width 4`: tree chunks through the cache and the verifier."""
    def run(i):
        with client(cluster) as c:
            return c.generate(prompt_ids=PROMPTS[i], max_new_tokens=60, device_id="tree-1")

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(run, range(3)))
    for res, ref in zip(results, refs):
        assert res.token_ids == ref and res.device_id == "tree-1"
    assert sum(r.stats["drafted"] for r in results) > 0
    assert "cannot draft" not in cluster["drafters"]["tree-1"].text()


def test_stream_and_async_client_match(cluster, refs):
    with client(cluster) as c:
        pieces = list(c.stream(prompt_ids=PROMPTS[0], max_new_tokens=60))
    assert [t for p in pieces for t in p.token_ids] == refs[0]

    async def go():
        async with edgespec.AsyncClient(cluster["address"], token=TOKEN, timeout=60) as ac:
            assert ac.last_session_id is None
            out = await ac.generate(prompt_ids=PROMPTS[2], max_new_tokens=60)
            # as Client's: the session to cancel by, known from the stream's first response
            return out, ac.last_session_id, ac.last_resumes

    out, last, resumes = asyncio.run(go())
    assert out.token_ids == refs[2]
    assert last == out.session_id and last and resumes == out.resumed


def test_text_prompt_goes_through_the_chat_template(cluster, looping):
    from edgespec.models.loading import encode_prompt

    ids = encode_prompt(looping.tokenizer, "abcabc")
    with client(cluster) as c:
        res = c.generate("abcabc", max_new_tokens=20)
        raw = c.generate("abcabc", raw=True, max_new_tokens=5)
    assert res.prompt_tokens == len(ids) and res.token_ids == hf_greedy(looping.model, ids, 20)
    assert raw.prompt_tokens == len(looping.tokenizer("abcabc")["input_ids"])


def test_killed_drafter_mid_session_still_completes_identically(cluster, looping, tmp_path):
    victim = start_drafter(cluster["address"], "victim", tmp_path)
    victim.wait_for("attached to")
    prompt = PROMPTS[0]
    ref = hf_greedy(looping.model, prompt, 300)
    got = []
    with client(cluster) as c:
        for i, piece in enumerate(c.stream(prompt_ids=prompt, max_new_tokens=300,
                                           device_id="victim")):
            got.extend(piece.token_ids)
            if i == 3:
                victim.kill()
    assert i > 10  # the session went on well after its drafter died
    assert got == ref
    victim.stop()


def test_stale_chunk_is_refused(cluster):
    channel = grpc.insecure_channel(cluster["address"])
    stub = pb_grpc.DraftCacheStub(channel)
    meta = [("authorization", f"Bearer {TOKEN}")]
    with client(cluster) as c:
        # a session that ended before the chunk came is refused as finished, not as stale: on a
        # loaded machine the 300 tokens may all be out by then, and a new session is tried
        for _ in range(5):
            stream = c.stream(prompt_ids=PROMPTS[1], max_new_tokens=300, device_id="mag-1")
            next(stream)
            sid = c.last_session_id
            chunk = pb.DraftChunk(session_id=sid, epoch=0, start=len(PROMPTS[1]), tokens=[5])
            with pytest.raises(grpc.RpcError) as e:
                stub.PushDraft(chunk, metadata=meta + [("x-edgespec-device", "mag-1")])
            if "session is finished" not in e.value.details():
                break
            list(stream)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "epoch" in e.value.details() or "starts at" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # not this device's session
            stub.PushDraft(chunk, metadata=meta + [("x-edgespec-device", "mag-2")])
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as e:
            stub.PushDraft(pb.DraftChunk(session_id="nope", tokens=[1]), metadata=meta)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        rest = [t for p in stream for t in p.token_ids]
        assert len(rest) > 0
    channel.close()


def test_unauthenticated_calls_are_refused(cluster):
    with edgespec.Client(cluster["address"], token="wrong", timeout=10) as c:
        with pytest.raises(edgespec.Unauthenticated):
            c.generate(prompt_ids=PROMPTS[0], max_new_tokens=5)
    with edgespec.Client(cluster["address"], timeout=10) as c:
        with pytest.raises(edgespec.Unauthenticated):
            c.generate(prompt_ids=PROMPTS[0], max_new_tokens=5)


@pytest.mark.parametrize("kwargs,error,needle", [
    (dict(prompt_ids=[1, 10**6]), edgespec.InvalidRequest, "token ids"),
    (dict(prompt_ids=[1] * 600), edgespec.InvalidRequest, "context limit"),
    (dict(prompt_ids=[1, 2], device_id="nobody"), edgespec.PreconditionFailed, "not attached"),
    (dict(prompt="x" * (5 * 1024 * 1024)), edgespec.Overloaded, ""),
])
def test_bad_requests_get_the_right_status_and_disturb_nobody(cluster, refs, kwargs, error, needle):
    with client(cluster) as c:
        with pytest.raises(error) as e:
            c.generate(max_new_tokens=5, **kwargs)
        assert needle in str(e.value)
        assert c.generate(prompt_ids=PROMPTS[3], max_new_tokens=60).token_ids == refs[3]


def test_deadline_is_enforced(cluster):
    """A call its deadline cannot hold fails: refused at once (Overloaded, naming the deadline)
    once the verifier has measured its pace, or DEADLINE_EXCEEDED before that."""
    with client(cluster) as c:
        with pytest.raises((edgespec.DeadlineExceeded, edgespec.Overloaded)) as e:
            c.generate(prompt_ids=PROMPTS[1], max_new_tokens=400, timeout=0.05)
        if isinstance(e.value, edgespec.Overloaded):
            assert "deadline" in str(e.value)
        assert c.generate(prompt_ids=PROMPTS[1], max_new_tokens=5).token_ids


def test_cancel_unknown_and_running_sessions(cluster):
    with client(cluster) as c:
        with pytest.raises(edgespec.NotFound):
            c.cancel("no-such-session")
        # a session that ended before the cancel came cannot be cancelled: on a loaded machine
        # its 400 tokens may all be out by then, and a new session is tried
        for _ in range(5):
            stream = c.stream(prompt_ids=PROMPTS[4], max_new_tokens=400)
            next(stream)
            try:
                cancelled = c.cancel(c.last_session_id)
            except edgespec.NotFound:  # ended and forgotten
                cancelled = False
            pieces = list(stream)
            if cancelled:
                break
        assert cancelled
        assert sum(len(p.token_ids) for p in pieces) < 400


def test_drafter_with_another_tokenizer_is_refused(cluster, tmp_path):
    from conftest import make_tiny_model, make_tokenizer

    other = make_tiny_model(tmp_path / "other", tokenizer=make_tokenizer(extra="éè"))
    d = start_drafter(cluster["address"], "odd", tmp_path, f"model:{other}")
    assert d.popen.wait(timeout=120) == 2
    assert "differs from the target" in d.text() and "Traceback" not in d.text()


@pytest.mark.parametrize("device", ["mag-1", "model-1"])
def test_sampled_output_over_the_network_follows_the_target(cluster, looping, device):
    """Speculative sampling through the cache (a model drafter's keyed samples over gRPC and
    Redis): the first two tokens follow target-only sampling's distribution."""
    from collections import Counter

    import torch

    from edgespec.config import SamplingParams
    from reference import process_logits
    from test_engine import _chi2_ok

    prompt = PROMPTS[2]
    params = SamplingParams(temperature=1.0, top_k=5)
    with torch.no_grad():  # exact marginals; the stop token (2) ends a generation early
        p1 = process_logits(looping.model(torch.tensor([prompt])).logits[0, -1:], params)[0]
        V = p1.shape[0]
        p2 = torch.zeros(V + 1)  # index V: "stopped after the first token"
        for a in torch.nonzero(p1).flatten().tolist():
            if a == 2:
                p2[V] += p1[a]
            else:
                nxt = looping.model(torch.tensor([prompt + [a]])).logits[0, -1:]
                p2[:V] += p1[a] * process_logits(nxt, params)[0]
    n, c1, c2, drafted = 300, Counter(), Counter(), 0

    def run(seeds):  # a seeded generation's tokens are a function of its seed alone (keyed
        with client(cluster) as c:  # sampling), so how the clients interleave changes no count
            return [c.generate(prompt_ids=prompt, max_new_tokens=2, temperature=1.0, top_k=5,
                               seed=seed, device_id=device) for seed in seeds]

    with ThreadPoolExecutor(4) as pool:  # four sessions at a time share the server's steps
        for results in pool.map(run, [range(k, n, 4) for k in range(4)]):
            for res in results:
                c1[res.token_ids[0]] += 1
                c2[res.token_ids[1] if len(res.token_ids) > 1 else V] += 1
                drafted += res.stats["drafted"]
    assert drafted > 0
    assert _chi2_ok(c1, p1, n) and _chi2_ok(c2, p2, n)


def test_seeded_sampling_over_the_network_equals_target_only_whatever_the_drafter(cluster,
                                                                                 looping):
    """Randomness keyed by (seed, position): the same tokens with any drafter, over the
    network, as target-only sampling in process, run after run."""
    from edgespec.config import EngineConfig, SamplingParams
    from edgespec.engine.spec_engine import Request, SpecEngine
    from edgespec.models.loading import stop_token_ids
    from edgespec.runner.target_runner import TargetRunner

    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    engine = SpecEngine(TargetRunner(looping.model, n_slots=1, max_len=512), None,
                        EngineConfig(max_sessions=1, max_context=512), stop_token_ids(looping))
    ref = engine.generate(Request(PROMPTS[1], 50, params)).token_ids
    with client(cluster) as c:
        for device in ("mag-1", "model-1", "mag-1"):
            res = c.generate(prompt_ids=PROMPTS[1], max_new_tokens=50, temperature=0.8,
                             top_p=0.95, seed=7, device_id=device)
            assert res.token_ids == ref, device


def test_drafter_reconnects_and_resumes_after_the_server_restarts(cluster, looping, tmp_path):
    """Runs last in the module: it restarts the server on the same address."""
    serve = cluster["serve"]
    port = int(cluster["address"].rsplit(":", 1)[1])
    mag = cluster["drafters"]["mag-1"]
    before = mag.text().count("attached to")
    assert serve.stop() == 0  # SIGTERM: drained and exited cleanly
    new, address = start_serve(cluster["model"], tmp_path, None, port=port,
                               token=TOKEN, extra=["--draft-wait-ms", 5000, "--no-adaptive"])
    cluster["serve"] = new
    t0 = time.monotonic()
    while mag.text().count("attached to") <= before and time.monotonic() - t0 < 60:
        time.sleep(0.2)
    assert mag.text().count("attached to") > before, mag.text()
    ref = hf_greedy(looping.model, PROMPTS[0], 60)
    with client(cluster) as c:
        res = c.generate(prompt_ids=PROMPTS[0], max_new_tokens=60, device_id="mag-1")
    assert res.token_ids == ref and res.stats["drafted"] > 0


def test_verifier_and_cache_run_as_separate_processes(external_redis, looping_dir, looping,
                                                      tmp_path):
    """`edgespec verifier` and `edgespec cache` on their own addresses, sharing one Redis."""
    import redis as redis_lib

    from procs import Proc, wait_healthy
    from edgespec.wire.channels import free_port

    redis_lib.Redis.from_url(external_redis).flushdb()
    v_addr, c_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    common = ["--redis-url", external_redis, "--auth-token", TOKEN]
    verifier = Proc(["verifier", "--listen", v_addr, "--model", looping_dir,
                     "--max-context", 512, "--draft-wait-ms", 5000, "--no-adaptive",
                     "--fill-drafts", "none", *common],
                    tmp_path / "v.log")
    cache = Proc(["cache", "--listen", c_addr, *common], tmp_path / "c.log")
    drafter = None
    try:
        wait_healthy(v_addr)
        wait_healthy(c_addr)
        drafter = start_drafter(c_addr, "solo", tmp_path)
        drafter.wait_for("attached to")
        with edgespec.Client(v_addr, token=TOKEN, timeout=60) as c:
            res = c.generate(prompt_ids=PROMPTS[0], max_new_tokens=60, device_id="solo")
        assert res.token_ids == hf_greedy(looping.model, PROMPTS[0], 60)
        assert res.stats["accepted"] > 0
    finally:
        for p in (drafter, cache, verifier):
            if p is not None:
                p.stop()

