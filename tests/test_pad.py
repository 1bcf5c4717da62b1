"""PAD's parts on their own (issue 27): task families deterministic by seed with disjoint splits,
a user's file and the scorers, the runner's tap (same output bits, the right layer), the pivot
classifier (learns separable labels, its loss falls, ``pad_keep``'s rule, refused by another
target), the label rule and the AUC."""

import json

import pytest
import torch

from conftest import make_tiny_model

from edgespec.config import ConfigError
from edgespec.pad.classifier import (PadConfig, PadManifest, PivotClassifier, load_classifier,
                                     pad_keep, save_classifier)
from edgespec.pad.labels import AMBIGUOUS, NOT_PIVOT, PIVOT, Candidates, label_of
from edgespec.pad.scoring import Scorer
from edgespec.pad.tasks import FAMILIES, family_problems, file_problems, split_of
from edgespec.pad.training import TooFewLabels, TrainSettings, auc, train_classifier


@pytest.fixture(autouse=True)
def _one_thread():
    """These products are tiny: more threads gain nothing, and on a busy machine their spinning
    made the training test 15x slower (2.6 s against 38 s on 2 shared cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_families_are_deterministic_by_seed_and_their_splits_disjoint(family):
    a = family_problems(family, "train", 60, seed=3)
    assert a == family_problems(family, "train", 60, seed=3)
    assert a.problems != family_problems(family, "train", 60, seed=4).problems
    test = family_problems(family, "test", 30, seed=3)
    other_seed_test = family_problems(family, "test", 30, seed=9)
    train_prompts = {p.prompt for p in a.problems}
    assert not train_prompts & {p.prompt for p in test.problems + other_seed_test.problems}
    assert all(split_of(p.prompt) == "test" for p in test.problems)
    assert len(train_prompts) == 60  # distinct
    for p in a.problems[:10]:  # every reference answer is right by its own scorer
        assert a.scorer.correct(f"The answer is {p.answer}.", p.answer)


def test_unknown_family_and_split_are_refused():
    with pytest.raises(ConfigError, match="unknown task"):
        family_problems("poetry", "train", 3)
    with pytest.raises(ConfigError, match="split"):
        family_problems("arith", "dev", 3)


def test_a_users_file_is_split_by_the_same_rule(tmp_path):
    rows = [{"prompt": f"question {i}?", "answer": str(i)} for i in range(40)]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    train = file_problems(str(path), "number", "train")
    test = file_problems(str(path), "number", "test")
    assert len(train.problems) + len(test.problems) == 40 and test.problems
    assert not {p.prompt for p in train.problems} & {p.prompt for p in test.problems}
    assert train.scorer == Scorer("number")
    path.write_text('{"prompt": "no answer"}\n')
    with pytest.raises(ConfigError, match='needs "prompt"'):
        file_problems(str(path), "exact", "train")
    # the reader the tasks and prompt files share: a line's number in its errors, the file named
    from edgespec.jsonl_file import jsonl_rows
    from edgespec_cli.distill_data import read_prompt_file

    path.write_text('{"prompt": "a", "answer": 1}\n\n{"prompt": "b"\n')
    for read in (lambda: file_problems(str(path), "exact", "train"),
                 lambda: read_prompt_file(str(path))):
        with pytest.raises(ConfigError, match=r"tasks.jsonl:3: not a JSON object"):
            read()
    path.write_text('{"prompt": "a"}\n\n  \n["b"]\n')
    assert list(jsonl_rows(str(path), "x")) == [(1, {"prompt": "a"}), (4, ["b"])]
    with pytest.raises(ConfigError, match="cannot read the tasks file .*missing"):
        file_problems(str(tmp_path / "missing"), "exact", "train")
    with pytest.raises(ConfigError, match="cannot read the prompt file .*missing"):
        read_prompt_file(str(tmp_path / "missing"))
    path.write_bytes(b'{"prompt": "caf\xe9"}\n')  # Latin-1, not UTF-8
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        list(jsonl_rows(str(path), "the tasks file"))


def test_scorers():
    assert Scorer.parse("exact").correct("  Paris. ", "paris")
    assert not Scorer.parse("exact").correct("It is Paris", "Paris")
    number = Scorer.parse("number")
    assert number.correct("3 + 4 = 7", "7") and number.correct("It costs 1,200.", "1200")
    assert number.correct("7.0", "7") and not number.correct("no digits", "7")
    assert not number.correct("7 or 8", "7")  # the last number counts
    letter = Scorer.parse(r"regex:\b([ABC])\)")
    assert letter.correct("I pick B) because", "b") and not letter.correct("none", "B")
    assert Scorer.parse("regex:[0-9]+").correct("room 42 then 7", "42")  # no group: the match
    for bad in ("fuzzy", "regex:", "regex:(["):
        with pytest.raises(ConfigError):
            Scorer.parse(bad)


def test_the_tap_is_the_layer_transformers_names_and_changes_no_output_bit(tiny):
    from edgespec.runner.target_runner import TargetRunner

    runner = TargetRunner(tiny.model, n_slots=2, max_len=64)
    rows = [[5, 9, 13, 7, 22], [8, 4]]
    plain = runner.score([0, 1], rows)
    tapped = runner.score([0, 1], rows, tap=-2)
    assert torch.equal(plain.logits, tapped.logits) and torch.equal(plain.features,
                                                                    tapped.features)
    assert plain.tapped is None and tapped.tapped is not None
    assert tapped.tapped.shape == plain.features.shape  # [B, T, H]
    with torch.no_grad():
        hf = tiny.model(torch.tensor([rows[0]]), output_hidden_states=True).hidden_states
    assert torch.allclose(tapped.tapped[0], hf[-2][0], atol=1e-4)
    assert runner.tap_layers(-2) == runner.n_total_layers - 1 and runner.tap_layers(2) == 2
    for bad in (0, runner.n_total_layers + 1, -runner.n_total_layers - 1):
        with pytest.raises(ValueError):
            runner.tap_layers(bad)


def _synthetic(n: int, hidden: int, seed: int) -> Candidates:
    """Candidates whose pivots are told apart by one feature direction and the entropy."""
    g = torch.Generator().manual_seed(seed)
    pivot = torch.rand(n, generator=g) < 0.3
    feats = torch.randn(n, hidden, generator=g)
    feats[:, 0] += 2.5 * pivot.float()
    entropy = torch.rand(n, generator=g) + pivot.float()
    u_draft = torch.where(pivot, torch.tensor(0.1), torch.tensor(0.9))
    return Candidates(feats, entropy, torch.rand(n, generator=g), u_draft, torch.ones(n),
                      torch.arange(n) // 3, torch.zeros(n, dtype=torch.long),
                      torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long))


def test_the_classifier_learns_separable_labels_and_its_loss_falls():
    cfg = PadConfig(hidden=16, tap=-8, tap_layers=22)
    model, report = train_classifier(_synthetic(400, 16, 0), cfg, TrainSettings(steps=100))
    assert report.training["last_loss"] < 0.5 * report.training["first_loss"]
    assert report.validation["auc"] > 0.9 and report.validation["accuracy"] > 0.8
    assert report.counts["ambiguous"] == 0 and report.counts["held_out"] > 50
    fresh = _synthetic(300, 16, 1)  # new rows of the same rule
    y = label_of(fresh.u_draft, fresh.u_target, 0.8, 0.5, 0.8)
    score = model.pivot_prob(fresh.features, fresh.entropy, fresh.token_prob)
    assert auc(score, y) > 0.9


def test_too_few_labels_are_refused():
    c = _synthetic(40, 8, 2)
    c.u_draft[:] = 0.9  # no pivots at all
    with pytest.raises(TooFewLabels):
        train_classifier(c, PadConfig(8, -8, 1), TrainSettings(steps=5))


def test_pad_keep_is_the_papers_rule():
    torch.manual_seed(0)
    model = PivotClassifier(PadConfig(hidden=16, tap=-8, tap_layers=3)).eval()
    feats, ent = torch.randn(2, 5, 16), torch.rand(2, 5)
    prob = torch.tensor([[0.5, 1e-5, 0.2, 0.3, 0.9], [1e-3, 0.4, float("nan"), 0.1, 0.2]])
    assert pad_keep(model, feats, ent, prob, sigma=1.0).tolist() == \
        [[True, False, True, True, True], [True, True, False, True, True]]
    assert not pad_keep(model, feats, ent, prob, sigma=-0.1).any()
    p = model.pivot_prob(feats, ent, prob)  # [B, N]
    sigma = float(p.median())
    assert torch.equal(pad_keep(model, feats, ent, prob, sigma, 0.0),
                       (p <= sigma) & (prob >= 0))


def test_label_rule_and_auc():
    u_d = torch.tensor([0.0, 0.1, 0.4, 0.6, 0.9, 0.3])
    u_t = torch.tensor([1.0, 0.1, 1.0, 1.0, 0.9, 0.3])
    assert label_of(u_d, u_t, 0.8, 0.5, 0.8).tolist() == \
        [PIVOT, AMBIGUOUS, PIVOT, AMBIGUOUS, NOT_PIVOT, AMBIGUOUS]
    y = torch.tensor([0, 0, 1, 1])
    assert auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), y) == 1.0
    assert auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), y) == 0.0
    assert auc(torch.tensor([0.5, 0.5, 0.5, 0.5]), y) == 0.5
    assert auc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])) is None


def test_a_classifier_is_refused_by_another_target(tiny, tmp_path):
    from edgespec.heads.fingerprint import runner_fingerprint
    from edgespec.models.loading import load_model
    from edgespec.runner.target_runner import TargetRunner

    runner = TargetRunner(tiny.model, n_slots=1, max_len=16)
    cfg = PadConfig(hidden=runner.embed.shape[1], tap=-2, tap_layers=runner.tap_layers(-2))
    model = PivotClassifier(cfg)
    save_classifier(tmp_path / "pad", model, PadManifest(cfg, runner_fingerprint(runner),
                                                         "tiny"))
    back = load_classifier(tmp_path / "pad", runner)
    x = torch.randn(3, cfg.hidden)
    assert torch.equal(back(x, torch.ones(3), torch.ones(3)), model(x, torch.ones(3),
                                                                    torch.ones(3)))
    other = load_model(str(make_tiny_model(tmp_path / "other", seed=3)), dtype="float32")
    with pytest.raises(ConfigError, match="made for another target"):
        load_classifier(tmp_path / "pad", TargetRunner(other.model, n_slots=1, max_len=16))
    with pytest.raises(ConfigError, match="not a PAD classifier folder"):
        load_classifier(tmp_path, runner)
