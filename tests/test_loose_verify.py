"""Loose verification (FLy, ``--verify loose``): the acceptance rule on hand-made logits, the
engine marking its sessions lossy while exact stays lossless, the CLI's warning, and a verifier
that refuses loose requests unless its operator opted in."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from cli_inprocess import run_cli
from conftest import hf_greedy

import edgespec
from edgespec.config import ConfigError, EngineConfig, LooseParams, SamplingParams
from edgespec.drafters import build_drafter
from edgespec.engine.spec_engine import Request, SpecEngine
from oracles import accept_loosely, entropy
from edgespec.runner.target_runner import TargetRunner
from edgespec.verify.keyed_noise import keyed_choice
from oracles import filtered_logits, verify_greedy
from oracles import verify_batch
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc

V = 8
FLAT = 0.5  # a row's winner by a little: high entropy (about 2 nats over 8 tokens)
SHARP = 40.0  # a row's winner by far: entropy about 0


def rows(winners: list[int], margins: list[float]) -> torch.Tensor:
    """Logits [len(winners), V]: row i has argmax winners[i], ahead of every other token by
    margins[i], which sets the row's entropy."""
    out = torch.zeros(len(winners), V)
    for i, (w, m) in enumerate(zip(winners, margins)):
        out[i, w] = m
    return out


def greedy(logits, draft, loose=LooseParams(entropy=1.0, window=2)):
    return verify_batch(logits[None], [draft], [SamplingParams()], [0], "loose", loose)[0]


def exact(logits, draft):
    return verify_batch(logits[None], [draft], [SamplingParams()], [0])[0]


# -- the rule ---------------------------------------------------------------------------------
def test_hand_made_rows_have_the_entropy_they_claim():
    lg = rows([5, 5], [FLAT, SHARP])
    assert entropy(lg[0]) > 1.5 and entropy(lg[1]) < 1e-6
    assert entropy(torch.tensor([0.0, float("-inf"), 0.0])) == pytest.approx(math.log(2))
    assert entropy(torch.tensor([float("nan"), 0.0])) == 0.0


def test_a_high_entropy_mismatch_is_accepted_when_the_window_agrees():
    # target argmax 5 at position 0; the draft says 3 there, then 6, 7 which the target
    # (conditioned on the draft) agrees with; bonus 1
    lg = rows([5, 6, 7, 1], [FLAT, SHARP, SHARP, SHARP])
    assert exact(lg, [3, 6, 7]) == (0, 5)
    assert greedy(lg, [3, 6, 7]) == (3, 1)


def test_a_low_entropy_mismatch_is_never_accepted():
    lg = rows([5, 6, 7, 1], [SHARP, SHARP, SHARP, SHARP])
    for w in (0, 1, 2):
        assert greedy(lg, [3, 6, 7], LooseParams(entropy=1.0, window=w)) == (0, 5)


def test_a_window_that_disagrees_or_runs_past_the_draft_rejects():
    lg = rows([5, 6, 7, 1], [FLAT, SHARP, SHARP, SHARP])
    assert greedy(lg, [3, 6, 4]) == (0, 5)  # position 2 disagrees
    assert greedy(lg, [3, 6]) == (0, 5)  # W = 2 needs positions 1 and 2 in the draft
    assert greedy(lg, [3, 6], LooseParams(entropy=1.0, window=1)) == (2, 7)


def test_window_zero_is_the_entropy_gate_alone():
    lg = rows([5, 6, 1], [FLAT, SHARP, SHARP])
    w0 = LooseParams(entropy=1.0, window=0)
    assert greedy(lg, [3], w0) == (1, 6)  # accepted with nothing after it
    assert greedy(lg, [3, 2], w0) == (1, 6)  # the next mismatch is sharp: rejected there
    assert greedy(lg, [3, 2], LooseParams(entropy=5.0, window=0)) == (0, 5)  # gate closed


def test_the_threshold_is_compared_with_the_entropy():
    lg = rows([5, 6, 7, 1], [FLAT, SHARP, SHARP, SHARP])
    h = entropy(lg[0])
    assert greedy(lg, [3, 6, 7], LooseParams(entropy=h - 0.01, window=2)) == (3, 1)
    assert greedy(lg, [3, 6, 7], LooseParams(entropy=h + 0.01, window=2)) == (0, 5)


def test_several_mismatches_each_pass_the_rule_on_their_own():
    lg = rows([5, 6, 2, 7, 1], [FLAT, SHARP, FLAT, SHARP, SHARP])
    w1 = LooseParams(entropy=1.0, window=1)
    assert greedy(lg, [3, 6, 4, 7], w1) == (4, 1)
    assert greedy(lg, [3, 6, 4, 0], w1) == (2, 2)  # the second one's window disagrees


def test_loose_never_accepts_less_than_exact_and_agrees_when_it_accepts_the_same():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        t = int(torch.randint(1, 6, (1,), generator=gen))
        lg = torch.randn(t + 1, V, generator=gen) * float(torch.rand(1, generator=gen) * 4)
        draft = torch.randint(0, V, (t,), generator=gen).tolist()
        argmax = lg.argmax(-1).tolist()
        draft[: t // 2] = argmax[: t // 2]  # some agreement to start with
        n_exact, tok_exact = exact(lg, draft)
        n_loose, tok_loose = greedy(lg, draft, LooseParams(entropy=0.5, window=1))
        assert n_loose >= n_exact
        if n_loose == n_exact:
            assert tok_loose == tok_exact
        assert tok_loose == argmax[n_loose]  # the emitted token is always the target's


def test_exact_mode_is_unchanged_for_greedy_and_sampling_rows():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 6, V, generator=gen)
    drafts = [[1, 2, 3], [4, 5, 6, 7, 0], []]
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_k=5, seed=7),
              SamplingParams(temperature=1.2, seed=3)]
    starts = [10, 20, 30]
    default = verify_batch(logits, drafts, params, starts)
    # the loosest parameters change what loose mode accepts, and nothing in exact mode
    assert verify_batch(logits, drafts, params, starts, "loose", LooseParams(0.0, 0)) != default
    assert verify_batch(logits, drafts, params, starts, "exact", LooseParams(0.0, 0)) == default
    assert default[0] == verify_greedy(logits[0].argmax(-1).tolist()[:4], drafts[0])


def test_sampled_rows_use_the_keyed_sample_and_never_accept_an_impossible_token():
    p = SamplingParams(temperature=1.0, top_k=4, seed=11)
    logits = torch.zeros(4, V)
    logits[:, :4] = torch.tensor([1.0, 0.9, 0.8, 0.7])  # four near-equal tokens: high entropy
    logits[:, 4:] = -2.0  # outside top-k: probability 0 after processing
    scores = filtered_logits(logits, p)
    choice = [keyed_choice(scores[i], 11, 100 + i) for i in range(4)]
    wrong = next(x for x in range(4) if x != choice[0])
    loose = LooseParams(entropy=0.5, window=2)
    row = lambda d: verify_batch(logits[None], [d], [p], [100], "loose", loose)[0]  # noqa: E731
    assert row([wrong, choice[1], choice[2]]) == (3, choice[3])
    assert row([7, choice[1], choice[2]]) == (0, choice[0])  # outside top-k: never
    assert verify_batch(logits[None], [[wrong, choice[1], choice[2]]], [p], [100]) == \
        [(0, choice[0])]


def test_the_rule_asks_for_the_window_only_after_the_gate():
    asked = []

    def choice_at(i):
        asked.append(i)
        return [5, 6, 7, 1][i]

    assert accept_loosely([3, 6, 7], choice_at, lambda i: 0.1, lambda i, x: True,
                          LooseParams(entropy=1.0, window=2)) == (0, 5)
    assert asked == [0]


def test_knobs_and_modes_are_validated():
    for bad in ({"entropy": -0.1}, {"entropy": float("nan")}, {"window": -1}, {"window": 65}):
        with pytest.raises(ConfigError):
            LooseParams(**bad)
    with pytest.raises(ConfigError):
        EngineConfig(verify="lenient")
    assert EngineConfig().verify == "exact"


# -- the engine -------------------------------------------------------------------------------
PROMPTS = [[1, 10, 11, 12, 13, 10, 11, 12, 13, 10], [1, 30, 31, 30, 31, 30]]


@pytest.fixture(scope="module")
def runner(tiny):
    return TargetRunner(tiny.model, n_slots=4, max_len=256)


def _mag():
    drafter = build_drafter("mag")
    drafter.min_confidence = 0.0  # draft every time: exercise rejections
    return drafter


def _run(runner, cfg, **req):
    cfg = EngineConfig(max_draft=4, window=8, chunk=2, adaptive=False, draft_wait_ms=2000,
                       **cfg)
    with SpecEngine(runner, _mag(), cfg, stop_ids={2}) as engine:
        return [engine.generate(Request(p, 40, **req)) for p in PROMPTS]


def test_exact_engine_is_identical_to_target_only_and_says_lossless(tiny, runner):
    for res, prompt in zip(_run(runner, {}), PROMPTS):
        assert res.token_ids == hf_greedy(tiny.model, prompt, 40)
        assert res.stats.lossy is False and res.stats.to_dict()["lossless"] is True


def test_loose_engine_accepts_what_exact_rejects_and_marks_its_sessions_lossy(runner):
    exact_runs = _run(runner, {})
    # gate always open (the tiny model's entropy is well above 0), no window: every draft
    # token is accepted, but for the last step's, which the length limit may cut
    loose_runs = _run(runner, {"verify": "loose",
                               "loose": LooseParams(entropy=0.0, window=0, min_ratio=1e-30)})
    for res in loose_runs:
        assert res.stats.lossy is True and res.stats.to_dict()["lossless"] is False
        assert res.stats.draft_tokens > 0
        assert res.stats.draft_tokens - res.stats.accepted_tokens <= 4  # max_draft
    rate = lambda runs: (sum(r.stats.accepted_tokens for r in runs)  # noqa: E731
                         / sum(r.stats.draft_tokens for r in runs))
    assert rate(loose_runs) > rate(exact_runs)


def test_a_request_may_insist_on_exact_verification_on_a_loose_engine(tiny, runner):
    results = _run(runner, {"verify": "loose", "loose": LooseParams(entropy=0.0, window=0)},
                   verify="exact")
    for res, prompt in zip(results, PROMPTS):
        assert res.token_ids == hf_greedy(tiny.model, prompt, 40)
        assert res.stats.lossy is False


def test_an_exact_engine_refuses_a_loose_request(runner):
    with SpecEngine(runner, _mag(), EngineConfig(max_draft=4), stop_ids={2}) as engine:
        with pytest.raises(ConfigError, match="--verify loose"):
            engine.generate(Request(PROMPTS[0], 8, verify="loose"))
        with pytest.raises(ConfigError, match="exact"):
            engine.generate(Request(PROMPTS[0], 8, verify="sloppy"))
        assert engine.active == []


# -- the command line -------------------------------------------------------------------------
# in this process (tests/cli_inprocess.py); tests/test_cli.py runs generate as a process
@pytest.mark.slow  # generate runs
def test_generate_loose_warns_and_reports_lossy_stats(tiny_dir):
    r = run_cli("generate", "abcabcabc", "--model", tiny_dir, "--max-new-tokens", 12,
                "--verify", "loose", "--loose-entropy", 0.5, "--loose-window", 1, "--json")
    assert r.returncode == 0, r.stderr
    assert "lossy" in r.stderr and "may differ" in r.stderr
    assert json.loads(r.stdout)["stats"]["lossless"] is False
    r = run_cli("generate", "abcabcabc", "--model", tiny_dir, "--max-new-tokens", 6,
                "--verify", "loose")
    assert r.returncode == 0, r.stderr
    assert "lossless: false" in r.stderr


@pytest.mark.slow  # a generate run
def test_generate_exact_does_not_warn(tiny_dir):
    r = run_cli("generate", "abcabcabc", "--model", tiny_dir, "--max-new-tokens", 6)
    assert r.returncode == 0, r.stderr
    assert "lossy" not in r.stderr and "lossless: true" in r.stderr


def test_bad_loose_knobs_are_refused_by_the_cli(tiny_dir):
    r = run_cli("generate", "abc", "--model", tiny_dir, "--verify", "loose",
                "--loose-window", -1)
    assert r.returncode == 2 and "loose window" in r.stderr


# -- the verifier -----------------------------------------------------------------------------
def _server(model_dir, verify: str, http: bool = False):
    from edgespec_cli.server import EdgespecServer, ServerOptions

    return EdgespecServer(ServerOptions(
        listen="127.0.0.1:0", model=str(model_dir), drain_timeout_s=5,
        http_port=0 if http else None,
        engine=EngineConfig(max_sessions=2, max_context=256, verify=verify,
                            loose=LooseParams(entropy=0.0, window=0)))).start()


def test_an_exact_verifier_refuses_loose_requests_with_invalid_argument(looping_dir, looping):
    srv = _server(looping_dir, "exact")
    try:
        with edgespec.Client(f"127.0.0.1:{srv.port}", timeout=120) as c:
            with pytest.raises(edgespec.client.InvalidRequest, match="--verify loose"):
                c.generate(prompt_ids=PROMPTS[0], max_new_tokens=8, verify="loose")
            res = c.generate(prompt_ids=PROMPTS[0], max_new_tokens=20, verify="exact")
        assert res.lossless and res.stats["lossless"] is True
        assert res.token_ids == hf_greedy(looping.model, PROMPTS[0], 20)
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = pb_grpc.VerifierStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(prompt_ids=PROMPTS[0], verify="loose"),
                                   timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        srv.stop(drain_timeout_s=0)


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_loose_verifier_says_lossy_over_grpc_and_http(looping_dir, looping):
    srv = _server(looping_dir, "loose", http=True)
    try:
        with edgespec.Client(f"127.0.0.1:{srv.port}", timeout=120) as c:
            loose = c.generate(prompt_ids=PROMPTS[1], max_new_tokens=12)
            exact_res = c.generate(prompt_ids=PROMPTS[1], max_new_tokens=12, verify="exact")
        assert not loose.lossless and loose.stats["lossless"] is False
        assert exact_res.lossless
        assert exact_res.token_ids == hf_greedy(looping.model, PROMPTS[1], 12)
        url = f"http://127.0.0.1:{srv.http_port}/v1/completions"
        body = {"model": srv.model_name, "prompt": PROMPTS[1], "max_tokens": 6,
                "temperature": 0}
        status, r = post(url, body)
        assert status == 200 and r["edgespec"]["lossless"] is False
        status, r = post(url, {**body, "verify": "exact"})
        assert status == 200 and r["edgespec"]["lossless"] is True
        status, r = post(url, {**body, "verify": "maybe"})
        assert status == 400 and r["error"]["param"] == "verify"
    finally:
        srv.stop(drain_timeout_s=0)


def test_an_implausible_token_is_never_accepted_loosely():
    from oracles import verify_loose

    # position 0: a flat distribution over tokens 0-3 (high entropy) and token 7 far below
    row0 = torch.full((8,), -30.0)
    row0[:4] = 0.0
    row0[7] = -3.0  # e^-3 ~ 0.05 of the top token's probability
    rows = torch.stack([row0] + [torch.nn.functional.one_hot(torch.tensor(t), 8).float() * 9
                                 for t in (5, 5, 5)])
    params = SamplingParams()
    lax = LooseParams(entropy=0.5, window=1, min_ratio=0.01)
    assert verify_loose(rows, [7, 5], params, 0, lax)[0] == 2  # plausible enough for 0.01
    strict = LooseParams(entropy=0.5, window=1)  # the default min_ratio 0.1
    assert verify_loose(rows, [7, 5], params, 0, strict) == (0, 0)
