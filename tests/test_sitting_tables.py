"""The GPU sitting's report (``scripts/sitting_tables.py``): the attention and GEMM stages'
figures reach ``sitting.md`` as the stages wrote them (the stages themselves run on the GPU
machine, and on a CPU under ``--dry-run``: minutes, not in this suite)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from sitting_tables import format_tables  # noqa: E402


def _sitting(**stages) -> dict:
    return {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.5", "dtype": "bfloat16",
            "command": "scripts/gpu_sitting.sh --out x", "mismatches": [], **stages}


def _rows(md: str, first: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()
            if line.startswith(f"| {first} |")]


def test_the_attention_table_has_each_kernel_s_time_ratio_warps_their_bits_and_probe():
    attention = {"8b": {"layout": "32 q heads, 8 kv heads, head size 128",
                        "probe": {"tiles": "invariant", "rows": "invariant",
                                  "split": "invariant"},
                        "sizes": [{"context": 4096, "sessions": 1, "tokens": 1, "tiles_ms": 0.2,
                                   "rows_ms": 0.9, "split_ms": 0.05,
                                   "vs_first": {"rows": 4.5, "split": 0.25},
                                   "max_abs_diff": 0.0039,
                                   "tiles_ms_by_warps": {"1": 0.3, "2": 0.25, "4": 0.2,
                                                         "8": 0.22},
                                   "tiles_bits_by_warps": {"1": False, "2": True, "4": True,
                                                           "8": False}}]}}
    md = format_tables(_sitting(attention=attention))
    assert ("| shape | keys | sessions x tokens | tiles attention ms | rows attention ms | "
            "split attention ms | rows / tiles | split / tiles |") in md
    [row] = _rows(md, "8b")
    assert row[:8] == ["8b", "4096", "1 x 1", "0.2", "0.9", "0.05", "4.5", "0.25"]
    assert row[9] == "-"  # whether chunks gave split's bits: not in this sitting
    assert row[10] == "0.3 / 0.25 / 0.2 / 0.22"
    assert row[11] == "False / True / True / False"
    assert row[12] == "tiles: invariant, rows: invariant, split: invariant"


def test_the_decode_table_has_each_attention_kernel_at_each_context():
    decode = {"8b": {"tiles": {"1x1@300_ms": 6.1, "1x1@4096_ms": 9.9, "64x9_ms": 20.0,
                               "graphs_failed": None},
                     "split": {"1x1@300_ms": 6.0, "1x1@4096_ms": 6.4, "64x9_ms": 19.0,
                               "graphs_failed": None}}}
    md = format_tables(_sitting(decode=decode))
    assert "| shape | attention | 1x1@300 ms | 1x1@4096 ms | 64x9 ms | graphs failed |" in md
    assert _rows(md, "8b")[1][:5] == ["8b", "split", "6.0", "6.4", "19.0"]


def test_a_kernel_its_start_probe_refused_is_a_row_saying_why():
    decode = {"8b": {"tiles": {"1x1@300_ms": 6.1, "graphs_failed": None},
                     "split-decode": {"refused": "the fused attention is not batch-invariant "
                                                 "here (split-decode: query 0 differs)"}}}
    md = format_tables(_sitting(decode=decode))
    assert "| graphs failed | refused at start |" in md
    tiles, refused = _rows(md, "8b")
    assert tiles[:3] == ["8b", "tiles", "6.1"] and tiles[-1] == "-"
    assert refused[:3] == ["8b", "split-decode", "-"]
    assert refused[-1].startswith("the fused attention is not batch-invariant")


def test_the_exactness_table_gives_the_runner_over_cublas_and_sdpa():
    exactness = {"8b": {"1x1": {"plain_ms": 5.0, "runner_ms": 6.0, "cost_of_exactness": 0.2},
                        "64x9": {"plain_ms": 12.0}}}
    md = format_tables(_sitting(exactness=exactness))
    assert "| shape | step | cuBLAS + SDPA ms (graphed) | runner ms | cost of exactness |" in md
    assert _rows(md, "8b") == [["8b", "1x1", "5.0", "6.0", "20%"], ["8b", "64x9", "12.0", "-", "-"]]


def test_an_older_sittings_attention_rows_still_render():
    attention = {"8b": {"layout": "", "probe": {"tiles": "invariant", "rows": "invariant"},
                        "sizes": [{"sessions": 64, "tokens": 9, "tiles_ms": 0.61,
                                   "rows_ms": 24.4, "ratio": 40.0, "max_abs_diff": 0.0039}]}}
    [row] = _rows(format_tables(_sitting(attention=attention)), "8b")
    assert row[:6] == ["8b", "300", "64 x 9", "0.61", "24.4", "40.0"]


def test_the_gemm_table_has_the_products_per_step_for_the_tiles_and_each_configuration():
    gemm = {"135m": {"step_ms": {"1": {"tiles": 0.5, "64x128x64/w4s4": 0.6},
                                 "576": {"tiles": 2.0, "64x128x64/w4s4": 1.1}},
                     "invariant": {"64x128x64/w4s4": False}, "linears": []}}
    md = format_tables(_sitting(gemm=gemm, mismatches=["135m qkv: other bits alone"]))
    assert "| shape | rows | tiles ms | 64x128x64/w4s4 ms |" in md
    rows = _rows(md, "135m")
    assert rows[0] == ["135m", "1", "0.5", "0.6"]
    assert rows[1] == ["135m", "576", "2.0", "1.1"]
    assert rows[2] == ["135m", "row alone = in batch", "-", "False"]
    assert "**Mismatches:** 135m qkv: other bits alone" in md


def test_a_sitting_without_the_new_stages_still_renders():
    md = format_tables(_sitting(tests={"rc": 0, "summary": "60 passed"}))
    assert "attention ms" not in md and "tiles ms" not in md
    assert "CUDA tests: 60 passed (rc 0)" in md


def test_the_fleet_table_has_target_only_batched_and_the_steps_time_split():
    """A fleet row with the target-only batched run and the MaG run's step split; a row of an
    older sitting (no target-only, no split) and one without one-a-forward print with dashes."""
    split = {"steps": 20, "ms_a_step": {"prefill": 0.5, "plan_take_propose": 1.2,
                                        "forward_verify": 9.1, "place_commit": 0.8,
                                        "rest": 0.1}}
    fleet = {"8b": {"32": {"sessions": 32, "tokens": 1024, "batched_s": 0.41,
                           "target_only_batched_s": 0.62, "mag_over_target_only": 1.51,
                           "target_only_decode_tokens_per_s": 1800.0,
                           "target_only_no_ahead_decode_tokens_per_s": 1500.0,
                           "target_only_decode_vs_step": 0.71,
                           "one_a_forward_s": 3.3, "throughput_ratio": 8.05, "mag": split,
                           "target_only": split, "identical": True},
                    "64": {"sessions": 64, "tokens": 2048, "batched_s": 0.8,
                           "target_only_batched_s": 1.1, "mag_over_target_only": 1.38,
                           "mag": split, "target_only": split, "identical": True}},
             "135m": {"16": {"sessions": 16, "batched_s": 0.3, "one_a_forward_s": 0.5,
                             "throughput_ratio": 1.6, "identical": True}}}
    md = format_tables(_sitting(fleet=fleet))
    rows = _rows(md, "8b")
    assert rows[0] == ["8b", "32", "0.41", "3.3", "8.05", "0.62", "1800.0", "1500.0", "0.71",
                       "1.51", "0.5 / 1.2 / 9.1 / 0.8 / 0.1", "True"]
    assert rows[1][3:5] == ["-", "-"] and rows[1][6:10] == ["-", "-", "-", "1.38"]
    [old] = _rows(md, "135m")
    assert old[:5] == ["135m", "16", "0.3", "0.5", "1.6"]
    assert old[5:11] == ["-", "-", "-", "-", "-", "- / - / - / - / -"]
