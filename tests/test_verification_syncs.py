"""The engine's steps and the host: a verification step of 8 sessions (chains or trees, greedy
or sampled) waits for the device at most once, for its verdicts' one transfer; decode steps run
a step ahead read their verdicts once and launch the next without waiting; on CUDA, every step
under torch's sync debug mode set to raise (graphed verification, prompts prefilled beside the
running sessions, a tree's paths moved into place, steps run ahead). The verdicts themselves:
tests/test_verification.py."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import hf_greedy
from tree_oracle import OracleTreeDrafter

from edgespec.config import EngineConfig, SamplingParams
from edgespec.drafters import build_drafter
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.runner.host_transfers import HostCopy
from edgespec.runner.target_runner import TargetRunner


class _SyncCounter:
    """Counts, on the calling thread, the tensor methods that wait for the device (``numpy``
    is not one: it refuses a device tensor, and on a CPU tensor waits for nothing) and the
    verification's pinned readback (``host_transfers.HostCopy.wait``, the wait a step makes,
    ``to_host``'s and a decode step's run ahead)."""

    NAMES = ("tolist", "item", "cpu", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        self.count, self.thread = 0, threading.get_ident()
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))
        monkeypatch.setattr(HostCopy, "wait", self._counted(HostCopy.wait))

    def _counted(self, orig):
        def wrapped(*a, **k):
            if threading.get_ident() == self.thread:
                self.count += 1
            return orig(*a, **k)

        return wrapped


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=4)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("trees", [False, True], ids=["chains", "trees"])
def test_a_step_of_8_sessions_syncs_with_the_host_at_most_once(tiny, monkeypatch, params, trees):
    hf = tiny.model
    prompts = [[1] + [10 + (i * 7 + j) % 60 for j in range(6 + i)] for i in range(8)]
    runner = TargetRunner(hf, n_slots=8, max_len=128)
    if trees:
        refs = {tuple(p): hf_greedy(hf, p, 12) for p in prompts}
        drafter = OracleTreeDrafter(refs, runner.vocab_size, seed=1)
    else:
        drafter = build_drafter("mag")
    cfg = EngineConfig(adaptive=False, draft_wait_ms=5000, tree_width=3 if trees else 1,
                       max_draft=4)
    with SpecEngine(runner, drafter, cfg, stop_ids={2}) as engine:
        for p in prompts:
            engine.add(Request(p, 12, params))
        counter = _SyncCounter(monkeypatch)
        steps = 0
        while engine.active:
            before = counter.count
            report = engine.step()
            steps += 1
            synced = counter.count - before
            # exactly the verdicts' one transfer (the counter sees it: it can fail)
            assert synced == (1 if report else 0), f"step {steps} synced {synced}x"
            if steps == 1:
                assert report.sessions == 8
    assert steps > 1


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=4)],
                         ids=["greedy", "sampled"])
def test_a_decode_step_run_ahead_syncs_with_the_host_once(tiny, monkeypatch, params):
    """A target-only server's steps launched a step ahead (``decode_ahead``, on here on the
    CPU): each reads its verdicts once, the launch of the next waits for nothing."""
    prompts = [[1] + [10 + (i * 7 + j) % 60 for j in range(6 + i)] for i in range(8)]
    runner = TargetRunner(tiny.model, n_slots=8, max_len=128)
    with SpecEngine(runner, None, EngineConfig(decode_ahead=True), stop_ids={2}) as engine:
        for p in prompts:
            engine.add(Request(p, 12, params))
        counter = _SyncCounter(monkeypatch)
        while engine.active:
            before = counter.count
            report = engine.step()
            assert counter.count - before == (1 if report else 0)
        assert engine.ahead.claimed > 5


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device here: the GPU sitting runs it")
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=4),
                                    SamplingParams(temperature=0.8, top_k=20, top_p=0.9,
                                                   seed=4)],
                         ids=["greedy", "sampled", "top-k-top-p"])
@pytest.mark.parametrize("trees", [False, True], ids=["chains", "trees"])
def test_cuda_engine_steps_wait_for_the_device_only_for_their_verdicts(tiny, monkeypatch, params,
                                                                        trees):
    """On CUDA every engine step (graphed verification, a prompt prefilled beside the running
    sessions, a tree's accepted paths moved into place) runs under torch's sync debug mode set
    to raise: no pageable copy, ``.item()`` or other implicit wait, so the host plans the next
    step while the device works; the verdicts' pinned readback is the one wait. A refused wait
    inside a step fails its sessions (the engine catches a forward's error), so every session
    must end by its length or a stop token."""
    import copy

    from edgespec.engine.generation import Admission
    from edgespec.runner.host_transfers import implicit_syncs_refused

    model = copy.deepcopy(tiny.model).to("cuda", torch.bfloat16)
    prompts = [[1] + [10 + (i * 7 + j) % 60 for j in range(6 + 9 * i)] for i in range(8)]
    runner = TargetRunner(model, n_slots=8, max_len=192)
    assert runner.graphs is not None
    if trees:  # drafts from this runner's own greedy outputs: paths off the spine accepted
        with SpecEngine(runner, None, EngineConfig()) as alone:
            outs = alone.generate_many([Request(p, 12, SamplingParams()) for p in prompts])
        refs = {tuple(p): r.token_ids for p, r in zip(prompts, outs)}
        drafter = OracleTreeDrafter(refs, runner.vocab_size, seed=1)
    else:
        drafter = build_drafter("mag")
    moves = []
    move_many = runner.cache.move_many
    monkeypatch.setattr(runner.cache, "move_many", lambda *a: (moves.append(a), move_many(*a)))
    cfg = EngineConfig(adaptive=False, draft_wait_ms=5000, tree_width=3 if trees else 1,
                       max_draft=4, prefill_budget=16)
    with SpecEngine(runner, drafter, cfg, stop_ids={2}) as engine:
        sessions = [engine.add(Request(p, 12, params)) for p in prompts[:5]]
        steps = 0
        while engine.sessions:
            if steps == 2:  # prefilled in the steps that follow, 16 tokens a step
                sessions += engine.admit([Admission(Request(p, 12, params))
                                          for p in prompts[5:]])
            with implicit_syncs_refused(runner.device):
                engine.step()
            # a refused wait in a batch's path would be retried a session at a time: none
            assert engine.forwards_failed == 0, steps
            steps += 1
    assert [s.finish in ("length", "stop") for s in sessions] == [True] * 8
    assert runner.graphs.replays > 0
    # greedy trees drafted from the runner's own outputs: a path off the spine was moved
    assert not (trees and params.greedy) or moves


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device here: the GPU sitting runs it")
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20,
                                                                     top_p=0.9, seed=4)],
                         ids=["greedy", "top-k-top-p"])
@pytest.mark.parametrize("graphs", [None, False], ids=["graphed", "eager"])
def test_cuda_decode_steps_run_ahead_wait_only_for_their_verdicts(tiny, params, graphs):
    """On CUDA a target-only server launches each decode step before reading the last one's
    verdicts (``decode_ahead``, its default there): every step under torch's sync debug mode
    set to raise (the launch, its roots copied on the device, the claim: no implicit wait),
    prompts admitted while steps run ahead, the outputs those of the same steps launched one at
    a time."""
    import copy

    from edgespec.engine.generation import Admission
    from edgespec.runner.host_transfers import implicit_syncs_refused

    model = copy.deepcopy(tiny.model).to("cuda", torch.bfloat16)
    prompts = [[1] + [10 + (i * 7 + j) % 60 for j in range(6 + 9 * i)] for i in range(8)]
    outs = {}
    for ahead in (False, None):
        runner = TargetRunner(model, n_slots=8, max_len=192, graphs=graphs)
        cfg = EngineConfig(prefill_budget=16, decode_ahead=ahead)
        with SpecEngine(runner, None, cfg, stop_ids={2}) as engine:
            assert engine.ahead.enabled == (ahead is None)
            sessions = [engine.add(Request(p, 12, params)) for p in prompts[:5]]
            steps = 0
            while engine.sessions:
                if steps == 2:
                    sessions += engine.admit([Admission(Request(p, 12, params))
                                              for p in prompts[5:]])
                with implicit_syncs_refused(runner.device):
                    engine.step()
                assert engine.forwards_failed == 0, steps  # none retried a session at a time
                steps += 1
            assert (engine.ahead.claimed > 0) == (ahead is None)
        assert [s.finish in ("length", "stop") for s in sessions] == [True] * 8
        assert (runner.graphs is not None and runner.graphs.replays > 0) == (graphs is None)
        outs[ahead] = [s.output for s in sessions]
    assert outs[None] == outs[False]
