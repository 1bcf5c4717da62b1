"""The fleet table warming up, measured: the same prompts served twice, by two devices.

Device A (a fresh Cacheback drafter) serves the prompts while the table is cold; as each session
closes, the in-process store records its output into a fleet table held by a real embedded Redis
(``cache_service.fleet_table.RedisFleetTable``, as the draft cache does). Device B, another fresh
drafter that never saw a prompt, pulls the table (``FleetSync``) and serves the same prompts.
Acceptance on B against A shows what a device gains from the rest of the fleet.
"""

from __future__ import annotations

import time

from edgespec.config import SamplingParams
from edgespec.drafters.cacheback import CachebackDrafter, FleetSync
from edgespec.engine.spec_engine import Request, SpecEngine

from .report import aggregate


def run_fleet_warm(gen, questions: list[dict], encoded: list[list[int]], refs: dict,
                   max_new_tokens: int, log) -> dict:
    """``refs``: question id -> target-only output of the same run. Returns per category the
    cold (device A) and warm (device B) aggregates, and the table's size."""
    from cache_service.fleet_table import RedisFleetTable
    from cache_service.redis_conn import RedisHandle

    handle = RedisHandle(None)  # the embedded Redis
    try:
        fleet = RedisFleetTable(handle.client, prefix="bench:")
        fleet.clear()
        device_a, device_b = CachebackDrafter(), CachebackDrafter()
        cold = _serve(gen, device_a, fleet, questions, encoded, refs, max_new_tokens, log, "A")
        pulled = FleetSync(fleet, device_b.fleet_mirror).pull_now(max_rounds=1 << 12)
        warm = _serve(gen, device_b, None, questions, encoded, refs, max_new_tokens, log, "B")
        size = fleet.size()
    finally:
        handle.close()
    cats = list(dict.fromkeys(q["category"] for q in questions))  # in the questions' order
    out = {c: {"cold": aggregate([r for r in cold if r["category"] == c]),
               "warm": aggregate([r for r in warm if r["category"] == c])} for c in cats}
    out["all"] = {"cold": aggregate(cold), "warm": aggregate(warm)}
    return {"categories": out, "fleet_table_leaders": size, "entries_pulled_by_b": pulled}


def _serve(gen, drafter, fleet, questions, encoded, refs, max_new_tokens, log, device) -> list:
    records = []
    with SpecEngine(gen.runner, drafter, gen.cfg, gen.stop_ids, fleet=fleet) as engine:
        for q, ids in zip(questions, encoded):
            t0 = time.perf_counter()
            res = engine.generate(Request(ids, max_new_tokens, SamplingParams()))
            s = res.stats
            records.append({"category": q["category"], "tokens": len(res.token_ids),
                            "seconds": time.perf_counter() - t0,
                            "decode_seconds": s.elapsed_s - s.prefill_s, "stats": s.to_dict(),
                            "identical_to_target_only": res.token_ids == refs[q["id"]]})
            log(f"fleet warm-up, device {device}: {q['category']:<15} q{q['id']:<4} "
                f"MAL {s.mean_acceptance_length:.2f}")
    return records
