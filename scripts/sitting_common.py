"""What the GPU sitting's stages share (``gpu_sitting``): the device synced and its memory
freed, medians timed between CUDA events or replayed from a CUDA graph, the kernels of one call
profiled, a runner built, and rows of chains to step with it (a row's bits alone and in the
batch compared)."""

from __future__ import annotations

import statistics
import time

import torch

from edgespec.runner.step_rows import DraftShape, StepRows
from edgespec.runner.target_runner import TargetRunner

CONTEXT = 300  # the cached keys of each session in the stages' steps
LONG_CONTEXT = 4096  # decode's keys where one program a head walking them all shows


def say(msg: str) -> None:
    print(msg, flush=True)


def free_device_memory(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def runner_for(s, model, n_slots: int, max_len: int, graphs: bool,
               attention_kernel: str | None = None) -> TargetRunner:
    return TargetRunner(model, n_slots=n_slots, max_len=max_len, kernels="triton",
                        graphs=graphs, attention_kernel=attention_kernel)


def alone_equal(runner: TargetRunner, rows: StepRows, T: int) -> bool:
    """Whether slot 0's row has the same bits stepped alone as in ``rows``."""
    together = runner.score_rows(rows).logits[0].clone()
    return torch.equal(runner.score_rows(chain_rows(runner, 1, T)).logits[0], together)


def chain_rows(runner: TargetRunner, B: int, T: int) -> StepRows:
    drafts = [([(11 * b + t) % runner.vocab_size for t in range(1, T)],
               list(range(-1, T - 2))) for b in range(B)]
    return StepRows.build(list(range(B)), [runner.cache.lengths[b] for b in range(B)],
                          [(5 + b) % runner.vocab_size for b in range(B)], DraftShape.of(drafts),
                          runner.device)


def event_median_ms(fn, device: str, repeat: int) -> float:
    """Median milliseconds of fn() over ``repeat`` runs: CUDA events on a GPU."""
    fn()
    sync(device)
    times = []
    for _ in range(repeat):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def graphed_median_ms(fn, device: str, repeat: int, calls: int = 10) -> float:
    """Median milliseconds of one fn() replayed from a CUDA graph of ``calls`` calls (so the
    kernels are timed, not their launches), over ``repeat`` replays; on a CPU, or where fn
    cannot be captured (said), ``event_median_ms``."""
    if device != "cuda":
        return event_median_ms(fn, device, repeat)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and allocate outside the capture
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as exc:  # a call that cannot be captured: timed between events
        print(f"   (not capturable, timed between events: {type(exc).__name__}: {exc})")
        return event_median_ms(fn, device, repeat)
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def profile_kernels(fn, device: str) -> dict:
    """Kernels launched and GPU-busy microseconds of one fn() (torch's profiler)."""
    if device != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    kernels, busy = 0, 0.0
    by_name: dict[str, list] = {}
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and "Memcpy" not in e.name \
                and "Memset" not in e.name:
            us = float(getattr(e, "device_time", 0.0) or getattr(e, "cuda_time", 0.0))
            kernels += 1
            busy += us
            entry = by_name.setdefault(e.name[:80], [0, 0.0])
            entry[0] += 1
            entry[1] += us
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:8]
    return {"kernels": kernels, "busy_us": round(busy, 1),
            "top": [{"kernel": k, "calls": c, "us": round(t, 1)} for k, (c, t) in top]}
