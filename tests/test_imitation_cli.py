"""``edgespec distill --kinds imitation`` and ``--drafter imitation:DIR`` on the command line, on
a tiny model: a network made from a prompt file after a stop and a resume, its manifest naming
its exit layer, used by generate losslessly; bad input refused with one line. The commands run in
this process (tests/cli_inprocess.py), as test_distill_cli's do: each spares a new interpreter's
import of torch and transformers."""

import json

import pytest

from cli_inprocess import run_cli as edgespec
from conftest import hf_greedy
from test_distill_cli import PROMPTS

from edgespec.models.loading import encode_prompt

pytestmark = pytest.mark.slow  # training: not the fast tier


def _distill(tmp_path, model, *extra):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return edgespec("distill", "--model", model, "--dtype", "float32", "--out",
                    tmp_path / "out", "--no-spec-bench", "--prompts", prompts, "--kinds",
                    "imitation", "--exit-layer", 2, "--imitation-steps", 40, "--imitation-ffn",
                    64, "--slots", 4, "--per-shard", 3, "--max-new-tokens", 16, "--vocab", 64,
                    "--threads", 1, *extra)


def test_distill_makes_an_imitation_network_that_generate_uses_losslessly(tiny, tiny_dir,
                                                                          tmp_path):
    r = _distill(tmp_path, tiny_dir, "--max-minutes", 0)  # stops at once, resumably
    assert r.returncode == 0 and "run the same command again to resume" in r.stdout
    r = _distill(tmp_path, tiny_dir)
    assert r.returncode == 0, r.stderr
    assert "exit states (layers 2)" in r.stdout and "imitation network (layer 2) in" in r.stdout
    net = tmp_path / "out" / "imitation-2"
    manifest = json.loads((net / "imitation.json").read_text())
    assert manifest["exit_layer"] == 2 and manifest["command"].startswith("edgespec distill")
    assert set(manifest["validation"]) >= {"first_draft_accuracy", "plain_exit_accuracy"}
    again = _distill(tmp_path, tiny_dir)
    assert again.returncode == 0 and "imitation network (layer 2) already in" in again.stdout
    ref = hf_greedy(tiny.model, encode_prompt(tiny.tokenizer, "abcabc"), 20)
    for drafter in (f"imitation:{net}", f"mag+imitation:{net}"):
        g = edgespec("generate", "abcabc", "--model", tiny_dir, "--drafter", drafter,
                     "--max-new-tokens", 20, "--json", "--dtype", "float32")
        assert g.returncode == 0, g.stderr
        out = json.loads(g.stdout)
        assert out["token_ids"] == ref and out["stats"]["head_tokens"] > 0


def test_bad_imitation_input_is_refused_with_one_line(tiny_dir, tmp_path):
    r = edgespec("distill", "--model", tiny_dir, "--out", tmp_path / "o", "--kinds",
                 "imitation")
    assert r.returncode == 2 and "needs --exit-layer" in r.stderr
    # a layer the target does not have: refused before the harvest (it was refused after it)
    r = edgespec("distill", "--model", tiny_dir, "--out", tmp_path / "o", "--kinds",
                 "imitation", "--exit-layer", "2,99")
    assert r.returncode == 2 and "--exit-layer must be in 1..3 for this target, got 99" in \
        r.stderr, r.stderr
    assert not (tmp_path / "o").exists()
    g = edgespec("generate", "abc", "--model", tiny_dir, "--drafter",
                 f"imitation:{tmp_path / 'none'}")
    assert g.returncode == 2 and "not found" in g.stderr
