"""The GPU issues' goals, each read from a sitting's results and judged (``goal_rows``): issue
43's wide verification step, decode at 300 and 4,096 keys, the 64 x 1 step, the cost of
exactness, one stream against transformers' compiled ``generate``, and every output identical;
issue 42's fleet on the GPU (32 sessions batched against one a forward, 64 sessions' target-only
decoding against the graphed 64 x 1 step). ``sitting_tables`` renders them as the report's first
table, so a sitting says at once which goals it met, which it missed and which it did not
measure (a stage skipped or cut by the deadline: "not measured", never a verdict).

Transformers' compiled ``generate`` takes a minute of compiling a shape, so a sitting usually
skips it (``--skip hf``); the one-stream goal then reads the figures of the last sitting that ran
it, ``hf-reference.json`` beside the sittings, where that sitting's GPU is this one's, and says
so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

HF_REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "measured" / "gpu" / \
    "hf-reference.json"

WIDE_8B_MS = 15.0  # 64 x 9 at 8b
WIDE_OVER_64X1 = 1.6  # 64 x 9 at 135m and 1.7b, against their 64 x 1
DECODE_300_MS = {"135m": 1.2, "1.7b": 2.0, "8b": 4.5}  # 1 x 1 at 300 keys
LONG_OVER_SHORT = 1.3  # 1 x 1 at 4,096 keys against 300
DECODE_64_8B_MS = 5.0  # 64 x 1 at 8b
EXACTNESS_COST = 0.15  # the runner's step over the same model's cuBLAS + SDPA step
ONE_STREAM_OVER_HF = 1.5  # target-only tok/s over transformers' compiled static-cache generate
BATCHED_OVER_ONE = 8.0  # 32 sessions batched against one session a forward
DECODE_OF_STEP = 0.8  # 64 sessions' target-only decoding, of 64 / (the 64 x 1 step)


@dataclass(frozen=True)
class GoalRow:
    """One goal at one shape: what was measured ("-" where nothing was) and whether it met the
    goal (None: not measured here)."""

    issue: int
    goal: str
    shape: str
    measured: str
    met: bool | None


def hf_reference() -> dict:
    """The compiled ``generate`` figures of the last sitting that ran them, by shape, with
    where they come from (``{}`` where the file is absent)."""
    return json.loads(HF_REFERENCE.read_text()) if HF_REFERENCE.exists() else {}


def _step_ms(d: dict, shape: str, sessions: int, tokens: int) -> float | None:
    for r in d.get("forward", []):
        if (r.get("shape"), r.get("sessions"), r.get("tokens")) == (shape, sessions, tokens):
            return r.get("ms")
    return None


def _row(issue: int, goal: str, shape: str, value: float | None, limit: float,
         shown: str = "{:.2f}", at_least: bool = False) -> GoalRow:
    if value is None:
        return GoalRow(issue, goal, shape, "-", None)
    met = value >= limit if at_least else value <= limit
    return GoalRow(issue, goal, shape, shown.format(value), met)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _default_kernel(d: dict, shape: str) -> str | None:
    """The attention kernel the default runner served (the ``graphs`` stage records it; before
    it did, the first the ``decode`` stage timed, which is the default's)."""
    kernel = d.get("graphs", {}).get(shape, {}).get("attention")
    return kernel if kernel is not None else next(iter(d.get("decode", {}).get(shape, {})), None)


def _one_stream(d: dict, shape: str) -> GoalRow:
    goal = f"one stream >= {ONE_STREAM_OVER_HF}x transformers' compiled generate"
    hf = d.get("hf", {}).get(shape, {}).get("static_compiled_tok_s")
    if hf is None:  # skipped: the last sitting that compiled it, on the same kind of GPU only
        ref = d.get("hf_reference") or hf_reference()
        if ref.get("gpu") == d.get("gpu"):
            hf = ref.get("static_compiled_tok_s", {}).get(shape)
        if hf is not None:
            goal += f" ({ref.get('from', 'an earlier sitting')}'s)"
    ours = d.get("e2e", {}).get(shape, {}).get("target_only_tok_s")
    return _row(43, goal, shape, _ratio(ours, hf), ONE_STREAM_OVER_HF, "{:.2f}x", at_least=True)


def _shape_goals(d: dict, shape: str) -> list[GoalRow]:
    rows = []
    wide, narrow = _step_ms(d, shape, 64, 9), _step_ms(d, shape, 64, 1)
    if shape == "8b":
        rows.append(_row(43, f"64 x 9 <= {WIDE_8B_MS:g} ms", shape, wide, WIDE_8B_MS,
                         "{:.2f} ms"))
        rows.append(_row(43, f"64 x 1 <= {DECODE_64_8B_MS:g} ms", shape, narrow,
                         DECODE_64_8B_MS, "{:.2f} ms"))
    else:
        rows.append(_row(43, f"64 x 9 <= {WIDE_OVER_64X1}x its 64 x 1", shape,
                         _ratio(wide, narrow), WIDE_OVER_64X1, "{:.2f}x"))
    if shape in DECODE_300_MS:
        rows.append(_row(43, f"decode 1 x 1 at 300 keys <= {DECODE_300_MS[shape]:g} ms", shape,
                         _step_ms(d, shape, 1, 1), DECODE_300_MS[shape], "{:.2f} ms"))
    kernel = _default_kernel(d, shape)
    times = d.get("decode", {}).get(shape, {}).get(kernel, {}) if kernel else {}
    rows.append(_row(43, f"decode at 4,096 keys <= {LONG_OVER_SHORT}x at 300 ({kernel or '-'})",
                     shape, _ratio(times.get("1x1@4096_ms"), times.get("1x1@300_ms")),
                     LONG_OVER_SHORT, "{:.2f}x"))
    for size in ("1x1", "64x9"):
        cost = d.get("exactness", {}).get(shape, {}).get(size, {}).get("cost_of_exactness")
        rows.append(_row(43, f"the cost of exactness at {size} <= {EXACTNESS_COST:.0%}", shape,
                         cost, EXACTNESS_COST, "{:+.0%}"))
    rows.append(_one_stream(d, shape))
    fleet = d.get("fleet", {}).get(shape, {})
    rows.append(_row(42, f"32 sessions batched >= {BATCHED_OVER_ONE:g}x one a forward", shape,
                     fleet.get("32", {}).get("throughput_ratio"), BATCHED_OVER_ONE, "{:.1f}x",
                     at_least=True))
    rows.append(_row(42, f"64 sessions' target-only decoding >= {DECODE_OF_STEP} of 64 / the "
                         "64 x 1 step", shape,
                     fleet.get("64", {}).get("target_only_decode_vs_step"), DECODE_OF_STEP,
                     at_least=True))
    return rows


def _lossless(d: dict) -> list[GoalRow]:
    """Every output identical (the mismatches the stages recorded; the lossless, one-stream and
    fleet comparisons) and every CUDA test passing (their exit code: one interrupted at its
    timeout did not pass)."""
    seen = [v.get("identical") == v.get("total") for v in d.get("lossless", {}).values()]
    seen += [v.get("identical") for v in d.get("e2e", {}).values() if "identical" in v]
    seen += [v.get("identical") for per in d.get("fleet", {}).values() for v in per.values()
             if "identical" in v]
    mismatches = len(d.get("mismatches", []))  # a differing comparison is one of them too
    outputs = GoalRow(43, "every output identical, no mismatch recorded", "all",
                      f"{seen.count(False)} of {len(seen)} comparisons differ, {mismatches} "
                      f"mismatch(es) recorded" if seen or mismatches else "-",
                      (mismatches == 0 and False not in seen) if seen or mismatches else None)
    tests = d.get("tests") or {}
    passing = GoalRow(43, "every CUDA test passing", "all", tests.get("summary") or "-",
                      (tests.get("rc") == 0) if tests else None)
    return [outputs, passing]


def goal_rows(d: dict) -> list[GoalRow]:
    """Every goal at every shape the sitting ran, then the identical outputs and the tests."""
    shapes = list(dict.fromkeys(r["shape"] for r in d.get("forward", [])))
    for part in ("decode", "exactness", "e2e", "fleet"):
        shapes += [s for s in d.get(part, {}) if s not in shapes]
    return [row for shape in shapes for row in _shape_goals(d, shape)] + _lossless(d)
