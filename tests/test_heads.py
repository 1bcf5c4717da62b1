"""Draft heads on tiny models: the harvest and its resume, training (the loss falls, drafts land
above chance, a stopped run resumes to the same weights), a head refused by another target, and
outputs identical to target-only with a head drafting in the verifier (greedy and keyed
sampling, alone and beside a drafter, chains and trees)."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import hf_greedy, hf_keyed_sampled, make_tiny_model

from edgespec.config import ConfigError, EngineConfig, SamplingParams
from edgespec.drafters import build_drafter
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.heads.dataset import DatasetInfo, load_sequences
from edgespec.heads.harvest import Harvester, work_list
from edgespec.heads.fingerprint import runner_fingerprint
from edgespec.heads.manifest import HeadManifest, load_head
from edgespec.heads.modules import KINDS
from edgespec.heads.proposer import HeadProposer
from edgespec.heads.training import TargetTensors, TrainSettings, train_head
from edgespec.models.loading import load_model
from edgespec.runner.target_runner import TargetRunner

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier

SETTINGS = dict(vocab=64, steps=120, batch=8, span=16, context=8, depth=4, lr=3e-3)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(10, 90, (int(torch.randint(4, 12, (1,), generator=g)),),
                                generator=g).tolist() for _ in range(n)]


def _harvest(model, folder, items, per_shard=4, deadline=None) -> bool:
    runner = TargetRunner(model, n_slots=4, max_len=128)
    info = DatasetInfo(target=runner_fingerprint(runner), hidden=runner.embed.shape[1],
                       vocab=runner.vocab_size, feature_dtype="float32", top_k=8,
                       per_shard=per_shard, items=len(items), seed=0, max_new_tokens=24,
                       sources=["test"], command="test")
    if not (folder / "dataset.json").exists():
        info.save(folder)
    return Harvester(runner, {2}, 24, top_k=8).run(folder, info, items, deadline,
                                                   say=lambda m: None)


@pytest.fixture(scope="module")
def trained(looping, tmp_path_factory):
    """A dataset harvested from the looping tiny model and a head of every kind trained on it."""
    root = tmp_path_factory.mktemp("heads")
    items = work_list(_prompts(16), 1, 0.8, seed=0)
    assert _harvest(looping.model, root / "data", items)
    target = TargetTensors.of_model(looping.model, "looping")
    reports = {}
    for kind in KINDS:
        reports[kind] = train_head(target, root / "data", root / kind,
                                   TrainSettings(kind=kind, **SETTINGS), "test",
                                   say=lambda m: None)
    return root, items, reports


def test_the_harvest_records_every_response_position(trained):
    root, items, _ = trained
    info, seqs = load_sequences(root / "data")
    assert info.shards == 8 and seqs.n_sequences == len(items) == 32
    n = seqs.n_tokens
    assert seqs.features.shape == (n, 64) and seqs.top_ids.shape == (n, 8)
    # a greedy response's tokens are the target's favourites
    favourite = (seqs.next_tokens.long() == seqs.top_ids[:, 0].long()).float().mean()
    assert favourite > 0.5
    probs = seqs.top_probs.float().sum(-1)
    assert bool((probs <= 1.001).all()) and bool((probs > 0).all())


def test_a_stopped_harvest_resumes_to_the_same_data(looping, tmp_path, trained):
    root, items, _ = trained
    assert not _harvest(looping.model, tmp_path, items, deadline=time.monotonic())  # stops at 0
    assert _harvest(looping.model, tmp_path, items[:12] + items[12:])
    _, a = load_sequences(root / "data")
    _, b = load_sequences(tmp_path)
    assert torch.equal(a.next_tokens, b.next_tokens) and torch.equal(a.starts, b.starts)
    assert torch.equal(a.features, b.features)


@pytest.mark.parametrize("kind", KINDS)
def test_training_lowers_the_loss_and_drafts_land_above_chance(trained, kind):
    root, _, reports = trained
    r = reports[kind]
    assert r["loss_last"] < 0.7 * r["loss_first"]
    # chance: one token in the 64 of the draft vocabulary
    assert r["first_draft_accuracy"] > 0.3 and r["tokens_per_step"] > 1.3
    m = HeadManifest.read(root / kind)
    assert m.config.kind == kind and m.feature_dtype == "float32" and m.command == "test"
    assert m.validation["tokens_per_step"] == r["tokens_per_step"]


def test_a_stopped_training_resumes_to_the_same_head(looping, trained, tmp_path):
    root, _, _ = trained
    target = TargetTensors.of_model(looping.model, "looping")
    s = TrainSettings(kind="eagle", **{**SETTINGS, "steps": 30})
    whole = train_head(target, root / "data", tmp_path / "whole", s, say=lambda m: None)
    assert train_head(target, root / "data", tmp_path / "parts", s, say=lambda m: None,
                      until_step=12) is None
    assert (tmp_path / "parts" / "checkpoint.pt").exists()
    parts = train_head(target, root / "data", tmp_path / "parts", s, say=lambda m: None)
    assert whole is not None and parts is not None
    assert parts["loss_last"] == whole["loss_last"]
    a = (tmp_path / "whole" / "head.safetensors").read_bytes()
    assert a == (tmp_path / "parts" / "head.safetensors").read_bytes()


def test_a_head_made_for_another_target_is_refused(trained, tiny):
    root, _, _ = trained
    with pytest.raises(ConfigError, match="made for another target"):
        load_head(str(root / "eagle"), TargetRunner(tiny.model, n_slots=1, max_len=64))
    with pytest.raises(ConfigError, match="not a head folder"):
        load_head(str(root / "data"), TargetRunner(tiny.model, n_slots=1, max_len=64))


PROMPTS = [[1, 10, 11, 12, 13, 10], [1, 50, 51, 52, 53, 54, 55], [1, 30, 31, 30, 31, 30]]


@pytest.mark.parametrize("kind, drafter", [("eagle", "none"), ("eagle", "mag"),
                                           ("specformer", "mag"), ("ctc", "none")])
def test_a_head_in_the_verifier_keeps_greedy_output_identical(looping, trained, kind,
                                                             drafter):
    root, _, _ = trained
    runner = TargetRunner(looping.model, n_slots=4, max_len=256)
    head = HeadProposer(load_head(str(root / kind), runner))
    refs = [hf_greedy(looping.model, p, 40) for p in PROMPTS]
    with SpecEngine(runner, build_drafter(drafter), EngineConfig(), {2}, head=head) as engine:
        results = engine.generate_many([Request(p, 40) for p in PROMPTS])
    assert [r.token_ids for r in results] == refs
    stats = [r.stats for r in results]
    assert sum(s.head_accepted for s in stats) > 0
    assert all(s.head_accepted <= s.head_tokens for s in stats)
    if drafter == "none":  # every accepted token came from the head
        assert sum(s.accepted_tokens for s in stats) == sum(s.head_accepted for s in stats)


@pytest.mark.parametrize("kind", ["eagle", "ctc"])
def test_a_head_keeps_seeded_sampling_identical(looping, trained, kind):
    root, _, _ = trained
    runner = TargetRunner(looping.model, n_slots=4, max_len=256)
    head = HeadProposer(load_head(str(root / kind), runner))
    params = [SamplingParams(temperature=0.8, seed=s) for s in (3, 4, 5)]
    refs = [hf_keyed_sampled(looping.model, p, 30, sp) for p, sp in zip(PROMPTS, params)]
    with SpecEngine(runner, build_drafter("mag"), EngineConfig(tree_width=2), set(),
                    head=head) as engine:
        results = engine.generate_many([Request(p, 30, sp) for p, sp in zip(PROMPTS, params)])
    assert [r.token_ids for r in results] == refs


def test_a_head_trained_on_float32_features_serves_a_bfloat16_target(looping_dir, trained):
    from edgespec.runner.dtype_probe import exact_here

    if not exact_here("bfloat16"):
        pytest.skip("bfloat16 is not exact on this machine, so it is not served here")
    root, _, _ = trained
    model = load_model(str(looping_dir), dtype="bfloat16").model
    outs = {}
    for name in ("none", "head"):
        runner = TargetRunner(model, n_slots=2, max_len=128)
        head = HeadProposer(load_head(str(root / "eagle"), runner)) if name == "head" else None
        with SpecEngine(runner, None, EngineConfig(), {2}, head=head) as engine:
            outs[name] = engine.generate(Request(PROMPTS[0], 30))
    assert outs["head"].token_ids == outs["none"].token_ids
    assert outs["head"].stats.head_accepted > 0


def test_another_model_gives_another_fingerprint(tmp_path, looping):
    other = load_model(str(make_tiny_model(tmp_path / "other", seed=9)), dtype="float32")
    a = runner_fingerprint(TargetRunner(looping.model, n_slots=1, max_len=32))
    b = runner_fingerprint(TargetRunner(other.model, n_slots=1, max_len=32))
    assert a != b


def test_learning_from_live_traffic_swaps_in_a_better_head_and_keeps_outputs(looping,
                                                                            tmp_path):
    """An untrained head learns from the sessions it serves: the learner's round swaps in a
    version that drafts better on the held-out newest sessions; outputs stay the target's."""
    from edgespec.heads.manifest import HeadManifest as Manifest, save_head
    from edgespec.heads.online import LearnSettings
    from edgespec.heads.training import make_head

    runner = TargetRunner(looping.model, n_slots=12, max_len=256)
    target = TargetTensors.of_model(looping.model, "looping")
    untrained = make_head("eagle", target, torch.arange(10, 90), TrainSettings(
        kind="eagle", **SETTINGS))
    save_head(tmp_path / "h", untrained, Manifest(untrained.cfg, target.fingerprint, "looping",
                                                  "float32"))
    settings = LearnSettings(min_new_tokens=200, steps=80, lr=3e-3, share=1.0)
    head = HeadProposer(load_head(str(tmp_path / "h"), runner), learn=settings)
    prompts = _prompts(24, seed=7)
    with SpecEngine(runner, None, EngineConfig(), {2}, head=head) as engine:
        first = engine.generate_many([Request(p, 30) for p in prompts[:12]])
        deadline = time.monotonic() + 300
        while head.learner.rounds == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert head.learner.rounds >= 1 and head.version >= 1
        later = engine.generate_many([Request(p, 30) for p in prompts[12:]])
    refs = [hf_greedy(looping.model, p, 30) for p in prompts]
    assert [r.token_ids for r in first + later] == refs
    assert sum(r.stats.head_accepted for r in later) > sum(r.stats.head_accepted for r in first)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=11)],
                         ids=["greedy", "sampled"])
def test_auto_chooses_stacks_per_session_and_stays_lossless(looping, trained, params):
    root, _, _ = trained
    runner = TargetRunner(looping.model, n_slots=4, max_len=256)
    head = HeadProposer(load_head(str(root / "eagle"), runner))
    sample = params.temperature > 0
    refs = [hf_keyed_sampled(looping.model, p, 40, params) if sample else
            hf_greedy(looping.model, p, 40) for p in PROMPTS]
    with SpecEngine(runner, build_drafter("mag"), EngineConfig(auto=True),
                    set() if sample else {2}, head=head) as engine:
        results = engine.generate_many([Request(p, 40, params) for p in PROMPTS])
    assert [r.token_ids for r in results] == refs
    for r in results:
        assert sum(r.stats.stacks.values()) == r.stats.steps
        assert set(r.stats.stacks) <= {"none", "drafter", "head", "drafter+head"}
    assert any(n for r in results for s, n in r.stats.stacks.items() if "head" in s)
