"""``edgespec distill`` and heads on the command line (in this process: tests/cli_inprocess.py;
tests/test_cli.py runs commands as processes), on tiny models: the data and a head made from a
prompt file after a stop and a resume, used by generate (lossless), refused by another target,
bad input refused with one line."""

import json

import pytest

from cli_inprocess import run_cli as edgespec
from conftest import hf_greedy, make_tiny_model

from edgespec.models.loading import encode_prompt

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier

PROMPTS = ["hello there", "count: 1 2 3 4", "abcabcabc", "the quick brown fox",
           "x y z x y z", "print('hi')", "colours: red, green", "a long list: a, b, c, d"]


def _distill(tmp_path, model, *extra):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS) +
                       json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    return edgespec("distill", "--model", model, "--dtype", "float32", "--out",
                    tmp_path / "out", "--no-spec-bench", "--prompts", prompts, "--kinds",
                    "eagle", "--train-steps", 30, "--slots", 4, "--per-shard", 3,
                    "--max-new-tokens", 16, "--vocab", 64, "--threads", 1, *extra)


def test_distill_makes_a_head_that_generate_uses_losslessly_and_others_refuse(tiny, tiny_dir,
                                                                           tmp_path):
    r = _distill(tmp_path, tiny_dir, "--max-minutes", 0)  # stops at once, resumably
    assert r.returncode == 0 and "run the same command again to resume" in r.stdout
    assert not (tmp_path / "out" / "eagle").exists()
    r = _distill(tmp_path, tiny_dir)
    assert r.returncode == 0, r.stderr
    assert "harvest: shard 6/6" in r.stdout and "ETA" in r.stdout
    manifest = json.loads((tmp_path / "out" / "eagle" / "head.json").read_text())
    assert manifest["kind"] == "eagle" and manifest["feature_dtype"] == "float32"
    assert manifest["command"].startswith("edgespec distill") and manifest["validation"]
    assert manifest["data"]["sources"] == [str(tmp_path / "prompts.jsonl")]
    again = _distill(tmp_path, tiny_dir)  # nothing left to do
    assert again.returncode == 0 and "eagle head already in" in again.stdout
    ref = hf_greedy(tiny.model, encode_prompt(tiny.tokenizer, "abcabc"), 20)
    for drafter in (f"head:{tmp_path / 'out' / 'eagle'}",
                    f"mag+head:{tmp_path / 'out' / 'eagle'}"):
        g = edgespec("generate", "abcabc", "--model", tiny_dir, "--drafter", drafter,
                     "--max-new-tokens", 20, "--json", "--dtype", "float32")
        assert g.returncode == 0, g.stderr
        out = json.loads(g.stdout)
        assert out["token_ids"] == ref and out["stats"]["head_tokens"] > 0
    other = make_tiny_model(tmp_path / "other", seed=3)
    g = edgespec("generate", "abc", "--model", other, "--drafter",
                 f"head:{tmp_path / 'out' / 'eagle'}", "--dtype", "float32")
    assert g.returncode == 2 and "made for another target" in g.stderr


def test_bad_heads_and_bad_input_are_refused_with_one_line(tiny_dir, tmp_path):
    g = edgespec("generate", "abc", "--model", tiny_dir, "--drafter",
                 f"head:{tmp_path / 'none'}")
    assert g.returncode == 2 and "not found" in g.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    r = edgespec("distill", "--model", tiny_dir, "--out", tmp_path / "o2", "--no-spec-bench",
                 "--prompts", bad)
    assert r.returncode == 2 and 'needs "prompt"' in r.stderr
    # a ShareGPT-style role: refused with the file and line, before the model loads
    bad.write_text('{"prompt": "ok"}\n{"messages": [{"role": "human", "content": "hi"}]}\n')
    r = edgespec("distill", "--model", tiny_dir, "--out", tmp_path / "o2", "--no-spec-bench",
                 "--prompts", bad)
    assert r.returncode == 2 and f"{bad}:2: messages[0] has the unknown role 'human'" in \
        r.stderr, r.stderr
    r = edgespec("distill", "--model", tiny_dir, "--out", tmp_path / "o3", "--kinds", "medusa")
    assert r.returncode == 2 and "unknown head kind" in r.stderr
    r = edgespec("generate", "abc", "--model", tiny_dir, "--learn")
    assert r.returncode == 2 and "--learn fine-tunes a draft head" in r.stderr


@pytest.mark.parametrize("extra,needle", [
    (["--max-new-tokens", "0"], "--max-new-tokens"), (["--slots", "0"], "--slots"),
    (["--samples", "-1"], "--samples"), (["--temperature", "-1"], "--temperature"),
    (["--hold-out", "-1"], "--hold-out"), (["--max-minutes", "-1"], "--max-minutes"),
    (["--hold-out-category", "poetry"], "poetry"), (["--imitation-steps", "0"], "--imitation"),
])
def test_distill_refuses_what_would_fail_after_the_harvest(tiny_dir, tmp_path, extra, needle):
    """Each refused before the harvest (hours on a real model), in one line: they raised a
    traceback after it, or ran with another meaning."""
    r = edgespec("distill", "--model", tiny_dir, "--out", tmp_path / "o", *extra)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert not (tmp_path / "o" / "data").exists()


def test_distill_refuses_an_out_that_is_a_file(tiny_dir, tmp_path):
    (tmp_path / "f").write_text("")
    r = edgespec("distill", "--model", tiny_dir, "--out", tmp_path / "f")
    assert r.returncode == 2 and "is a file" in r.stderr
