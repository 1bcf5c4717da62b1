"""PAD in the verification step (``--verify pad:DIR``): the device rule against the one-row
oracle over random trees, greedy and keyed-sampled; the engine with a classifier (sigma 0 is
exact verification token for token, a classifier that keeps everything lengthens acceptance and
marks its sessions lossy, trees compose); a classifier for another target refused; the modes a
request may ask for; the command line's warning."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, make_tiny_model
from oracles import verify_tree
from test_head_serving import head_dir  # noqa: F401 (a fixture)

from edgespec.config import (ConfigError, EngineConfig, PadParams, SamplingParams, parse_verify,
                             session_verify_mode)
from edgespec.drafters import build_drafter
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.heads.fingerprint import runner_fingerprint
from edgespec.models.loading import load_model
from edgespec.pad.classifier import PadConfig, PadManifest, PivotClassifier, save_classifier
from edgespec.pad.verify_rule import PadVerifier, resolve_classifier_dir
from edgespec.runner.target_runner import TargetRunner
from edgespec.verify.trees import DraftTree
from edgespec.verify.verify_step import VerifyBatch, verify_step

PROMPTS = [[1, 10, 11, 12, 13, 10, 11, 12, 13, 10], [1, 30, 31, 30, 31, 30]]


@pytest.fixture(scope="module")
def runner(tiny):
    return TargetRunner(tiny.model, n_slots=4, max_len=256)


def make_classifier(runner, folder, pivot_logit: float) -> str:
    """A classifier for ``runner`` whose pivot probability is sigmoid(pivot_logit) everywhere
    (its last layer's weights zero): -50 keeps every token, +50 none."""
    cfg = PadConfig(hidden=runner.embed.shape[1], tap=-2, tap_layers=runner.tap_layers(-2))
    model = PivotClassifier(cfg)
    with torch.no_grad():
        model.out.weight.zero_()
        model.out.bias.copy_(torch.tensor([0.0, pivot_logit]))
    save_classifier(folder, model, PadManifest(cfg, runner_fingerprint(runner), "tiny"))
    return str(folder)


# -- the rule on the device against the oracle ------------------------------------------------
def _random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    parents = [rng.randrange(-1, i) for i in range(n)]
    return DraftTree(tuple(rng.randrange(vocab) for _ in range(n)), tuple(parents))


@pytest.mark.parametrize("sampled", [False, True])
def test_the_device_rule_is_the_oracles_over_random_trees(sampled):
    rng = random.Random(7)
    torch.manual_seed(7)
    V = 6  # few tokens: matches, mismatches and equal siblings all happen
    for trial in range(40):
        B = rng.randrange(1, 6)
        trees = [_random_tree(rng, rng.randrange(0, 9), V) for _ in range(B)]
        N = max(len(t) for t in trees)
        logits = torch.randn(B, 1 + N, V) * 2
        keep = torch.rand(B, N) < 0.5  # [B, N]: what a classifier would keep
        modes = [rng.choice(["exact", "pad"]) for _ in range(B)]
        params = [SamplingParams(temperature=0.8, top_k=4, seed=trial * 10 + b) if sampled
                  and b % 2 == 0 else SamplingParams() for b in range(B)]
        starts = [rng.randrange(3, 40) for _ in range(B)]
        vb = VerifyBatch.build([(list(t.tokens), list(t.parents)) for t in trees], starts,
                               params, modes)
        out = verify_step(logits, vb, lenient=lambda lg, tokens, parents: keep[:, :N])
        for b, tree in enumerate(trees):
            row_keep = keep[b, :len(tree)].tolist() if modes[b] == "pad" else None
            want = verify_tree(logits[b, :1 + len(tree)], tree, params[b], starts[b], row_keep)
            flags = want.lenient if modes[b] == "pad" else [0] * len(want.path)
            assert (out.paths[b], out.tokens[b], out.lenient[b]) == \
                (tuple(want.path), want.token, tuple(flags)), (trial, b, modes[b])


def test_a_pad_row_without_a_rule_is_verified_exactly():
    logits = torch.zeros(1, 3, 4)
    logits[0, :, 2] = 5.0  # the target chooses 2 everywhere
    vb = VerifyBatch.build([([1, 2], [-1, 0])], [5], [SamplingParams()], ["pad"])
    out = verify_step(logits, vb)
    assert (out.paths, out.tokens, out.lenient) == ([()], [2], [()])
    out = verify_step(logits, vb, lenient=lambda lg, t, p: torch.ones_like(t, dtype=torch.bool))
    assert (out.paths, out.tokens, out.lenient) == ([(0, 1)], [2], [(1, 0)])


def test_loose_and_pad_rows_keep_their_own_rules_in_one_batch():
    from edgespec.config import LooseParams

    V = 8
    logits = torch.zeros(2, 4, V)
    logits[0, 0, 5] = 0.5  # loose row: after the root a flat distribution (5 by a little)
    for i, w in ((1, 6), (2, 7), (3, 1)):
        logits[0, i, w] = 40.0  # ... then sharp rows that agree with the draft's 6, 7
    logits[1, :, 2] = 5.0  # pad row: the target chooses 2 everywhere
    vb = VerifyBatch.build([([3, 6, 7], [-1, 0, 1]), ([1, 2], [-1, 0])], [5, 5],
                           [SamplingParams(), SamplingParams()], ["loose", "pad"])
    never = lambda lg, t, p: torch.zeros_like(t, dtype=torch.bool)  # noqa: E731
    out = verify_step(logits, vb, LooseParams(entropy=1.0, window=2), lenient=never)
    assert (out.paths, out.tokens) == ([(0, 1, 2), ()], [1, 2])
    assert out.lenient == [(1, 0, 0), ()]  # the loose row's mismatch counts as lenient too


def test_a_sampled_pad_row_keeps_no_token_its_filters_remove():
    logits = torch.zeros(1, 2, 6)
    logits[0, 0, 4], logits[0, 0, 3] = 9.0, 1.0  # top-k 1 leaves 4 alone
    vb = VerifyBatch.build([([3], [-1])], [7], [SamplingParams(temperature=1.0, top_k=1,
                                                              seed=3)], ["pad"])
    always = lambda lg, t, p: torch.ones_like(t, dtype=torch.bool)  # noqa: E731
    out = verify_step(logits, vb, lenient=always)
    assert (out.paths, out.tokens) == ([()], [4])


def test_the_classifier_rule_reads_the_parents_position(runner, tmp_path):
    pad = PadVerifier.load(PadParams(make_classifier(runner, tmp_path / "c", -50.0), 0.5, 0.2),
                           runner)
    V = runner.vocab_size
    logits = torch.full((1, 3, V), -30.0)
    logits[0, 0, 4], logits[0, 0, 5] = 0.0, -0.5  # after the root: 4 first, 5 close behind
    logits[0, 1, 6] = 0.0  # after node 0: 6 alone
    tapped = torch.zeros(1, 3, runner.embed.shape[1])
    keep = pad.keep(tapped, logits, torch.tensor([[5, 7]]), torch.tensor([[-1, 0]]))
    # node 0 (token 5) is scored at the root's row: probability ~0.38 >= 0.2; node 1 (token 7)
    # at node 0's row, where the target gives 7 almost nothing
    assert keep.tolist() == [[True, False]]
    zero = PadVerifier(pad.classifier, PadParams(pad.params.classifier, 0.0, 0.0))
    assert not zero.keep(tapped, logits, torch.tensor([[5, 7]]), torch.tensor([[-1, 0]])).any()


def test_the_rule_feeds_the_classifier_each_nodes_parents_row(runner, tmp_path):
    """A classifier with weights on every input, over a random tree: the rule's decision for
    node i is ``pad_keep`` on the tapped state, entropy and token probability of the row that
    scores it (its parent's), gathered here one node at a time; stop tokens are never kept."""
    from edgespec.pad.classifier import load_classifier, pad_keep, position_inputs

    torch.manual_seed(3)
    folder = make_classifier(runner, tmp_path / "c", 0.0)
    model = load_classifier(folder, runner)
    with torch.no_grad():
        for layer in (model.hidden_in, model.scalar_in, model.mix, model.out):
            layer.weight.normal_(0, 0.5)
    pad = PadVerifier(model, PadParams(folder, 0.5, 1e-3))
    H, V = runner.embed.shape[1], runner.vocab_size
    tree = _random_tree(random.Random(5), 12, V)
    tokens, parents = torch.tensor([tree.tokens]), torch.tensor([tree.parents])
    tapped, logits = torch.randn(1, 13, H), torch.randn(1, 13, V) * 3
    got = pad.keep(tapped, logits, tokens, parents)[0].tolist()
    want = []
    for i, (tok, par) in enumerate(zip(tree.tokens, tree.parents)):
        logp, ent = position_inputs(logits[0, par + 1])
        want.append(bool(pad_keep(model, tapped[0, par + 1], ent, logp[tok].exp(), 0.5, 1e-3)))
    assert got == want and 0 < sum(got) < len(got)  # the classifier decides both ways here
    kept = [t for t, k in zip(tree.tokens, got) if k]
    no_stops = pad.keep(tapped, logits, tokens, parents, stop_ids={kept[0]})[0].tolist()
    assert no_stops == [k and t != kept[0] for t, k in zip(tree.tokens, got)]


# -- the engine -------------------------------------------------------------------------------
def _mag():
    drafter = build_drafter("mag")
    drafter.min_confidence = 0.0  # draft every time: exercise rejections
    return drafter


def _run(runner, cfg: dict, params=SamplingParams(), **req):
    cfg = EngineConfig(max_draft=4, window=8, chunk=2, adaptive=False, draft_wait_ms=2000,
                       **cfg)
    with SpecEngine(runner, _mag(), cfg, stop_ids={2}) as engine:
        return [engine.generate(Request(p, 40, params, **req)) for p in PROMPTS]


@pytest.mark.parametrize("params", [SamplingParams(),
                                    SamplingParams(temperature=0.9, top_p=0.9, seed=11)])
def test_sigma_zero_gives_the_exact_paths_tokens(runner, tmp_path, params):
    keep_all = make_classifier(runner, tmp_path / "c", -50.0)
    exact = _run(runner, {}, params)
    pad = _run(runner, {"verify": "pad", "pad": PadParams(keep_all, 0.0, 0.0)}, params)
    for e, p in zip(exact, pad):
        assert p.token_ids == e.token_ids
        assert p.stats.lenient_tokens == 0 and p.stats.verify == "pad" and p.stats.lossy


def test_exact_is_still_target_only_beside_a_pad_engine(tiny, runner, tmp_path):
    keep_all = make_classifier(runner, tmp_path / "c", -50.0)
    results = _run(runner, {"verify": "pad", "pad": PadParams(keep_all, 0.5, 0.0)},
                   verify="exact")
    for res, prompt in zip(results, PROMPTS):
        assert res.token_ids == hf_greedy(tiny.model, prompt, 40)
        assert not res.stats.lossy and res.stats.verify == "exact"


@pytest.mark.parametrize("tree_width", [1, 3])
def test_a_classifier_that_keeps_everything_accepts_whole_drafts(runner, tmp_path, tree_width):
    keep_all = make_classifier(runner, tmp_path / "c", -50.0)
    keep_none = make_classifier(runner, tmp_path / "n", 50.0)
    base = {"verify": "pad", "tree_width": tree_width}
    exact = _run(runner, {**base, "pad": PadParams(keep_none, 0.5, 0.0)})
    loose = _run(runner, {**base, "pad": PadParams(keep_all, 0.5, 0.0)})
    for e, p in zip(exact, loose):
        assert e.stats.lenient_tokens == 0  # a classifier that calls everything a pivot
        assert p.stats.lenient_tokens > 0 and p.stats.to_dict()["lossless"] is False
        assert p.stats.to_dict()["verify"] == "pad"
    rate = lambda runs: (sum(r.stats.accepted_tokens for r in runs)  # noqa: E731
                         / sum(r.stats.draft_tokens for r in runs))
    assert rate(loose) > rate(exact)
    if tree_width == 1:  # chains: every draft token kept but where the length limit cuts
        for p in loose:
            assert p.stats.draft_tokens - p.stats.accepted_tokens <= 4


def test_a_classifier_made_for_another_target_is_refused(runner, tmp_path):
    other = load_model(str(make_tiny_model(tmp_path / "other", seed=3)), dtype="float32")
    folder = make_classifier(TargetRunner(other.model, n_slots=1, max_len=16), tmp_path / "c",
                             0.0)
    with pytest.raises(ConfigError, match="made for another target"):
        SpecEngine(runner, None, EngineConfig(verify="pad", pad=PadParams(folder)))
    with pytest.raises(ConfigError, match="not a PAD classifier folder"):
        SpecEngine(runner, None, EngineConfig(verify="pad", pad=PadParams(str(tmp_path))))


def test_the_modes_a_request_may_ask_for():
    assert session_verify_mode("", "pad") == "pad"
    assert session_verify_mode("exact", "pad") == "exact"
    with pytest.raises(ConfigError, match="--verify pad:DIR"):
        session_verify_mode("pad", "exact")
    with pytest.raises(ConfigError, match="--verify loose"):
        session_verify_mode("loose", "pad")
    with pytest.raises(ConfigError, match="--verify pad:DIR"):
        session_verify_mode("pad", "loose")
    assert parse_verify("pad:/x/y") == ("pad", "/x/y")
    assert parse_verify("loose") == ("loose", "")
    for bad in ("pad:", "pad", "strict"):
        with pytest.raises(ConfigError, match="exact, loose or pad:DIR"):
            parse_verify(bad)
    with pytest.raises(ConfigError, match="needs a classifier"):
        EngineConfig(verify="pad")
    with pytest.raises(ConfigError, match="pad-sigma"):
        PadParams("x", sigma=1.5)
    with pytest.raises(ConfigError, match="--learn"):
        EngineConfig(verify="pad", pad=PadParams("x"), head="h", learn=True)


def test_a_run_folder_resolves_to_its_classifier(tmp_path):
    (tmp_path / "classifier").mkdir()
    (tmp_path / "classifier" / "pad.json").write_text("{}")
    assert resolve_classifier_dir(str(tmp_path)) == tmp_path / "classifier"
    with pytest.raises(ConfigError, match="no PAD classifier is shipped"):
        resolve_classifier_dir("default", "some-other-model")


# -- the verifier and the command line ----------------------------------------------------------
def test_a_pad_verifier_says_lossy_and_counts_kept_tokens_over_grpc_http_and_metrics(
        looping_dir, looping, tmp_path):
    import urllib.request

    import edgespec
    from edgespec_cli.server import EdgespecServer, ServerOptions
    from test_loose_verify import post

    folder = make_classifier(TargetRunner(looping.model, n_slots=1, max_len=16), tmp_path / "c",
                             -50.0)
    srv = EdgespecServer(ServerOptions(
        listen="127.0.0.1:0", model=str(looping_dir), drain_timeout_s=5, http_port=0,
        engine=EngineConfig(max_sessions=2, max_context=256, verify="pad",
                            pad=PadParams(folder, 0.5, 0.0)))).start()
    try:
        with edgespec.Client(f"127.0.0.1:{srv.port}", timeout=120) as c:
            pad = c.generate(prompt_ids=PROMPTS[1], max_new_tokens=12)
            exact = c.generate(prompt_ids=PROMPTS[1], max_new_tokens=12, verify="exact")
            with pytest.raises(edgespec.client.InvalidRequest, match="--verify loose"):
                c.generate(prompt_ids=PROMPTS[1], max_new_tokens=4, verify="loose")
        assert not pad.lossless and pad.stats["verify"] == "pad"
        assert exact.lossless and exact.stats["verify"] == "exact"
        assert exact.token_ids == hf_greedy(looping.model, PROMPTS[1], 12)
        url = f"http://127.0.0.1:{srv.http_port}"
        body = {"model": srv.model_name, "prompt": PROMPTS[1], "max_tokens": 6,
                "temperature": 0}
        status, r = post(url + "/v1/completions", body)
        assert status == 200 and r["edgespec"]["lossless"] is False
        assert r["edgespec"]["verify"] == "pad"
        status, r = post(url + "/v1/completions", {**body, "verify": "pad"})
        assert status == 200 and r["edgespec"]["verify"] == "pad"
        status, r = post(url + "/v1/completions", {**body, "verify": "exact"})
        assert status == 200 and r["edgespec"]["lossless"] is True
        with urllib.request.urlopen(url + "/metrics", timeout=60) as m:
            text = m.read().decode()
        lossy = [ln for ln in text.splitlines()
                 if ln.startswith('edgespec:lossy_requests_total{mode="pad"}')]
        assert lossy and float(lossy[0].split()[-1]) == 3  # the gRPC one and two over HTTP
        kept = [ln for ln in text.splitlines()
                if ln.startswith('edgespec:lenient_accepted_tokens_total{mode="pad"}')]
        # no drafter is attached here, so nothing was drafted: the series exists, at 0
        assert kept and float(kept[0].split()[-1]) == pad.stats["lenient_tokens"] == 0
    finally:
        srv.stop(drain_timeout_s=0)


@pytest.mark.slow  # generate runs
def test_generate_with_pad_warns_and_refuses_a_missing_classifier(tiny, tiny_dir, tmp_path):
    import json

    from cli_inprocess import run_cli  # in this process: main(argv) and its status

    folder = make_classifier(TargetRunner(tiny.model, n_slots=1, max_len=16), tmp_path / "c",
                             -50.0)
    r = run_cli("generate", "abcabcabc", "--model", tiny_dir, "--max-new-tokens", 12,
                "--verify", f"pad:{folder}", "--pad-min-prob", 0, "--json")
    assert r.returncode == 0, r.stderr
    assert f"--verify pad:{folder} is lossy" in r.stderr
    stats = json.loads(r.stdout)["stats"]
    assert stats["lossless"] is False and stats["verify"] == "pad"
    r = run_cli("generate", "abc", "--model", tiny_dir, "--verify", f"pad:{tmp_path}/none")
    assert r.returncode == 2 and "not a PAD classifier folder" in r.stderr
    r = run_cli("generate", "abc", "--model", tiny_dir, "--verify", "pad")
    assert r.returncode == 2 and "exact, loose or pad:DIR" in r.stderr


def test_the_metrics_count_kept_tokens_by_lossy_mode():
    from prometheus_client import CollectorRegistry, generate_latest

    from edgespec.protocol.request_stats import Stats
    from verifier_node.metrics import VerifierMetrics

    registry = CollectorRegistry()
    m = VerifierMetrics(registry)
    m.finished(None, Stats(lossy=True, verify="pad", lenient_tokens=5), "stop", 0.1)
    m.finished(None, Stats(lossy=True, verify="pad", lenient_tokens=2), "length", 0.1)
    m.finished(None, Stats(lossy=True, verify="loose", lenient_tokens=1), "stop", 0.1)
    m.finished(None, Stats(lenient_tokens=0), "stop", 0.1)
    text = generate_latest(registry).decode()
    assert 'edgespec:lenient_accepted_tokens_total{mode="pad"} 7.0' in text
    assert 'edgespec:lenient_accepted_tokens_total{mode="loose"} 1.0' in text
    assert 'edgespec:lossy_requests_total{mode="pad"} 2.0' in text
    assert 'mode="exact"' not in text


@pytest.mark.slow  # a bench-pad run
def test_bench_pad_writes_rows_for_each_method_from_one_run(tiny, tiny_dir, tmp_path):
    import json

    from cli_inprocess import run_cli as edgespec
    from test_pad_train import SCORER, _tasks_file

    from edgespec_cli.bench.pad_utility import wilson

    folder = make_classifier(TargetRunner(tiny.model, n_slots=1, max_len=16), tmp_path / "c",
                             -50.0)
    tasks = _tasks_file(tiny, tmp_path / "tasks.jsonl")
    out, png = tmp_path / "pad.json", tmp_path / "pad.png"
    r = edgespec("bench-pad", "--model", tiny_dir, "--dtype", "float32", "--classifier", folder,
                 "--tasks-file", tasks, "--scorer", SCORER, "--problems", 4, "--sigmas", "0,0.5",
                 "--pad-min-prob", 0, "--drafter", "mag", "--max-new-tokens", 10,
                 "--threads", 1, "--json", out, "--plot", png)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    rows = {row["method"]: row for row in report["rows"]}
    assert list(rows) == ["target_only", "exact", "pad@0", "pad@0.5"]
    assert report["recommended_sigma"] == PadParams().sigma and report["config"]["transfer"]
    for row in rows.values():
        assert 0 <= row["ci95"][0] <= row["accuracy"] <= row["ci95"][1] <= 1
        assert row["tokens_per_s"] > 0 and row["speedup_vs_target_only"] > 0
    # the exact methods, and PAD at sigma 0, give target-only's answers
    for m in ("target_only", "exact", "pad@0"):
        assert rows[m]["identical_share"] == 1.0 and rows[m]["lenient_tokens"] == 0
    assert rows["target_only"]["speedup_vs_target_only"] == 1.0
    assert rows["pad@0.5"]["lenient_tokens"] > 0  # a classifier that keeps every token
    assert rows["pad@0.5"]["mean_acceptance_length"] > rows["exact"]["mean_acceptance_length"]
    assert "pad@0.5" in r.stdout and "identical" in r.stdout and png.stat().st_size > 0
    assert wilson(0, 10)[0] == 0 and wilson(10, 10)[1] == 1 and wilson(5, 10) == [0.2366, 0.7634]


@pytest.mark.slow  # trains a tiny head
def test_pad_composes_with_a_draft_head(looping, head_dir):
    from edgespec.heads.manifest import load_head
    from edgespec.heads.proposer import HeadProposer

    runner = TargetRunner(looping.model, n_slots=2, max_len=256)
    prompts = [[1, 10, 11, 12, 13, 10, 11], [1, 50, 51, 52, 53, 54]]
    for sigma in (0.0, 0.5):
        folder = make_classifier(runner, Path(str(head_dir)) / f"../pad{sigma}", -50.0)
        cfg = EngineConfig(max_sessions=2, verify="pad", pad=PadParams(folder, sigma, 0.0))
        head = HeadProposer(load_head(str(head_dir), runner), source=str(head_dir))
        with SpecEngine(runner, None, cfg, stop_ids={2}, head=head) as engine:
            results = [engine.generate(Request(p, 40)) for p in prompts]
        assert all(r.stats.head_tokens > 0 for r in results)
        if sigma == 0.0:  # exact verification with the head's drafts: target-only's tokens
            assert [r.token_ids for r in results] == [hf_greedy(looping.model, p, 40)
                                                       for p in prompts]
        else:
            assert sum(r.stats.lenient_tokens for r in results) > 0
