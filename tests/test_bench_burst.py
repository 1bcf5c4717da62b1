"""``edgespec bench-burst``: a burst of arrivals against running streams through the product's
scheduler and engine: every mode (serial, batched and chunked prefill) gives the burst the same
outputs, the figures are written, and bad options are refused."""

from __future__ import annotations

import json

import pytest
from cli_inprocess import run_cli


@pytest.mark.parametrize("scored", [[], ["--prompt-logprobs", "2"]])
def test_bench_burst_compares_the_prefill_modes_with_identical_outputs(tmp_path, tiny_dir,
                                                                      scored):
    """With ``--prompt-logprobs`` the burst's prompts are scored as they are prefilled: their
    logprobs are compared too (every mode's the serial one's)."""
    out = tmp_path / "burst.json"
    r = run_cli("bench-burst", "--model", str(tiny_dir), "--streams", "2", "--burst", "5",
                "--prompt-tokens", "30-90", "--burst-tokens", "3", "--steady-tokens", "3",
                "--prefill-budget", "64", "--threads", "1", "--json", str(out), *scored)
    assert r.returncode == 0, r.stderr
    assert "ttft p50" in r.stdout and "chunked" in r.stdout and "fwd before" in r.stdout
    results = json.loads(out.read_text())["results"]
    assert [x["mode"] for x in results] == ["serial", "batched", "chunked"]
    assert all(x["identical_to_first"] for x in results)
    burst = json.loads(out.read_text())["config"]
    assert burst["prompt_logprobs"] == (2 if scored else None)
    # scored: every burst prompt's tokens after its first got one, in every mode
    assert all((x["prompt_logprob_entries"] > 0) == bool(scored) for x in results)
    assert [x["prefill_budget"] for x in results] == [None, None, 64]
    for x in results:
        assert 0 < x["ttft_p50_s"] <= x["ttft_p99_s"] <= x["ttft_max_s"]
        assert x["steady_gap_p50_s"] > 0 and x["burst_gap_max_s"] >= x["burst_gap_p99_s"]
        # every mode verifies the streams before and during the burst, and prefills in it
        assert x["forward_before_p50_s"] > 0 and x["forward_during_p50_s"] > 0
        assert x["prefill_during_p50_s"] > 0


def test_bench_burst_refuses_a_mode_it_does_not_know():
    r = run_cli("bench-burst", "--modes", "eager")
    assert r.returncode == 2 and "--modes" in r.stderr


def test_bench_burst_refuses_prompt_logprobs_out_of_range():
    r = run_cli("bench-burst", "--prompt-logprobs", "21")
    assert r.returncode == 2 and "logprobs" in r.stderr


def test_the_burst_percentiles_are_nearest_rank_like_every_report():
    """p50 of 64 values is the 32nd, p99 of 100 the 99th (not the one past them), and the
    streams' steady p50 is taken the same way."""
    from edgespec_cli.bench.burst import _percentile

    values = [float(v) for v in range(64, 0, -1)]  # 64 .. 1, unsorted
    assert _percentile(values, 0.5) == 32.0
    assert _percentile([float(v) for v in range(1, 101)], 0.99) == 99.0
    assert _percentile([7.0], 0.99) == 7.0 and _percentile([], 0.5) == 0.0


def test_the_streams_own_prefill_gaps_are_neither_steady_nor_the_bursts():
    """A gap that ends before every stream runs (the streams' own prefill) counts in neither
    figure; one that ends before the burst comes is steady; one that ends while the burst's
    first tokens come, or spans its arrival, is the burst's; one after them is neither."""
    from edgespec_cli.bench.burst import split_gaps

    arrivals = {"a": [0.0, 1.0, 2.0, 2.5, 4.0, 4.5, 9.0], "b": [1.5, 2.75, 6.0]}
    steady, during = split_gaps(arrivals, steady_from=2.0, came=3.0, done=5.0)
    assert sorted(steady) == [0.5]  # a's 2.0 -> 2.5; b's 1.5 -> 2.75 began before steady_from
    assert sorted(during) == [0.5, 1.5]  # a's 2.5 -> 4.0 (spans came) and 4.0 -> 4.5
