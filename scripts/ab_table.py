"""What the in-process A/B scripts (``cpu_attention_ab.py``, ``row_spans_ab.py``) share: the
order of the two sides in a round (alternating, so that a slow spell of the machine does not fall
on one side alone), and the table of each case's best time a side and their ratio."""

from __future__ import annotations

SIDES = ("before", "after")


def sides_in_round(r: int) -> tuple[str, str]:
    """Round ``r``'s order of the two sides: before first in even rounds, after first in odd."""
    return SIDES if r % 2 == 0 else (SIDES[1], SIDES[0])


def best_table(runs: list[dict], width: int = 28) -> list[dict]:
    """Each case's best time a side ({"case", "before", "after", "speedup"}; the runs' "s" in
    seconds), in the runs' order of cases, printed as a table whose case column is ``width``
    wide."""
    print(f"{'case':<{width}} {'before ms':>10} {'after ms':>10} {'ratio':>6}")
    table = []
    for case in dict.fromkeys(x["case"] for x in runs):
        best = {side: min(x["s"] for x in runs if x["case"] == case and x["side"] == side)
                for side in SIDES}
        table.append({"case": case, **best, "speedup": best["before"] / best["after"]})
        print(f"{case:<{width}} {1e3 * best['before']:>10.1f} {1e3 * best['after']:>10.1f} "
              f"{best['before'] / best['after']:>5.2f}x")
    return table
