"""``edgespec pad-train`` as a user runs it (in this process: tests/cli_inprocess.py), on tiny
models: a tasks file labelled after a stop and a resume, with an early-exit drafter and with a
draft model, the labels' utilities on disk, a classifier saved with the target's fingerprint that
loads for its target; ``--measure``; bad input refused with one line."""

import json
import shutil

import pytest
import torch

from cli_inprocess import run_cli as edgespec
from conftest import hf_greedy

from edgespec.models.loading import encode_prompt

pytestmark = pytest.mark.slow  # processes and decoding: not the fast tier

SCORER = r"regex:^\s*(\S)"  # the answer's first visible character


def _tasks_file(tiny, path):
    """Problems whose reference answer is the tiny target's own greedy first character, so it
    succeeds on some of them and samples and drafts can go either way."""
    rows = []
    for i in range(24):
        prompt = f"q{i} {'abcdefgh'[i % 8]}{i * 7 % 13}"
        out = hf_greedy(tiny.model, encode_prompt(tiny.tokenizer, prompt), 8)
        first = tiny.tokenizer.decode(out, skip_special_tokens=True).strip()[:1] or "x"
        rows.append({"prompt": prompt, "answer": first})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _pad_train(model, out, tasks, *extra):
    return edgespec("pad-train", "--model", model, "--dtype", "float32", "--out", out,
                    "--tasks-file", tasks, "--scorer", SCORER, "--rollouts", 4,
                    "--max-new-tokens", 6, "--slots", 8, "--per-shard", 4, "--threads", 1,
                    "--tap", -2, "--temperature", 1.0, *extra)


def test_pad_train_labels_resumably_and_saves_a_classifier_for_its_target(tiny, tiny_dir,
                                                                          tiny_draft_dir,
                                                                          tmp_path):
    tasks = _tasks_file(tiny, tmp_path / "tasks.jsonl")
    out = tmp_path / "out"
    r = _pad_train(tiny_dir, out, tasks, "--drafter", "layers:1", "--max-minutes", 0)
    assert r.returncode == 0 and "run the same command again to resume" in r.stdout
    assert not (out / "classifier").exists()
    r = _pad_train(tiny_dir, out, tasks, "--drafter", "layers:1", "--no-label")
    assert r.returncode == 1 and "no classifier: 0 pivots" in r.stdout  # a script can tell
    r = _pad_train(tiny_dir, out, tasks, "--drafter", "layers:1")
    assert r.returncode == 0, r.stderr
    assert "labels: shard 4/4" in r.stdout and "ETA" in r.stdout
    from edgespec.pad.labels import load_labels

    labelled = load_labels(out / "labels" / "tasks")
    c = labelled.candidates
    assert len(c) > 5 and c.features.shape == (len(c), tiny.model.config.hidden_size)
    assert ((c.u_draft >= 0) & (c.u_draft <= 1)).all() and (c.draft_token != c.target_token).all()
    assert len(labelled.success) == labelled.info.problems
    manifest = json.loads((out / "classifier" / "pad.json").read_text())
    assert manifest["command"].startswith("edgespec pad-train")
    assert manifest["labels"]["pivots"] >= 2 and manifest["labels"]["not_pivots"] >= 2
    assert manifest["config"]["tap_layers"] == tiny.model.config.num_hidden_layers - 1
    assert "auc" in manifest["validation"] and manifest["training"]["best_step"] >= 1

    from edgespec.pad.classifier import load_classifier, pad_keep
    from edgespec.runner.target_runner import TargetRunner

    runner = TargetRunner(tiny.model, n_slots=1, max_len=32)
    classifier = load_classifier(out / "classifier", runner)
    keep = pad_keep(classifier, c.features[None], c.entropy[None], c.token_prob[None], 0.5)
    assert keep.shape == (1, len(c)) and keep.dtype == torch.bool

    again = _pad_train(tiny_dir, out, tasks, "--drafter", "layers:1")
    assert again.returncode == 0 and "classifier already in" in again.stdout
    other = _pad_train(tiny_dir, tmp_path / "o2", tasks, "--drafter", f"model:{tiny_draft_dir}",
                       "--train-steps", 20)
    assert other.returncode == 0, other.stderr
    assert "drafter model:" in other.stdout


def test_a_generated_task_grows_with_a_larger_problems_count(tiny_dir, tmp_path):
    """A finished run on a generated family continues when asked for more problems: the first
    shards are kept, the new ones labelled, the classifier trained again on all of them (or,
    as here, none: the tiny target fails this task); any other change is refused."""
    from edgespec.pad.labels import LabelInfo, finished_shards

    out, folder = tmp_path / "out", tmp_path / "out" / "labels" / "arith"

    def run(n, *extra):
        return edgespec("pad-train", "--model", tiny_dir, "--dtype", "float32", "--out", out,
                        "--task", "arith", "--problems", n, "--rollouts", 2,
                        "--max-new-tokens", 4, "--slots", 4, "--per-shard", 2, "--threads", 1,
                        "--tap", -2, "--drafter", "layers:1", "--skip-at", 0, *extra)

    first = run(2)  # labelled, no classifier (the tiny target fails the task): exit 1
    assert first.returncode == 1 and "no classifier" in first.stdout, first.stderr
    shard0 = (folder / "shard-00000.safetensors").read_bytes()
    (out / "classifier").mkdir(exist_ok=True)  # as if the first run had trained one
    (out / "classifier" / "pad.json").write_text("{}")
    stopped = run(4, "--max-minutes", 0)  # grows, then stops before its new shard
    assert stopped.returncode == 0, stopped.stderr
    assert "grows from 2 to 4 problems" in stopped.stdout
    assert "run the same command again to resume" in stopped.stdout
    assert (out / "classifier.previous" / "pad.json").exists()  # not left looking current
    assert not (out / "classifier").exists()
    grown = run(4)
    assert grown.returncode == 1 and "no classifier" in grown.stdout, grown.stderr
    assert "resuming after 1 of 2" in grown.stdout and "classifier already in" not in grown.stdout
    info = LabelInfo.load(folder)
    assert info.problems == 4 and finished_shards(folder, info) == 2
    assert (folder / "shard-00000.safetensors").read_bytes() == shard0  # kept, not redone
    (out / "classifier").mkdir()  # as if the grown run had trained one
    (out / "classifier" / "pad.json").write_text("{}")
    other = run(6, "--rollouts", 3)  # refused before the classifier is set aside
    assert other.returncode == 2 and "made otherwise" in other.stderr, other.stderr
    assert (out / "classifier" / "pad.json").exists()  # where it was
    assert LabelInfo.load(folder).problems == 4
    shutil.rmtree(out / "classifier")
    # a run whose last shard is not whole cannot grow: refused, saying why, and the classifier
    # it made stays where it is
    out, folder = tmp_path / "partial", tmp_path / "partial" / "labels" / "arith"
    assert run(3).returncode == 1  # 3 problems in shards of 2: its last shard holds 1
    (out / "classifier").mkdir(exist_ok=True)
    (out / "classifier" / "pad.json").write_text("{}")
    refused = run(4)
    assert refused.returncode == 2 and "its last shard is not whole" in refused.stderr
    assert (out / "classifier" / "pad.json").exists() and not (out / "classifier.previous").exists()
    assert LabelInfo.load(folder).problems == 3


def test_measure_and_bad_input(tiny_dir, tmp_path):
    r = edgespec("pad-train", "--model", tiny_dir, "--dtype", "float32", "--measure", 4,
                 "--task", "arith", "--max-new-tokens", 4, "--threads", 1)
    assert r.returncode == 0, r.stderr
    assert "arith: greedy success" in r.stdout and "/4 =" in r.stdout
    r = edgespec("pad-train", "--model", tiny_dir, "--out", tmp_path / "o", "--task", "poetry")
    assert r.returncode == 2 and "unknown task" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "no answer"}\n')
    r = edgespec("pad-train", "--model", tiny_dir, "--out", tmp_path / "o", "--tasks-file", bad)
    assert r.returncode == 2 and 'needs "prompt"' in r.stderr
    r = edgespec("pad-train", "--model", tiny_dir, "--out", tmp_path / "o", "--drafter", "mag")
    assert r.returncode == 2 and "not a drafter this command runs 'mag'" in r.stderr
    assert "layers:L" in r.stderr
    r = edgespec("pad-train", "--model", tiny_dir, "--task", "arith")
    assert r.returncode == 2 and "needs --out" in r.stderr
