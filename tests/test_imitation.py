"""Imitation drafting (FastVLM-style self-speculation) on tiny random-weight models: the
early-exit forward is the full forward's state after L layers, the layer-L states beside a
dataset, training (the loss falls, a stopped run resumes to the same network, the first draft
beats the plain early exit), refusals, and outputs identical to target-only with the target
drafting for itself through the network in the verifier (greedy and keyed sampling, alone and
beside a drafter)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf_greedy, hf_keyed_sampled

from edgespec.config import ConfigError, EngineConfig, SamplingParams
from edgespec.drafters import build_drafter, parse_drafter_spec
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.protocol.contract import Branch
from edgespec.heads.exit_states import load_exit_states, make_exit_states, sequence_states
from edgespec.heads.harvest import work_list
from edgespec.heads.imitation import ImitationManifest, load_imitation
from edgespec.heads.imitation_proposer import ImitationProposer, imitation_draft
from edgespec.heads.imitation_training import ImitationSettings, train_imitation
from edgespec.heads.training import TargetTensors
from edgespec.runner.target_runner import TargetRunner
from test_heads import _harvest, _prompts

pytestmark = pytest.mark.slow  # a harvest and a training: not the fast tier

SETTINGS = dict(exit_layer=2, ffn=128, vocab=64, steps=100, batch=64, lr=1e-2, depth=4)


@pytest.fixture(scope="module")
def imitated(tiny, tmp_path_factory):
    """A dataset of the tiny target's responses, its layer-2 states, a network trained on
    them."""
    root = tmp_path_factory.mktemp("imitation")
    items = work_list(_prompts(16), 1, 0.8, seed=0)
    assert _harvest(tiny.model, root / "data", items)
    runner = TargetRunner(tiny.model, n_slots=1, max_len=128, n_layers=2, exact=False)
    assert make_exit_states(runner, root / "data", [w.prompt_ids for w in items], [1, 2],
                            say=lambda m: None)
    target = TargetTensors.of_model(tiny.model, "tiny")
    report = train_imitation(target, 4, root / "data", root / "net",
                             ImitationSettings(**SETTINGS), "test", say=lambda m: None)
    return root, items, report


def test_the_early_exit_is_the_full_forward_after_l_layers(tiny):
    runner = TargetRunner(tiny.model, n_slots=2, max_len=64)
    ids = [1, 20, 21, 22, 23, 24]
    slot = runner.new_slot()
    full = runner.score([slot], [ids], tap=2).tapped  # [1, T, H]
    other = runner.new_slot()
    early = runner.early_hidden([other], torch.tensor([ids[:4]]), [0], 2)
    rest = runner.early_hidden([other], torch.tensor([ids[4:]]), [4], 2)
    assert torch.equal(torch.cat([early, rest], 1), full)
    assert runner.cache.lengths[other] == 0  # no length pointer moves
    one, two = sequence_states(runner, other, ids[:3], ids[3:], [1, 2])
    assert torch.equal(two, full[0, 2:5])
    assert torch.equal(one, runner.score([slot], [ids], tap=1).tapped[0, 2:5])


def test_the_states_line_up_with_the_dataset_and_a_resumed_pass_matches(tiny, imitated,
                                                                        tmp_path):
    root, items, _ = imitated
    states = load_exit_states(root / "data", 2)
    from edgespec.heads.dataset import load_sequences

    _, seqs = load_sequences(root / "data")
    assert states.shape == (seqs.n_tokens, 64) and states.dtype == torch.bfloat16
    (tmp_path / "data").mkdir()
    for f in (root / "data").glob("*.*"):
        (tmp_path / "data" / f.name).write_bytes(f.read_bytes())
    runner = TargetRunner(tiny.model, n_slots=1, max_len=128, n_layers=2, exact=False)
    prompts = [w.prompt_ids for w in items]
    assert not make_exit_states(runner, tmp_path / "data", prompts, [2], deadline=0.0,
                                say=lambda m: None)
    assert make_exit_states(runner, tmp_path / "data", prompts, [2], say=lambda m: None)
    assert torch.equal(load_exit_states(tmp_path / "data", 2), states)
    assert not torch.equal(load_exit_states(root / "data", 1), states)
    with pytest.raises(ConfigError, match="responses, the work list"):
        make_exit_states(runner, tmp_path / "data", prompts[:-1], [2], say=lambda m: None)


def test_training_lowers_the_loss_and_beats_the_plain_exit(imitated):
    root, _, r = imitated
    assert r["loss_last"] < 0.9 * r["loss_first"]
    assert r["first_draft_accuracy"] > r["plain_exit_accuracy"]
    m = ImitationManifest.read(root / "net")
    assert m.config.exit_layer == 2 and m.command == "test" and m.config.kind == "imitation"
    raw = json.loads((root / "net" / "imitation.json").read_text())
    assert raw["exit_layer"] == 2 and raw["kind"] == "imitation"
    assert r["parameters"] == m.training["parameters"] > 0


def test_a_stopped_training_resumes_to_the_same_network(tiny, imitated, tmp_path):
    root, _, _ = imitated
    target = TargetTensors.of_model(tiny.model, "tiny")
    s = ImitationSettings(**{**SETTINGS, "steps": 30})
    whole = train_imitation(target, 4, root / "data", tmp_path / "whole", s, say=lambda m: None)
    assert train_imitation(target, 4, root / "data", tmp_path / "parts", s, say=lambda m: None,
                           until_step=12) is None
    parts = train_imitation(target, 4, root / "data", tmp_path / "parts", s, say=lambda m: None)
    assert whole is not None and parts is not None and parts["loss_last"] == whole["loss_last"]
    assert (tmp_path / "whole" / "imitation.safetensors").read_bytes() == \
        (tmp_path / "parts" / "imitation.safetensors").read_bytes()


def test_a_network_for_another_target_or_a_missing_folder_is_refused(imitated, looping,
                                                                     tmp_path):
    root, _, _ = imitated
    with pytest.raises(ConfigError, match="made for another target"):
        load_imitation(str(root / "net"), TargetRunner(looping.model, n_slots=1, max_len=64))
    with pytest.raises(ConfigError, match="not an imitation folder"):
        load_imitation(str(tmp_path), TargetRunner(looping.model, n_slots=1, max_len=64))
    with pytest.raises(ConfigError, match="needs a path"):
        parse_drafter_spec("imitation:")
    with pytest.raises(ConfigError, match="one head at a time"):
        parse_drafter_spec("head:x+imitation:y")
    assert parse_drafter_spec("mag+imitation:default").head == "imitation:default"
    with pytest.raises(ConfigError, match="not an imitation network"):
        EngineConfig(head="imitation:x", learn=True)


def test_the_draft_is_the_networks_greedy_chain_with_its_next_likeliest_beside_it(tiny,
                                                                                imitated):
    root, _, _ = imitated
    runner = TargetRunner(tiny.model, n_slots=2, max_len=64)
    net = load_imitation(str(root / "net"), runner)
    prompt = [1, 10, 11, 12, 13]
    slot, other = runner.new_slot(), runner.new_slot()
    for s in (slot, other):
        runner.prefill(s, prompt[:-1])
        runner.commit(s, len(prompt) - 1)
    [draft] = imitation_draft(net, runner, [slot], [prompt[-1]], [4], depth=3, min_prob=0.0,
                              widths=(3, 1))
    assert len(draft.tokens) == 3
    # the same states in one teacher-forced pass: each row's four likeliest tokens
    h = runner.early_hidden([other], torch.tensor([prompt[-1:] + list(draft.tokens[:2])]), [4],
                            net.cfg.exit_layer)  # [1, 3, H]
    with torch.no_grad():
        probs = net.logits(net.features(h[0].float())).softmax(-1)  # [3, Vd]
    top = net.target.vocab_ids[probs.topk(4, dim=-1).indices].tolist()
    assert draft.tokens == tuple(row[0] for row in top)
    assert draft.branches == (*(Branch(0, (t,)) for t in top[0][1:4]), Branch(1, (top[1][1],)),
                              Branch(2, (top[2][1],)))
    [sure] = imitation_draft(net, runner, [slot], [prompt[-1]], [4], depth=3, min_prob=1.01,
                             widths=(2,))  # never confident: one forward, its chain token
    assert sure.tokens == draft.tokens[:1] and sure.branches == draft.branches[:2]


@pytest.mark.parametrize("drafter", ["none", "mag"])
def test_imitation_drafting_is_lossless_greedy_and_keyed_sampling(tiny, imitated, drafter):
    root, _, _ = imitated
    runner = TargetRunner(tiny.model, n_slots=4, max_len=256)
    cfg = EngineConfig(max_draft=6, head=f"imitation:{root / 'net'}")
    prompts = [[1, 10, 11, 12, 13, 10, 11], [1, 50, 51, 52, 53, 54], [1, 30, 31, 30, 31, 30]]
    with SpecEngine(runner, build_drafter(drafter), cfg, {2}) as engine:
        assert isinstance(engine.head, ImitationProposer)
        greedy = engine.generate_many([Request(p, 30) for p in prompts])
        for p, res in zip(prompts, greedy):
            assert res.token_ids == hf_greedy(tiny.model, p, 30)
        assert sum(r.stats.head_tokens for r in greedy) > 0
        assert sum(r.stats.head_accepted for r in greedy) > 0
    runner = TargetRunner(tiny.model, n_slots=4, max_len=256)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in (7, 8, 9)]
    with SpecEngine(runner, build_drafter(drafter), cfg) as engine:  # no stop token: as HF's
        sampled = engine.generate_many([Request(p, 30, sp) for p, sp in zip(prompts, params)])
    assert [r.token_ids for r in sampled] == \
        [hf_keyed_sampled(tiny.model, p, 30, sp) for p, sp in zip(prompts, params)]
    assert sum(r.stats.head_accepted for r in sampled) > 0


def test_alternatives_beside_the_chain_are_accepted_and_stay_lossless(tiny, imitated):
    """Every draft-vocabulary token beside the first chain token: the target's next token is
    among them wherever the vocabulary holds it, so steps accept more than the chain. The tree
    is cut to what the step may hold (64 nodes, the room left in the KV slot: the context
    ends 7 positions short of it)."""
    root, _, _ = imitated
    runner = TargetRunner(tiny.model, n_slots=4, max_len=64)
    net = load_imitation(str(root / "net"), runner)
    wide = ImitationProposer(net, runner, widths=(len(net.target.vocab_ids) - 1, 0))
    prompts = [[1, 10, 11, 12, 13, 10, 11], [1, 50, 51, 52, 53, 54, 55]]
    with SpecEngine(runner, build_drafter("none"), EngineConfig(max_draft=6), {2},
                    head=wide) as engine:
        results = engine.generate_many([Request(p, 50) for p in prompts])
    for p, res in zip(prompts, results):
        assert res.token_ids == hf_greedy(tiny.model, p, 50)
    assert sum(r.stats.accepted_tokens for r in results) > \
        sum(r.stats.head_accepted for r in results)  # all the head's: some beside its chain
    with pytest.raises(ValueError, match="widths"):
        ImitationProposer(net, runner, widths=(2, -1))
