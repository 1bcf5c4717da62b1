"""The command line doing its work on a tiny model: generate's output (JSON identical to
target-only decoding, text streamed to the terminal, a prompt from a file, stdin or empty) and
bench's and bench-forward's reports. Run as a user runs it (a subprocess: ``edgespec``) where the
process is what is tested (a generation streamed to the terminal, JSON on a real stdout);
otherwise in this process (``run_cli``: the same ``main`` and its exit status, without a new
interpreter importing torch and transformers for each command). Its refusals:
tests/test_cli_refusals.py."""

import json

import pytest
from cli_inprocess import run_cli
from conftest import hf_greedy
from procs import run_edgespec as edgespec

from edgespec.models.loading import encode_prompt

pytestmark = pytest.mark.slow  # processes, servers or long sweeps: not the fast tier


def test_generate_json_is_identical_to_target_only(tiny, tiny_dir):
    ids = encode_prompt(tiny.tokenizer, "abcabcabc")
    ref = hf_greedy(tiny.model, ids, 24)
    for drafter, run in (("mag", edgespec), ("none", run_cli), ("layers:2", run_cli)):
        r = run("generate", "abcabcabc", "--model", tiny_dir, "--drafter", drafter,
                "--max-new-tokens", 24, "--json", "--dtype", "float32")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["token_ids"] == ref and out["dtype"] == "float32"
        assert out["text"] == tiny.tokenizer.decode(ref, skip_special_tokens=True)
        for key in ("drafted", "accepted", "mean_acceptance_length", "tokens_per_s"):
            assert key in out["stats"]


def test_generate_streams_text_and_reports_stats(tiny_dir):
    r = edgespec("generate", "hello", "--model", tiny_dir, "--max-new-tokens", 10,
                 "--temperature", 0.8, "--top-k", 20, "--seed", 1)
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stderr and "mean acceptance length" in r.stderr
    assert "Loading weights" not in r.stderr  # transformers' bar kept out of a pipe or a log


def test_bench_writes_summary_json(tiny_dir, tmp_path):
    out = tmp_path / "bench.json"
    r = run_cli("bench", "--model", tiny_dir, "--categories", "qa", "translation",
                "--max-new-tokens", 12, "--drafters", "mag;cacheback;cascade:layers:2,mag",
                "--assist-layers", 2, "--loose", "mag", "--trees", "mag+cacheback",
                "--tree-width", 3, "--skip-llamacpp", "--json", out)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    summary = report["summary"]
    for key in ("speedup_vs_target_only", "speedup_vs_hf_generate",
                "speedup_vs_hf_prompt_lookup", "per_category_speedup_vs_target_only", "lossless"):
        assert key in summary
    assert summary["lossless"] is True
    drafters = summary["drafters"]
    assert set(drafters) == {"mag", "cacheback", "cascade:layers:2,mag",
                             "mag+cacheback@tree3", "loose:mag"}
    assert summary["method"] in {f"edgespec:{d}" for d in drafters}
    loose = drafters["loose:mag"]
    assert loose["lossless"] is False and "token_match_rate" in loose
    table = report["categories"]["all"]
    for name in ("mag", "cacheback", "cascade:layers:2,mag", "mag+cacheback@tree3"):
        fig = drafters[name]
        assert fig["lossless"] is True
        # the speedup is the drafter's throughput over target-only's, measured in this run
        assert fig["speedup_vs_target_only"] == round(
            table[f"edgespec:{name}"]["tokens_per_s"] / table["target_only"]["tokens_per_s"], 3)
        assert set(fig["per_category_speedup_vs_target_only"]) == {"qa", "translation"}
    results = report["results"]
    assert {r["method"] for r in results} >= {
        "target_only", "hf_generate", "hf_prompt_lookup", "hf_assisted", "edgespec:mag",
        "edgespec-loose:mag"}
    from edgespec.runner.dtype_probe import exact_here

    assert exact_here(report["config"]["dtype"])
    assert report["config"]["cpu"]["model"] and "machine: " in r.stdout
    if report["config"]["dtype"] != "float32":  # float32 target-only runs beside it
        assert "target_only_float32" in {r["method"] for r in results}
        assert summary["speedup_vs_target_only_float32"] == round(
            table[summary["method"]]["tokens_per_s"]
            / table["target_only_float32"]["tokens_per_s"], 3)
    loose = [r for r in results if r["method"] == "edgespec-loose:mag"]
    assert all(r["stats"]["lossless"] is False and 0 <= r["token_match_rate"] <= 1
               for r in loose)
    assert all(r["stats"]["lossless"] is True for r in results
               if r["method"].startswith("edgespec:"))
    # translation has references in Spec-Bench: every method's output is scored against them
    assert all("task_score" in r for r in results if r["category"] == "translation")
    assert report["config"]["trees"] == ["mag+cacheback"] and report["config"]["tree_width"] == 3
    row = report["categories"]["all"]["edgespec:cacheback"]
    assert row["tokens_per_forward"] >= 1 and row["forward_ms_per_token"] > 0
    [levels] = report["cascade_levels"].values()
    assert levels[0]["upper"] == "layers:2" and levels[0]["lower"] == "mag"
    warm = report["fleet_warm"]
    assert warm["entries_pulled_by_b"] > 0
    for cat in ("qa", "translation"):
        both = warm["categories"][cat]
        assert both["cold"]["identical_to_target_only"] and both["warm"]["identical_to_target_only"]
    assert "== qa ==" in r.stdout and "[1/" in r.stderr and "fleet table cold" in r.stdout

def test_bench_forward_prints_a_table_and_writes_json(tiny_dir, tmp_path):
    out = tmp_path / "fc.json"
    r = run_cli("bench-forward", "--model", tiny_dir, "--batches", "1,2", "--tokens", "1,3",
                "--context", 20, "--repeat", 1, "--profile", "2,3", "--threads", 1,
                "--dtypes", "float32", "--json", out)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    cells = {(c["sessions"], c["tokens"]): c for c in report["cells"]}
    assert set(cells) == {(1, 1), (1, 3), (2, 1), (2, 3)}
    assert cells[(1, 1)]["vs_decode_step"] == 1.0 and all(c["ms"] > 0 for c in cells.values())
    prof = report["profile"]["ms"]["float32"]
    assert prof["total"] > 0 and set(prof) == {"linear", "attention", "head", "other", "total"}
    assert "x decode step" in r.stdout and report["threads"] == 1
    # which CPU the figures came from: model, ISA flags, caps, threads
    assert report["cpu"]["threads"] == 1 and report["cpu"]["model"]
    assert isinstance(report["cpu"]["bf16_native"], bool) and "machine: " in r.stdout
    # how the runner ran: eager kernels and no CUDA graphs on a CPU (the GPU sitting has both)
    state = report["runner"]["float32"]
    assert state["kernels"] == "eager" and state["graphs"] is None and state["device"] == "cpu"
    bad = run_cli("bench-forward", "--model", tiny_dir, "--batches", "0")
    assert bad.returncode == 2 and "--batches" in bad.stderr


def test_generate_reads_the_prompt_from_a_file_or_stdin(tiny, tiny_dir, tmp_path):
    prompt = "abc\nabc abc"  # a newline, kept
    ref = hf_greedy(tiny.model, encode_prompt(tiny.tokenizer, prompt), 12)
    path = tmp_path / "prompt.txt"
    path.write_text(prompt, encoding="utf-8")
    common = ["--model", tiny_dir, "--max-new-tokens", 12, "--json", "--dtype", "float32"]
    r = run_cli("generate", "--prompt-file", path, *common)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == ref
    r = run_cli("generate", "--prompt-file", "-", *common, stdin=prompt)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == ref


@pytest.mark.parametrize("args,message", [
    (["hello", "--prompt-file", "prompt.txt"], "not both"),
    ([], "no prompt"),
    (["--prompt-file", "missing.txt"], "cannot read the prompt file"),
])
def test_prompt_and_prompt_file_exactly_one(tiny_dir, tmp_path, args, message):
    (tmp_path / "prompt.txt").write_text("hi")
    args = [str(tmp_path / a) if a.endswith(".txt") else a for a in args]
    r = run_cli("generate", *args, "--model", tiny_dir)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_an_empty_prompt_generates_and_a_prompt_of_zero_tokens_is_refused(tiny, tiny_dir):
    """The one rule for empty prompts: "" through the chat template is an empty user message,
    which the template makes into tokens, and generates; with --raw it is zero tokens: exit 2
    with the message every surface gives (tests/test_http_api.py: the SDK and HTTP)."""
    ids = encode_prompt(tiny.tokenizer, "")
    assert ids  # the template's own tokens
    ref = hf_greedy(tiny.model, ids, 12)
    common = ["--model", tiny_dir, "--max-new-tokens", 12, "--json", "--dtype", "float32"]
    r = run_cli("generate", "", *common)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == ref
    r = run_cli("generate", "", "--raw", *common)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "edgespec: error: the prompt is empty"
    assert "Traceback" not in r.stderr


def test_the_command_exits_with_mains_status_its_exit_handlers_run_and_its_heap_frozen():
    """``run`` (the ``edgespec`` script's and ``python -m edgespec_cli``'s entry): main's return
    is the exit status, and what is alive then is frozen out of the collector before the
    interpreter tears down (its exit handlers still run)."""
    import subprocess
    import sys

    code = ("import atexit, gc\n"
            "from edgespec_cli import main as cli\n"
            "cli.main = lambda **kw: 3\n"
            "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0, flush=True))\n"
            "cli.run()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.strip()) == (3, "frozen True"), r.stderr
