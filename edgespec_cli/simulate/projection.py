"""A fleet on a GPU server, projected: ``edgespec simulate --project-on SITTING.json``.

A projection, not a measurement. It combines two things measured elsewhere:

- the verifier's step cost on a GPU, from a GPU sitting's JSON (``forward``: milliseconds per
  step of S sessions x T tokens a row, graphed, at each model shape): a step of R = S x T rows
  costs the piecewise-linear interpolation, in R, of the sitting's points for the shape (beyond
  the widest point, its last slope);
- each drafter's acceptance and speed, measured here with real drafters on real prompts
  (``--acceptance-from``: ``edgespec bench-edge`` JSON files; or given, ``--acceptance``): the
  share of its draft tokens accepted (alpha), its acceptance by position where the report has
  it (P_m: of the verified drafts that held an m-th token, the share whose first m tokens were
  all accepted; used where MIN_TRIALS drafts reached m, beyond that P_m = P_L x c^(m - L)
  from the last measured L, c the smaller of its last step P_L / P_(L-1) and alpha; without
  them P_m = alpha^m), and
  the tokens per second one board drafts.

For N boards, one session each, every step verifies N rows of 1 + k tokens (k the same for
all, so no row is padded, chosen to maximise throughput, at most ``max_draft``), and a board
supplies at most what it drafts in one step (``tokens_per_s x step time``; the board drafts
while the verifier steps): each session commits 1 + sum over m <= k' of P_m tokens a step,
k' = min(k, supplied). Acceptance by position is measured on drafts whose length the verifier's
planner chose, and is taken to hold at every k.
Server-only decoding (no boards) commits one token a session a step: N rows of 1 token. Both
are given as tokens per second; capacity at an SLO is the most boards (up to ``max_devices``)
whose sessions each keep ``slo`` tokens per second. Host work, prefill, links and queueing are
left out: both sides are the GPU's step alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from edgespec.config import ConfigError

MAX_DRAFT = 16  # the verifier's widest graphed row (1 + 15 drafts)
MIN_TRIALS = 20  # verified drafts that reached a position before its acceptance is used


@dataclass(frozen=True)
class DrafterTrace:
    """A drafter as measured here: its draft tokens' acceptance and one board's speed."""

    name: str
    alpha: float  # accepted / drafted
    tokens_per_s: float | None  # draft tokens one board drafts per second (None: unbounded)
    source: str = ""
    # P_m for m = 1..L: the chance that a draft's first m tokens are all accepted, given it
    # held m (measured; empty: alpha^m)
    prefix_accept: tuple[float, ...] = ()

    def accepted_through(self, m: int) -> float:
        """P_m: the chance that a draft's first m tokens are all accepted."""
        known = self.prefix_accept
        if m <= len(known):
            return known[m - 1]
        if not known:
            return self.alpha ** m
        return known[-1] * self.continuation ** (m - len(known))

    @property
    def continuation(self) -> float:
        """Past the last measured position, the chance that each further token is accepted:
        the smaller of the last measured step P_L / P_(L-1) and alpha (the drafts that reached
        L are the confident ones, so their last step overrates the next: the smaller one errs
        low)."""
        known = self.prefix_accept
        if len(known) >= 2 and known[-2] > 0:
            return min(self.alpha, known[-1] / known[-2])
        return self.alpha


def prefix_acceptance(drafted: list[float], accepted: list[float]) -> tuple[float, ...]:
    """P_m from counts by position (verified drafts that held an m-th token, and that had it
    accepted, which means every token before it too), while MIN_TRIALS drafts reached m; made
    non-increasing (a longer prefix is never likelier)."""
    out: list[float] = []
    for i, d in enumerate(drafted):
        if d < MIN_TRIALS:
            break
        a = accepted[i] if i < len(accepted) else 0.0  # a list cut at its last non-zero
        p = min(1.0, a / d)
        out.append(min(p, out[-1]) if out else p)
    return tuple(out)


def step_costs(sitting: dict, shape: str) -> list[tuple[int, float]]:
    """(rows, ms) of the sitting's graphed steps at ``shape``, by rows."""
    points: dict[int, float] = {}
    rows = sitting.get("forward", []) if isinstance(sitting, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError("the sitting is not a GPU sitting's JSON (an object whose 'forward' "
                          "is a list of step costs)")
    for r in rows:
        if r.get("shape") == shape and r.get("ms"):
            try:
                n, ms = int(r["sessions"]) * int(r["tokens"]), float(r["ms"])
            except (KeyError, TypeError, ValueError) as e:
                raise ConfigError(f"a step cost of the sitting lacks or garbles {e}: {r}") \
                    from None
            if n < 1 or not 0 < ms < math.inf:
                raise ConfigError(f"a step cost of the sitting is not one: {r}")
            points.setdefault(n, ms)
    if len(points) < 2:
        shapes = sorted({r.get("shape") for r in sitting.get("forward", [])} - {None})
        raise ConfigError(f"the sitting has fewer than two step costs at shape {shape!r} "
                          f"(shapes: {', '.join(shapes) or 'none'})")
    return sorted(points.items())


def step_ms(points: list[tuple[int, float]], rows: int) -> float:
    """The step cost of ``rows`` rows, interpolated (and extrapolated) linearly in rows."""
    for (r0, m0), (r1, m1) in zip(points, points[1:]):
        if rows <= r1 or (r1, m1) == points[-1]:
            if rows < r0:  # below the narrowest point: its cost (a step never costs less)
                return m0
            return m0 + (m1 - m0) * (rows - r0) / (r1 - r0)
    return points[-1][1]


def expected_tokens(trace: DrafterTrace, k: float) -> float:
    """A session's committed tokens a step with k draft tokens (fractional k: the last one
    counts in part)."""
    whole = int(k)
    out = 1.0 + sum(trace.accepted_through(m) for m in range(1, whole + 1))
    return out + (k - whole) * trace.accepted_through(whole + 1)


def project(points: list[tuple[int, float]], trace: DrafterTrace, boards: int,
            max_draft: int = MAX_DRAFT) -> dict:
    """Edge drafting with ``boards`` boards against server-only decoding at one step cost."""
    base_ms = step_ms(points, boards)
    best = {"k": 0, "tokens_per_step": 1.0, "step_ms": base_ms}
    for k in range(1, max_draft):
        ms = step_ms(points, boards * (1 + k))
        supplied = k if trace.tokens_per_s is None else min(k, trace.tokens_per_s * ms / 1000)
        tokens = expected_tokens(trace, supplied)
        if tokens / ms > best["tokens_per_step"] / best["step_ms"]:
            best = {"k": k, "tokens_per_step": tokens, "step_ms": ms}
    edge = boards * best["tokens_per_step"] / best["step_ms"] * 1000
    alone = boards / base_ms * 1000
    return {"boards": boards, "draft_tokens": best["k"],
            "tokens_per_session_step": best["tokens_per_step"], "step_ms": best["step_ms"],
            "server_only_step_ms": base_ms, "edge_tokens_per_s": edge,
            "server_only_tokens_per_s": alone, "throughput_ratio": edge / alone}


def capacity(points, trace: DrafterTrace | None, slo: float, max_devices: int) -> int:
    """The most boards (sessions) each keeping ``slo`` tokens/s; ``trace`` None: server-only."""
    best = 0
    for n in range(1, max_devices + 1):
        if trace is None:
            rate = 1000 / step_ms(points, n)
        else:
            p = project(points, trace, n)
            rate = p["edge_tokens_per_s"] / n
        if rate >= slo:
            best = n
    return best


def traces_from_bench_edge(paths: list[str]) -> list[DrafterTrace]:
    """Each bench-edge JSON's drafter: acceptance over every fleet's edge run, and one
    board's drafting speed (tokens it drafted per CPU second it used, the most of its fleets:
    a board alone on its core; a report from before ``tokens_drafted`` was kept gives the
    tokens it sent, tokens sent again included)."""
    out = []
    for path in paths:
        try:
            with open(path) as f:
                report = json.load(f)
            fleets = report["fleets"]
            drafted = sum(f["edge"]["drafted"] for f in fleets)
            accepted = sum(f["edge"]["accepted"] for f in fleets)
            by_pos = {what: _summed([f["edge"].get(f"{what}_per_pos") or [] for f in fleets])
                      for what in ("drafted", "accepted")}
            # tokens drafted (each once); reports from before that counter: tokens sent
            speeds = [b.get("tokens_drafted", b["draft_tokens"]) / b["cpu_s"]
                      for f in fleets for b in f["per_board"] if b.get("cpu_s")]
            name = report["config"]["drafter"]
        except OSError as e:  # not there: not "not a report"
            raise ConfigError(f"--acceptance-from {path}: cannot read it ({e.strerror or e}); "
                              "write one with edgespec bench-edge --json FILE") from None
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"--acceptance-from {path}: not a bench-edge report ({e})") \
                from None
        if not drafted:
            raise ConfigError(f"--acceptance-from {path}: no draft tokens were verified")
        out.append(DrafterTrace(name, accepted / drafted, max(speeds) if speeds else None,
                                source=path,
                                prefix_accept=prefix_acceptance(by_pos["drafted"],
                                                                by_pos["accepted"])))
    return out


def _summed(lists: list[list[float]]) -> list[float]:
    """Counts by position summed over fleets (of any lengths)."""
    out = [0.0] * max((len(x) for x in lists), default=0)
    for x in lists:
        for i, v in enumerate(x):
            out[i] += float(v)
    return out


def parse_acceptance(text: str) -> list[DrafterTrace]:
    """NAME=ALPHA[@TOKENS_PER_S],...: given acceptances (and board speeds)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            name, value = part.split("=", 1)
            alpha_text, _, speed = value.partition("@")
            alpha, tps = float(alpha_text), float(speed) if speed else None
        except ValueError:
            raise ConfigError(f"--acceptance takes NAME=ALPHA[@TOKENS_PER_S], got {part!r}") \
                from None
        if not 0 <= alpha < 1 or (tps is not None and not 0 < tps < math.inf):
            raise ConfigError(f"--acceptance {part!r}: alpha in [0, 1), speed > 0")
        out.append(DrafterTrace(name, alpha, tps, source="given"))
    return out


def build_projection(sitting: dict, shape: str, traces: list[DrafterTrace],
                     boards: list[int], slo: float | None, max_devices: int) -> dict:
    points = step_costs(sitting, shape)
    out: dict = {
        "kind": "projection (not a measurement)", "gpu": sitting.get("gpu"), "shape": shape,
        "dtype": sitting.get("dtype"),
        "step_costs_ms": {str(r): ms for r, ms in points},
        "assumptions": [
            "step cost: piecewise linear in rows (sessions x tokens) through the sitting's "
            "graphed steps, its last slope beyond the widest",
            "acceptance by position P_m measured here (bench-edge's verified drafts by "
            f"position, where {MIN_TRIALS} drafts reached m), beyond that P_L x c^(m - L), "
            "c the smaller of P_L / P_(L-1) and alpha; "
            "without it alpha^m, alpha = accepted / drafted; taken to hold at every draft "
            "length",
            "a board supplies at most its measured drafting speed x the step time a step",
            "one session a board; the draft length the same for all, the best for throughput",
            "host work, prefill, links and queueing left out on both sides"],
        "drafters": []}
    for t in traces:
        rows = [project(points, t, n) for n in boards]
        entry = {"drafter": t.name, "alpha": t.alpha, "board_tokens_per_s": t.tokens_per_s,
                 "prefix_accept": list(t.prefix_accept), "source": t.source, "by_boards": rows}
        if slo:
            entry["capacity"] = {"slo_tokens_per_s": slo,
                                 "edge": capacity(points, t, slo, max_devices),
                                 "server_only": capacity(points, None, slo, max_devices)}
        out["drafters"].append(entry)
    return out


def format_projection(p: dict) -> str:
    lines = [f"PROJECTION (not a measurement) on {p['gpu']} step costs, shape {p['shape']} "
             f"({p['dtype']}): " + ", ".join(f"{r} rows {ms:.2f} ms"
                                             for r, ms in p["step_costs_ms"].items())]
    for d in p["drafters"]:
        speed = "unbounded" if d["board_tokens_per_s"] is None else \
            f"{d['board_tokens_per_s']:.1f} draft tok/s a board"
        by_pos = d.get("prefix_accept") or []
        shape = ("P_m " + " ".join(f"{p:.2f}" for p in by_pos[:8])) if by_pos else \
            "P_m = alpha^m (no acceptance by position measured)"
        lines.append(f"{d['drafter']}: alpha {d['alpha']:.3f}, {speed}; {shape}")
        lines.append(f"  {'boards':>6} {'k':>3} {'step ms':>8} {'edge tok/s':>11} "
                     f"{'alone tok/s':>11} {'ratio':>6}")
        for r in d["by_boards"]:
            lines.append(f"  {r['boards']:>6} {r['draft_tokens']:>3} {r['step_ms']:>8.2f} "
                         f"{r['edge_tokens_per_s']:>11.0f} {r['server_only_tokens_per_s']:>11.0f} "
                         f"{r['throughput_ratio']:>5.2f}x")
        if "capacity" in d:
            c = d["capacity"]
            lines.append(f"  capacity at {c['slo_tokens_per_s']} tok/s a session: edge "
                         f"{c['edge']}, server-only {c['server_only']}")
    lines.append("assumptions: " + "; ".join(p["assumptions"]))
    return "\n".join(lines)
