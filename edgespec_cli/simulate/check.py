"""Losslessness of a simulated fleet: a sample of sessions against target-only decoding.

For every run, one finished request per device (its first), and every finished request a link
fault overlapped (sent before the fault healed, its last token after it began), is decoded
again by target-only
greedy decoding in the served dtype on the verifier's device (float32 on a CPU: transformers' own
``generate``; another dtype or a GPU: edgespec's runner with no drafter, the lossless reference
there), and the two token sequences must be identical.
"""

from __future__ import annotations

import math

from .records import RunRecord


def sample(run: RunRecord) -> list:
    """The first finished request of each device, and every finished request a link fault's
    window overlapped (the faults are where an output could go wrong; a fault not yet healed
    when the run ended lasts to its end), in the order sent."""
    windows = [(run.started + f["at_s"], math.inf if f.get("healed_at_s") is None
                else run.started + f["healed_at_s"]) for f in run.link_faults]
    first: set[str] = set()
    picked = []
    for r in sorted(run.requests, key=lambda r: r.sent_at):
        if r.error is not None or not r.tokens:
            continue
        ended = r.token_times[-1] if r.token_times else run.ended
        faulted = any(r.sent_at < healed and ended > began for began, healed in windows)
        if faulted or r.device_id not in first:
            first.add(r.device_id)
            picked.append(r)
    return picked


def check_lossless(target, runs: list[RunRecord], max_new_tokens: int) -> dict:
    from edgespec.models.loading import stop_token_ids

    from ..bench.methods import HFBaselines

    if target.dtype == "float32" and next(target.model.parameters()).device.type == "cpu":
        reference = HFBaselines(target.model, stop_token_ids(target), 0)
        name = "transformers generate (greedy, target only, float32)"

        def decode(ids: list[int]) -> list[int]:
            return reference.run("hf_generate", ids, max_new_tokens)
    else:
        from edgespec.config import EngineConfig, SamplingParams
        from edgespec.engine.local import LocalGenerator

        gen = LocalGenerator(target, "none", config=EngineConfig(max_sessions=1))
        name = f"edgespec target-only decoding (greedy, {target.dtype})"

        def decode(ids: list[int]) -> list[int]:
            return gen.generate(ids, max_new_tokens, SamplingParams()).token_ids
    cache: dict[tuple[int, ...], list[int]] = {}
    checked = identical = 0
    mismatches = []
    devices_missing = []
    for run in runs:
        picked = sample(run)
        seen = {r.device_id for r in picked}
        devices_missing += [d for d in {r.device_id for r in run.requests} if d not in seen]
        for r in picked:
            key = tuple(r.prompt_ids)
            if key not in cache:
                cache[key] = decode(r.prompt_ids)
            checked += 1
            if cache[key] == r.tokens:
                identical += 1
            else:
                mismatches.append({"batching": run.batching, "devices": run.devices,
                                   "device_id": r.device_id, "session_id": r.session_id})
    return {"checked": checked, "identical": identical, "reference": name,
            "devices_without_a_finished_session": devices_missing,
            "mismatches": mismatches,
            "ok": checked > 0 and identical == checked and not devices_missing}
