"""``edgespec generate --json`` on a tiny model, in this process (``run_cli``): the output, its
logprobs, the prompt's logprobs, penalties and logit bias target-only decoding's with any
drafter, and the dtype it serves in (the probed one, lossless there; one not exact here
refused)."""

import json

import pytest
import torch
from cli_inprocess import run_cli

from edgespec.models.loading import encode_prompt

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier


def test_generate_json_logprobs_are_target_onlys(tiny, tiny_dir):
    """--logprobs K: one entry a token, the same values with any drafter, K alternatives."""
    outs = {}
    for drafter in ("none", "layers:3"):  # a fixed draft length: drafts every step
        r = run_cli("generate", "abcabcabc", "--model", tiny_dir, "--drafter", drafter,
                    "--max-new-tokens", 24, "--json", "--dtype", "float32", "--logprobs", 3,
                    "--no-adaptive")
        assert r.returncode == 0, r.stderr
        outs[drafter] = json.loads(r.stdout)
    none, drafted = outs["none"], outs["layers:3"]
    assert drafted["stats"]["accepted"] > 0  # drafts were verified and kept
    assert drafted["token_ids"] == none["token_ids"]
    assert drafted["logprobs"] == none["logprobs"]
    assert [e["token_id"] for e in none["logprobs"]] == none["token_ids"]
    assert all(len(e["top"]) == 3 and e["top"][0] == [e["token_id"], e["logprob"]]
               for e in none["logprobs"])  # greedy: the token is the most likely


def test_generate_json_prompt_logprobs_are_the_models(tiny, tiny_dir):
    """--prompt-logprobs K: one entry a prompt token after the first, the model's own (a
    forward of transformers' over the prompt), the same with any drafter and with no output
    (--max-new-tokens 0: the prompt scored alone); the output as without them."""
    outs = {}
    for drafter, extra in (("none", ["--prompt-logprobs", 2]),
                           ("layers:3", ["--prompt-logprobs", 2]), ("none", []),
                           ("mag", ["--prompt-logprobs", 2, "--max-new-tokens", 0])):
        r = run_cli("generate", "abcabcabc", "--model", tiny_dir, "--drafter", drafter, "--raw",
                    "--max-new-tokens", 8, "--json", "--dtype", "float32", "--no-adaptive",
                    *extra)
        assert r.returncode == 0, r.stderr
        outs[drafter, bool(extra)] = json.loads(r.stdout)
    scored, plain = outs["none", True], outs["none", False]
    assert outs["layers:3", True]["prompt_logprobs"] == scored["prompt_logprobs"]
    alone = outs["mag", True]
    assert alone["prompt_logprobs"] == scored["prompt_logprobs"] and alone["token_ids"] == []
    assert alone["finish_reason"] == "length"
    assert scored["token_ids"] == plain["token_ids"] and "prompt_logprobs" not in plain
    ids = encode_prompt(tiny.tokenizer, "abcabcabc", raw=True)
    assert len(scored["prompt_logprobs"]) == scored["prompt_tokens"] - 1 == len(ids) - 1
    with torch.no_grad():
        lp = torch.log_softmax(tiny.model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    for i, e in enumerate(scored["prompt_logprobs"]):
        assert e["token_id"] == ids[i + 1] and len(e["top"]) == 2
        assert e["logprob"] == pytest.approx(float(lp[i, ids[i + 1]]), abs=1e-4)


def test_generate_penalties_and_logit_bias_are_target_onlys(tiny_dir):
    """--presence-penalty, --frequency-penalty, --logit-bias: the same tokens with any drafter,
    a banned token never emitted, and the output moved from the plain one."""
    outs = {}
    base = json.loads(run_cli("generate", "abcabcabc", "--model", tiny_dir, "--drafter", "none",
                              "--max-new-tokens", 24, "--json", "--dtype", "float32").stdout)
    banned = base["token_ids"][0]
    for drafter in ("none", "layers:3"):
        r = run_cli("generate", "abcabcabc", "--model", tiny_dir, "--drafter", drafter,
                    "--max-new-tokens", 24, "--json", "--dtype", "float32", "--no-adaptive",
                    "--presence-penalty", 0.4, "--frequency-penalty", 0.9,
                    "--logit-bias", f"{banned}=-100, 5=1.5")
        assert r.returncode == 0, r.stderr
        outs[drafter] = json.loads(r.stdout)
    assert outs["layers:3"]["stats"]["accepted"] > 0
    assert outs["layers:3"]["token_ids"] == outs["none"]["token_ids"] != base["token_ids"]
    assert banned not in outs["none"]["token_ids"]


@pytest.mark.parametrize("args, match", [
    (("--logit-bias", "5"), "--logit-bias takes ID=BIAS pairs"),
    (("--logit-bias", "x=1"), "--logit-bias takes ID=BIAS pairs"),
    (("--logit-bias", "1_0=1"), "--logit-bias takes ID=BIAS pairs"),
    (("--logit-bias", "5=200"), "the bias of token 5 must be a number in"),
    (("--presence-penalty", "3"), "--presence-penalty must be a number in"),
    (("--logit-bias", "5=200"), "--logit-bias: the bias of token 5"),
    (("--top-p", "1.5"), "--top-p must be in (0, 1]"),
    (("--top-k", "-3"), "--top-k must be in"),
    (("--temperature", "-1"), "--temperature must be finite"),
    (("--json", "--logprobs", "50"), "(the alternatives a token gets), got 50"),
    (("--max-new-tokens", "0"), "0 only with --prompt-logprobs"),
    (("--max-new-tokens", "-1", "--prompt-logprobs", "1", "--json"), "must be >= 1"),
])
def test_generate_refuses_bad_penalties_before_loading_a_model(args, match):
    r = run_cli("generate", "hi", "--model", "/no/such/model", *args)
    assert r.returncode == 2 and match in r.stderr, r.stderr


def test_generate_default_dtype_is_the_probed_one_and_lossless_in_it(tiny_dir):
    """``--dtype auto`` (the default) serves an exact dtype it measured here (bfloat16 on an
    AMX CPU), says so in --json, and speculative output equals target-only
    in that dtype (asked for by name after: a loaded machine may measure otherwise next time)."""
    from edgespec.runner.dtype_probe import exact_here

    outs = {}
    dtype = "auto"
    for drafter in ("none", "mag", "layers:2"):
        r = run_cli("generate", "abcabcabc", "--model", tiny_dir, "--drafter", drafter,
                    "--max-new-tokens", 24, "--json", "--dtype", dtype)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        if dtype == "auto":
            assert exact_here(out["dtype"]) and out["dtype"] in ("bfloat16", "float32")
            dtype = out["dtype"]
        assert out["dtype"] == dtype
        outs[drafter] = out["token_ids"]
    assert len(outs["none"]) == 24 and outs["mag"] == outs["none"] == outs["layers:2"]


def test_a_dtype_that_is_not_exact_here_is_refused(tiny_dir):
    from edgespec.runner.dtype_probe import exact_here

    if exact_here("float16"):
        pytest.skip("float16 is batch-invariant on this machine")
    r = run_cli("generate", "hi", "--model", tiny_dir, "--dtype", "float16")
    assert r.returncode != 0 and "not batch-invariant" in r.stderr
