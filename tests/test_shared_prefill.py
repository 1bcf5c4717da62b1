"""Identical prompts waiting together share one prefill (``engine.prefill_queue``): the first is
prefilled, the others take its keys and values by a copy of its slot's positions
(``TargetRunner.copy_prompt``) once its prompt is in. The copies hold the bits a prefill of
their own would write; every output stays target-only decoding's; a first prompt that fails or
is cancelled, or a copy that fails, costs the others only their share: they are prefilled."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy
from test_burst_admission import RecordingWriter

from edgespec.config import EngineConfig, SamplingParams
from edgespec.drafters.adaptive import DraftLength
from edgespec.engine.generation import ActiveSession
from edgespec.engine.prefill_queue import PrefillQueue
from edgespec.engine.spec_engine import Admission, Request, SpecEngine
from edgespec.runner.target_runner import TargetRunner


class CopyingWriter(RecordingWriter):
    """A recording writer that can also copy a slot's prompt (and can be told to fail)."""

    def __init__(self, fail_slots: set[int] = frozenset(), fail_copies: set[int] = frozenset()):
        super().__init__()
        self.copies: list[tuple[int, int, int]] = []  # (src, dst, length)
        self.fail_slots, self.fail_copies = set(fail_slots), set(fail_copies)

    def prefill_parts(self, slots, parts, reads=None) -> None:
        if self.fail_slots & set(slots):
            raise RuntimeError("a device error")
        super().prefill_parts(slots, parts, reads)

    def copy_prompt(self, src, dst, length) -> None:
        if dst in self.fail_copies:
            raise RuntimeError("a copy error")
        assert self.lengths.get(src) == length  # the first's prompt is all in
        self.copies.append((src, dst, length))
        self.lengths[dst] = length


def _add(queue, slot: int, tokens: list[int], reader=None) -> ActiveSession:
    act = ActiveSession(f"s{slot}", Request(tokens + [9], 4), slot, DraftLength(4))
    queue.add(act, tokens, reader)
    return act


def test_identical_prompts_are_prefilled_once_and_copied_when_the_first_is_in():
    writer = CopyingWriter()
    queue = PrefillQueue(writer, chunk=4)
    same, other = [1, 5, 6, 7, 8, 9], [1, 5, 6, 7, 8, 4]
    a, b, c, d = (_add(queue, 0, same), _add(queue, 1, other), _add(queue, 2, same),
                  _add(queue, 3, same))
    assert queue.tokens_left == 12  # a's and b's: c and d copy a's, no prefill of theirs
    assert queue.shared_keys() == {tuple(same), tuple(other)}
    step = queue.advance(8)  # a's and b's first parts
    assert writer.calls == [[(0, 4), (1, 4)]] and step.ready == [] and writer.copies == []
    step = queue.advance(8)  # their ends: a's in, so c and d take it
    assert writer.calls[1:] == [[(0, 2), (1, 2)]]
    assert writer.copies == [(0, 2, 6), (0, 3, 6)]
    assert step.ready == [a, c, d, b] and step.tokens == 4 and step.copied == 12
    assert queue.tokens_left == 0 and len(queue) == 0
    assert writer.lengths == {0: 6, 1: 6, 2: 6, 3: 6}


def test_a_cancelled_first_prompt_leaves_its_copies_to_the_next_of_them():
    writer = CopyingWriter()
    queue = PrefillQueue(writer, chunk=4)
    prompt = [1, 2, 3, 4, 5]
    a, b, c = _add(queue, 0, prompt), _add(queue, 1, prompt), _add(queue, 2, prompt)
    queue.advance(4)
    assert queue.tokens_left == 1  # a's last token: b and c copy it
    assert queue.remove(a)
    # b is prefilled in a's place, from what a had in (copied from a's slot, still held)
    assert writer.copies == [(0, 1, 4)] and queue.tokens_left == 1
    step = queue.advance(None)  # b's last token, then c copies b's
    assert writer.calls[1:] == [[(1, 1)]] and writer.copies[1:] == [(1, 2, 5)]
    assert step.ready == [b, c] and queue.tokens_left == 0


def test_a_cancelled_first_with_nothing_in_or_a_failed_hand_over_leaves_a_prefill_from_0():
    writer = CopyingWriter(fail_copies={1})
    queue = PrefillQueue(writer, chunk=4)
    prompt = [1, 2, 3, 4, 5]
    a, b, c = _add(queue, 0, prompt), _add(queue, 1, prompt), _add(queue, 2, prompt)
    queue.advance(4)
    assert queue.remove(a)  # b's copy of a's part fails: b is prefilled from the start
    assert writer.copies == [] and queue.tokens_left == 5
    d, e = _add(queue, 3, [7, 8]), _add(queue, 4, [7, 8])
    assert queue.remove(d)  # nothing of d's in: e is prefilled, nothing copied
    step = queue.advance(None)
    assert writer.copies == [(1, 2, 5)] and set(step.ready) == {b, c, e}
    assert writer.lengths[1] == 5 and writer.lengths[4] == 2


def test_a_prompt_added_later_copies_whichever_of_its_kind_is_prefilled_now():
    """After the first is cancelled, a newcomer copies the prompt prefilled in its place;
    once that one is in, a newcomer copies a running session's slot; once every session of
    the prompt ended, a newcomer is prefilled itself."""
    writer = CopyingWriter()
    queue = PrefillQueue(writer, chunk=4)
    prompt = [1, 2, 3, 4, 5]
    a, b, c = _add(queue, 0, prompt), _add(queue, 1, prompt), _add(queue, 2, prompt)
    queue.remove(b)  # a copy cancelled: a still leads c
    queue.remove(a)  # the first cancelled: c is prefilled in its place
    d = _add(queue, 3, prompt)
    step = queue.advance(None)
    assert writer.calls == [[(2, 4)], [(2, 1)]] and writer.copies == [(2, 3, 5)]
    assert step.ready == [c, d]
    # c and d run on: a newcomer of the same prompt is copied from c's slot, no prefill
    e = _add(queue, 4, prompt)
    calls = len(writer.calls)
    assert queue.advance(None).ready == [e] and writer.copies[-1] == (2, 4, 5)
    assert len(writer.calls) == calls
    assert queue.shared_keys() == {tuple(prompt)}  # running: a newcomer copies its slot
    # every session of that prompt ended (their slots may hold other sessions now): prefilled
    for act in (c, d, e):
        act.finish = "stop"
    assert queue.shared_keys() == set()
    f = _add(queue, 5, prompt)
    assert queue.advance(None).ready == [f] and writer.calls[-1] == [(5, 1)]
    assert len(writer.copies) == 2 and queue.tokens_left == 0


def test_a_failed_first_prefill_fails_alone_and_the_next_copy_is_prefilled():
    writer = CopyingWriter(fail_slots={0})
    queue = PrefillQueue(writer, chunk=8)
    prompt = [1, 2, 3]
    a, b, c = _add(queue, 0, prompt), _add(queue, 1, prompt), _add(queue, 2, prompt)
    step = queue.advance(None)
    assert [f[0] for f in step.failed] == [a]
    step2 = queue.advance(None) if queue.waiting else step
    ready = step.ready + (step2.ready if step2 is not step else [])
    assert ready == [b, c] and writer.copies == [(1, 2, 3)]
    assert writer.lengths[1] == writer.lengths[2] == 3 and queue.tokens_left == 0


def test_a_failed_copy_is_prefilled_and_the_others_still_copy():
    writer = CopyingWriter(fail_copies={1})
    queue = PrefillQueue(writer, chunk=8)
    prompt = [1, 2, 3]
    a, b, c = _add(queue, 0, prompt), _add(queue, 1, prompt), _add(queue, 2, prompt)
    step = queue.advance(None)  # a in, c copies it, b's copy fails: b prefilled next pass
    assert step.ready == [a, c, b] and writer.copies == [(0, 2, 3)]
    assert writer.calls == [[(0, 3)], [(1, 3)]] and step.copied == 3
    assert writer.lengths == {0: 3, 1: 3, 2: 3} and queue.tokens_left == 0


class _Reader:
    chunk = 4

    def reads(self, start: int) -> bool:
        return True

    def read(self, start: int, logits) -> None:
        pass


def test_a_prompt_whose_logits_are_read_is_prefilled_itself_and_shares_none():
    writer = CopyingWriter()
    queue = PrefillQueue(writer, chunk=8)
    prompt = [1, 2, 3]
    _add(queue, 0, prompt, _Reader())
    _add(queue, 1, prompt)
    _add(queue, 2, prompt, _Reader())
    queue.advance(None)
    assert writer.copies == [] and sorted(s for call in writer.calls for s, _ in call) == [0, 1, 2]


def test_a_writer_that_cannot_copy_prefills_every_prompt():
    writer = RecordingWriter()
    queue = PrefillQueue(writer, chunk=8)
    for slot in range(3):
        _add(queue, slot, [1, 2, 3])
    step = queue.advance(None)
    assert writer.calls == [[(0, 3), (1, 3), (2, 3)]] and step.copied == 0


def _copies_hold_own_prefill_bits(runner: TargetRunner) -> None:
    """The same prompt prefilled in a slot of its own (with another prompt beside it) and
    copied from a slot that prefilled it: every layer's keys and values, bit for bit."""
    prompt = [1] + [3 + (7 * i) % 50 for i in range(70)]
    other = [1] + [4 + (5 * i) % 40 for i in range(33)]
    queue = PrefillQueue(runner, chunk=32)
    acts = []
    for tokens in (prompt, prompt, other):
        slot = runner.new_slot()
        acts.append(ActiveSession(f"s{slot}", Request(tokens + [9], 4), slot, DraftLength(4)))
        queue.add(acts[-1], tokens)
    while queue.waiting:
        assert queue.advance(40).tokens <= 40 + 32
    assert acts[1] not in [w.act for w in queue.waiting]
    alone = runner.new_slot()  # the prompt's own prefill, in a forward with no other prompt
    runner.prefill(alone, prompt, chunk=32)
    n = len(prompt)
    assert runner.cache.lengths[acts[1].slot] == n
    for cache in runner.cache.k + runner.cache.v:
        assert torch.equal(cache[acts[1].slot, :, :n], cache[alone, :, :n])
        assert torch.equal(cache[acts[0].slot, :, :n], cache[alone, :, :n])


def test_a_copied_prompt_holds_the_bits_its_own_prefill_writes(tiny):
    _copies_hold_own_prefill_bits(TargetRunner(tiny.model, n_slots=4, max_len=96))


def test_a_prompt_handed_a_cancelled_first_s_part_holds_its_own_prefill_s_bits(tiny):
    """The first of three identical prompts cancelled after its first part: the next goes on
    from the part it is handed, the third copies that one's; both hold, bit for bit, what the
    prompt's own prefill writes."""
    runner = TargetRunner(tiny.model, n_slots=5, max_len=96)
    prompt = [1] + [3 + (7 * i) % 50 for i in range(70)]
    queue = PrefillQueue(runner, chunk=32)
    acts = []
    for _ in range(3):
        slot = runner.new_slot()
        acts.append(ActiveSession(f"s{slot}", Request(prompt + [9], 4), slot, DraftLength(4)))
        queue.add(acts[-1], prompt)
    assert queue.advance(32).tokens == 32
    assert queue.remove(acts[0])
    runner.free_slot(acts[0].slot)
    assert queue.tokens_left == len(prompt) - 32  # the rest of it, once
    while queue.waiting:
        queue.advance(32)
    alone = runner.new_slot()
    runner.prefill(alone, prompt, chunk=32)
    n = len(prompt)
    for act in acts[1:]:
        assert runner.cache.lengths[act.slot] == n
        for cache in runner.cache.k + runner.cache.v:
            assert torch.equal(cache[act.slot, :, :n], cache[alone, :, :n])


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device here: scripts/gpu_sitting.sh runs it on a GPU machine")
def test_on_cuda_a_copied_prompt_holds_the_bits_its_own_prefill_writes():
    """The same on a GPU, the runner as it serves there (fused kernels, graphs), bfloat16."""
    from edgespec.models.shapes import random_model

    model = random_model("135m", "cuda", "bfloat16", layers=4)
    _copies_hold_own_prefill_bits(TargetRunner(model, n_slots=4, max_len=256))


@pytest.mark.parametrize("draft", ["none", "mag"])
def test_n_choices_of_one_prompt_decode_as_target_only(tiny, draft):
    """The choices of one prompt, admitted together (as the HTTP endpoint's ``n`` does): one
    prefill, and each choice's output what target-only decoding gives it: greedy ones the
    model's greedy continuation, sampled ones (a seed each) what an engine that prefills each
    prompt itself samples."""
    from edgespec.drafters import build_drafter

    prompt = [1] + [3 + (11 * i) % 53 for i in range(45)]
    params = [SamplingParams()] * 2 + [SamplingParams(temperature=0.8, seed=s) for s in (3, 4)]

    def run(share: bool) -> tuple[list[list[int]], int]:
        runner = TargetRunner(tiny.model, n_slots=6, max_len=128)
        if not share:
            runner.copy_prompt = None  # a writer that cannot copy: each prompt prefilled
        drafter = build_drafter(draft) if draft != "none" else None
        cfg = EngineConfig(max_sessions=6, max_context=128, prefill_budget=64)
        with SpecEngine(runner, drafter, cfg, stop_ids={2}) as engine:
            prefilled = []
            advance = engine.prefilling.advance
            engine.prefilling.advance = lambda b: (lambda p: prefilled.append(p.tokens) or p)(
                advance(b))
            got = engine.add_many([Admission(Request(list(prompt), 20, p)) for p in params])
            assert not any(isinstance(g, Exception) for g in got)
            while engine.sessions:
                engine.step()
            return [g.output for g in got], sum(prefilled)

    shared, shared_tokens = run(True)
    own, own_tokens = run(False)
    assert shared_tokens == len(prompt) - 1 and own_tokens == 4 * (len(prompt) - 1)
    assert shared == own
    assert shared[0] == shared[1] == hf_greedy(tiny.model, prompt, 20)


def test_a_failed_copy_from_a_running_session_is_prefilled():
    writer = CopyingWriter(fail_copies={1})
    queue = PrefillQueue(writer, chunk=8)
    prompt = [1, 2, 3]
    a = _add(queue, 0, prompt)
    assert queue.advance(None).ready == [a]
    b = _add(queue, 1, prompt)  # a runs: b is to copy its slot, and that copy fails
    assert queue.advance(None).ready == [b] and writer.copies == []
    assert writer.calls[-1] == [(1, 3)] and queue.tokens_left == 0


def test_a_choice_a_step_later_copies_the_running_sessions_prompt(tiny):
    """A second choice of a prompt reaching the engine after the first's prompt is in (as an
    HTTP request's choices can, a step apart) copies the running session's slot: one prefill,
    and both outputs what each gets with prefills of its own, the greedy one the model's."""
    from edgespec.drafters import build_drafter

    prompt = [1] + [4 + (13 * i) % 51 for i in range(40)]

    def run(share: bool) -> tuple[list[int], list[int], int, int]:
        runner = TargetRunner(tiny.model, n_slots=4, max_len=128)
        if not share:
            runner.copy_prompt = None
        cfg = EngineConfig(max_sessions=4, max_context=128, prefill_budget=64)
        with SpecEngine(runner, build_drafter("mag"), cfg, stop_ids={2}) as engine:
            seen = []
            advance = engine.prefilling.advance
            engine.prefilling.advance = lambda b: (lambda p: seen.append(p) or p)(advance(b))
            [a] = engine.admit([Admission(Request(list(prompt), 20))])
            engine.step()
            engine.step()
            assert a in engine.active and a.output
            [b] = engine.admit([Admission(Request(list(prompt), 20,
                                                  SamplingParams(temperature=0.8, seed=5)))])
            while engine.sessions:
                engine.step()
            return (a.output, b.output, sum(p.tokens for p in seen),
                    sum(p.copied for p in seen))

    a_shared, b_shared, prefilled, copied = run(True)
    a_own, b_own, own_prefilled, own_copied = run(False)
    assert (prefilled, copied) == (len(prompt) - 1, len(prompt) - 1)
    assert (own_prefilled, own_copied) == (2 * (len(prompt) - 1), 0)
    assert (a_shared, b_shared) == (a_own, b_own)
    assert a_shared == hf_greedy(tiny.model, prompt, 20)


def test_the_pace_counts_a_prompt_the_queue_copies_once(tiny):
    """Admission pacing (``pace.prompts_ahead``) counts the prefill a deadline waits for
    as the queue does it: a prompt identical to one waiting, running or pending once, a prompt
    whose logits are read (it is prefilled itself) and another prompt in full."""
    from verifier_node.pace import prompts_ahead
    from verifier_node.scheduler import Scheduler
    from verifier_node.tickets import Ticket

    runner = TargetRunner(tiny.model, n_slots=6, max_len=160)
    prompt, other = [1, 5, 6, 7] * 10, [3, 4] * 8
    with SpecEngine(runner, None, EngineConfig(max_sessions=6, max_context=160), set()) as engine:
        sched = Scheduler(engine, max_queue=8)  # not started: submitted tickets stay pending
        for _ in range(3):  # a request's three choices
            sched.submit(Ticket(Request(list(prompt), 4), None))
        pending = [t.request for t in sched._pending]

        def ahead(request: Request) -> int:
            return prompts_ahead(engine, pending, request)

        assert ahead(Request(list(prompt), 4)) == 40  # one prefill of four
        assert ahead(Request(list(prompt), 4, prompt_logprobs=1)) == 80
        assert ahead(Request(list(other), 4)) == 40 + 16
        engine.admit([Admission(Request(list(prompt), 4)) for _ in range(2)])
        # the queue prefills the first's 39 (its last token is the first step's): the pending
        # three and a fourth copy it
        assert engine.prefilling.tokens_left == 39
        assert ahead(Request(list(prompt), 4)) == 39
        engine.step()  # prefilled and running: a newcomer copies a running session's slot
        assert engine.prefilling.tokens_left == 0
        assert ahead(Request(list(prompt), 4)) == 0
