"""The GPU issues' goals judged from a sitting's results (``scripts/sitting_goals.py``) and
rendered as ``sitting.md``'s goals table: each goal met or missed where the sitting measured
it, "not measured" where a stage was skipped or cut, the one-stream goal against the last
compiled ``generate`` when the sitting skipped it, the default kernel's long-context ratio."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from sitting_goals import goal_rows, hf_reference  # noqa: E402
from sitting_tables import format_tables  # noqa: E402


def _forward(shape: str, sessions: int, tokens: int, ms: float) -> dict:
    return {"shape": shape, "sessions": sessions, "tokens": tokens, "ms": ms}


def _sitting(**stages) -> dict:
    return {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "dtype": "bfloat16",
            "command": "scripts/gpu_sitting.sh --out x", "mismatches": [], **stages}


def _by_goal(rows, shape: str) -> dict:
    return {r.goal: r for r in rows if r.shape == shape}


def test_each_goal_is_met_or_missed_by_its_own_figure():
    d = _sitting(
        forward=[_forward("8b", 1, 1, 4.4), _forward("8b", 64, 1, 5.2),
                 _forward("8b", 64, 9, 14.9), _forward("1.7b", 1, 1, 2.1),
                 _forward("1.7b", 64, 1, 4.0), _forward("1.7b", 64, 9, 6.0)],
        decode={"8b": {"tiles": {"1x1@300_ms": 4.4, "1x1@4096_ms": 6.0}}},
        exactness={"8b": {"1x1": {"cost_of_exactness": 0.15},
                          "64x9": {"cost_of_exactness": 0.151}}},
        e2e={"8b": {"target_only_tok_s": 190.0, "identical": True}},
        hf={"8b": {"static_compiled_tok_s": 126.0}},
        fleet={"8b": {"32": {"throughput_ratio": 8.0, "identical": True},
                      "64": {"target_only_decode_vs_step": 0.79, "identical": True}}})
    eight = _by_goal(goal_rows(d), "8b")
    assert eight["64 x 9 <= 15 ms"].met is True
    assert eight["64 x 9 <= 15 ms"].measured == "14.90 ms"
    assert eight["64 x 1 <= 5 ms"].met is False
    assert eight["decode 1 x 1 at 300 keys <= 4.5 ms"].met is True
    assert eight["decode at 4,096 keys <= 1.3x at 300 (tiles)"].met is False  # 1.36x
    assert eight["the cost of exactness at 1x1 <= 15%"].met is True  # at the line
    assert eight["the cost of exactness at 64x9 <= 15%"].met is False
    one_stream = eight["one stream >= 1.5x transformers' compiled generate"]
    assert (one_stream.met, one_stream.measured) == (True, "1.51x")
    assert eight["32 sessions batched >= 8x one a forward"].met is True
    assert eight["64 sessions' target-only decoding >= 0.8 of 64 / the 64 x 1 step"].met \
        is False
    small = _by_goal(goal_rows(d), "1.7b")
    assert small["64 x 9 <= 1.6x its 64 x 1"].met is True  # 1.5x
    assert small["decode 1 x 1 at 300 keys <= 2 ms"].met is False


def test_what_a_sitting_did_not_measure_is_said_not_judged():
    rows = goal_rows(_sitting(forward=[_forward("135m", 1, 1, 1.1)]))
    judged = {r.goal: r.met for r in rows if r.shape == "135m"}
    assert judged.pop("decode 1 x 1 at 300 keys <= 1.2 ms") is True
    assert set(judged.values()) == {None}  # no wide step, decode stage, fleet, e2e, tests
    assert [(r.shape, r.met) for r in rows[-2:]] == [("all", None), ("all", None)]
    md = format_tables(_sitting(forward=[_forward("135m", 1, 1, 1.1)]))
    assert "| 43 | 64 x 9 <= 1.6x its 64 x 1 | 135m | - | not measured |" in md
    assert "| 43 | decode 1 x 1 at 300 keys <= 1.2 ms | 135m | 1.10 ms | yes |" in md
    assert "Goals" not in format_tables(_sitting())  # nothing measured: no table


def test_the_one_stream_goal_reads_the_last_compiled_generate_when_this_sitting_skipped_it():
    ref = hf_reference()
    assert ref["static_compiled_tok_s"]["8b"] > 0 and ref["from"]
    d = _sitting(e2e={"8b": {"target_only_tok_s": 2 * ref["static_compiled_tok_s"]["8b"]}},
                 hf_reference=ref)
    row = next(r for r in goal_rows(d) if r.goal.startswith("one stream"))
    assert row.met is True and row.measured == "2.00x" and ref["from"] in row.goal
    older = {k: v for k, v in d.items() if k != "hf_reference"}  # a sitting before the key
    assert next(r for r in goal_rows(older) if r.goal.startswith("one stream")).met is True
    other_card = {**d, "gpu": "NVIDIA H100 80GB HBM3"}  # another card's figures judge nothing
    row = next(r for r in goal_rows(other_card) if r.goal.startswith("one stream"))
    assert (row.met, row.measured) == (None, "-")


def test_the_long_context_goal_reads_the_kernel_the_default_runner_served():
    decode = {"tiles": {"1x1@300_ms": 5.0, "1x1@4096_ms": 7.0},
              "split": {"1x1@300_ms": 6.0, "1x1@4096_ms": 6.5}}
    served_split = _sitting(decode={"8b": decode}, graphs={"8b": {"attention": "split"}})
    row = next(r for r in goal_rows(served_split) if r.goal.startswith("decode at 4,096"))
    assert row.goal.endswith("(split)") and row.met is True
    older = _sitting(decode={"8b": decode})  # before the graphs stage said: the first timed
    row = next(r for r in goal_rows(older) if r.goal.startswith("decode at 4,096"))
    assert row.goal.endswith("(tiles)") and row.met is False


def test_a_mismatch_or_a_differing_output_misses_the_lossless_goal_a_failed_test_its_own():
    clean = {"lossless": {"8b": {"identical": 32, "total": 32}},
             "tests": {"rc": 0, "summary": "110 passed", "passed": 110}}

    def verdicts(**d):
        outputs, tests = goal_rows(_sitting(**{**clean, **d}))[-2:]
        return outputs.met, tests.met

    assert verdicts() == (True, True)
    assert verdicts(mismatches=["8b 64x9: graphed differs"]) == (False, True)
    assert verdicts(lossless={"8b": {"identical": 31, "total": 32}}) == (False, True)
    assert verdicts(fleet={"8b": {"64": {"identical": False}}}) == (False, True)
    assert verdicts(tests={"rc": 1, "summary": "1 failed, 109 passed", "failed": 1}) == \
        (True, False)
    # interrupted at its timeout: what ran passed, but not every test ran
    assert verdicts(tests={"rc": 124, "summary": "80 passed", "passed": 80}) == (True, False)
    assert verdicts(tests={}) == (True, None)  # not run


def test_a_dry_run_has_no_goals_table():
    d = _sitting(forward=[_forward("135m", 1, 1, 150.0)])
    assert "Goals" in format_tables(d)
    assert "Goals" not in format_tables({**d, "dry_run": True})
