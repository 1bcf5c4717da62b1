"""Decode steps launched a step ahead (``edgespec.engine.decode_ahead``), turned on on the CPU:
every output identical to target-only decoding, greedy and keyed sampling, as sessions end at
different steps, are cancelled, join while a step runs ahead, take a freed slot, and when a
launch or a batch's wait fails."""

import pytest
import torch
from conftest import hf_greedy, hf_keyed_sampled

from edgespec.config import EngineConfig, SamplingParams
from edgespec.engine.decode_ahead import FAILED_LAUNCHES_OFF
from edgespec.engine.generation import Admission
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.runner.step_rows import DraftShape, StepRows
from edgespec.runner.target_runner import TargetRunner

PROMPTS = [
    [1, 10, 11, 12, 13, 10, 11, 12, 13, 10],
    [1, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61],
    [1, 30, 31, 30, 31, 30],
    [1, 7, 8],
]
NEW = [24, 9, 17, 30]  # sessions ending at different steps


@pytest.fixture(scope="module")
def runner(tiny):
    return TargetRunner(tiny.model, n_slots=8, max_len=128)


@pytest.fixture(scope="module")
def refs(tiny):
    return [hf_greedy(tiny.model, p, n) for p, n in zip(PROMPTS, NEW)]


def _engine(runner, ahead=True, **kw) -> SpecEngine:
    return SpecEngine(runner, None, EngineConfig(max_sessions=8, decode_ahead=ahead, **kw),
                      stop_ids={2})


def test_the_next_steps_forward_from_device_roots_scores_as_from_host_roots(runner):
    """Rows whose roots are copied in on the device score bit for bit as rows built with them."""
    a, b = runner.cache.allocate(), runner.cache.allocate()
    try:
        runner.prefill(a, [1, 10, 11, 12])
        runner.prefill(b, [1, 50, 51])
        slots, starts = [a, b], [runner.cache.lengths[a], runner.cache.lengths[b]]
        shape = DraftShape.of_chains([(), ()])
        host = runner.score_rows(StepRows.build(slots, starts, [13, 52], shape, runner.device))
        rows = StepRows.build(slots, starts, [0, 0], shape, runner.device)
        dev = runner.score_rows(rows.with_device_roots(torch.tensor([13, 52])))
        assert torch.equal(host.logits, dev.logits)
    finally:
        runner.cache.release(a)
        runner.cache.release(b)


def test_greedy_batch_decoded_ahead_is_target_only(runner, refs):
    with _engine(runner) as engine:
        results = engine.generate_many([Request(p, n) for p, n in zip(PROMPTS, NEW)])
        assert [r.token_ids for r in results] == refs
        assert engine.ahead.claimed > 10  # the steps really ran ahead
        # each step after the first was run ahead and claimed (a session that ended by a stop
        # token left its row unused); the longest session ends by its length, and a session's
        # last step by its length launches no row for it: the last step launched nothing
        longest = max(refs, key=len)
        assert len(longest) == NEW[refs.index(longest)]
        assert engine.ahead.launched == engine.ahead.claimed == len(longest) - 1
        assert engine.ahead.pending is None and engine.ahead.dropped == 0


def test_keyed_sampling_decoded_ahead_is_target_only(tiny, runner):
    params = [SamplingParams(temperature=0.9, top_k=20, seed=5),
              SamplingParams(temperature=1.0, top_p=0.8, seed=11),
              SamplingParams(),  # a greedy row among sampled ones
              SamplingParams(temperature=0.7, seed=3)]
    want = [hf_keyed_sampled(tiny.model, p, n, sp) if not sp.greedy else
            hf_greedy(tiny.model, p, n)
            for p, n, sp in zip(PROMPTS, NEW, params)]
    with _engine(runner) as engine:
        got = engine.generate_many([Request(p, n, sp) for p, n, sp in zip(PROMPTS, NEW, params)])
        assert engine.ahead.claimed > 10
    for g, w in zip(got, want):  # a sampled session stops at its own stop token, if drawn
        assert g.token_ids == w[:len(g.token_ids)]
        assert len(g.token_ids) == len(w) or g.token_ids[-1] == 2


def test_sessions_joining_ending_and_cancelled_while_steps_run_ahead(tiny, runner, refs):
    """A session admitted while a step ran ahead waits a step and joins; a cancelled one's
    slot taken by a new session; every output still target-only's."""
    late = [1, 40, 41, 42, 43]
    late_ref = hf_greedy(tiny.model, late, 12)
    with _engine(runner) as engine:
        acts = engine.add_many([Admission(Request(p, n)) for p, n in zip(PROMPTS, NEW)])
        for _ in range(3):
            engine.step()
        assert engine.ahead.pending is not None
        cancelled = acts[2].sid
        assert engine.cancel(cancelled)
        [joined] = engine.add_many([Admission(Request(late, 12))])  # takes the freed slot
        assert joined.slot == acts[2].slot
        claimed = engine.ahead.claimed
        report = engine.step()  # the sessions run ahead; the new one waits
        assert engine.ahead.claimed == claimed + 1
        assert report is not None and report.sessions == 3
        assert engine.ahead.pending is None  # not run ahead: the next step holds everyone
        while engine.active:
            engine.step()
    for i, act in enumerate(acts):
        if i != 2:
            assert act.output == refs[i]
    assert acts[2].finish == "cancelled" and acts[2].output == refs[2][:len(acts[2].output)]
    assert joined.output == late_ref


def test_a_launch_that_raises_costs_the_overlap_only(runner, refs, monkeypatch, caplog):
    score = runner.score_rows

    def refusing(rows, tap=None):
        if rows.device_roots is not None:
            raise RuntimeError("no forward ahead today")
        return score(rows, tap)

    monkeypatch.setattr(runner, "score_rows", refusing)
    with _engine(runner) as engine:
        results = engine.generate_many([Request(p, n) for p, n in zip(PROMPTS, NEW)])
        assert [r.token_ids for r in results] == refs
        assert engine.ahead.launched == engine.ahead.claimed == 0
        assert not engine.ahead.enabled  # off after FAILED_LAUNCHES_OFF in a row
    assert "launching a decode step ahead failed" in caplog.text
    assert caplog.text.count("launching a decode step ahead failed") == FAILED_LAUNCHES_OFF
    assert "decode-ahead is off" in caplog.text


def test_a_session_id_used_again_is_another_session(tiny, runner):
    """A session cancelled after a step launched its next row, then an id used again (a
    resumed session's) in the same slot at the same length: the new session does not take the
    old one's row; its output is target-only's."""
    first, again = [1, 10, 11, 12, 13], [1, 60, 61, 62, 63, 64, 65, 66]
    with _engine(runner) as engine:
        old = engine.add(Request(first, 20), session_id="x")
        for _ in range(3):
            engine.step()
        assert engine.ahead.pending is not None and len(first) + len(old.output) == len(again)
        assert engine.cancel("x")
        new = engine.add(Request(again, 6), session_id="x")
        assert new.slot == old.slot
        while engine.active:
            engine.step()
        assert new.output == hf_greedy(tiny.model, again, 6)
        assert engine.ahead.dropped >= 1


def test_verdicts_kept_while_the_store_is_down_commit_first_and_the_steps_run_on(runner,
                                                                                 refs):
    """The store unreachable at three commits (one landed, its reply lost): the step raises,
    the next commits the kept verdicts first, the forward run ahead is claimed after them."""
    from edgespec.protocol.contract import StoreUnavailable

    with _engine(runner) as engine:
        acts = engine.add_many([Admission(Request(p, n)) for p, n in zip(PROMPTS, NEW)])
        real, calls = engine.store.commit_many, [0]

        def flaky(verdicts):
            calls[0] += 1
            if calls[0] in (4, 5, 9):
                if calls[0] == 5:
                    real(verdicts)  # landed; the reply lost
                raise StoreUnavailable("the store is down")
            return real(verdicts)

        engine.store.commit_many = flaky
        raised = 0
        while engine.active:
            try:
                engine.step()
            except StoreUnavailable:
                raised += 1
        assert raised == 3 and engine.ahead.claimed > 10
    assert [a.output for a in acts] == refs


@pytest.mark.parametrize("sessions", [len(PROMPTS), 1])
def test_a_failed_wait_retries_each_session_alone_from_its_own_forward(runner, refs,
                                                                        monkeypatch, caplog,
                                                                        sessions):
    """The batch's wait raising after the next step was launched: the launch is dropped, each
    session verified alone by a forward of its own (none failed, a batch of one included; the
    failure logged and counted), and the outputs are target-only's."""
    import edgespec.engine.spec_engine as spec_engine

    real, calls = spec_engine.HostCopy, {"n": 0}

    class FailingOnce(real):
        def wait(self):
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("the device went away for a moment")
            return super().wait()

    monkeypatch.setattr(spec_engine, "HostCopy", FailingOnce)
    failures = []
    with _engine(runner) as engine:
        step = engine.step

        def counting_step():
            report = step()
            failures.append(engine.forwards_failed)
            return report

        engine.step = counting_step
        results = engine.generate_many([Request(p, n) for p, n in
                                        zip(PROMPTS[:sessions], NEW[:sessions])])
        assert [r.token_ids for r in results] == refs[:sessions]
        assert engine.ahead.dropped >= 1 and engine.ahead.claimed > 3
    assert calls["n"] > 5
    assert failures.count(1) == 1 and sum(failures) == 1  # the batch's forward, one step's
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == \
        [f"the verification of {sessions} session(s) failed; each is verified by a forward "
         "of its own (not said again until a batch's forward runs)"]


def test_a_streak_of_failing_batches_is_said_once_and_counted_each_time(runner, refs, caplog):
    """A fault that fails each batch's forward and no session's own (a batch too large for the
    device, say): every session decoded by forwards of its own, as target-only; the warning
    said once for the streak, every failure counted (``forwards_failed``)."""
    with _engine(runner, ahead=False) as engine:
        forward, failed = engine._forward_and_verify, []

        def failing_batches(drafts):
            if len(drafts) > 1:
                raise RuntimeError("out of memory at this batch size")
            return forward(drafts)

        engine._forward_and_verify = failing_batches
        step = engine.step
        engine.step = lambda: (step(), failed.append(engine.forwards_failed))[0]
        results = engine.generate_many([Request(p, n) for p, n in zip(PROMPTS, NEW)])
    assert [r.token_ids for r in results] == refs
    assert sum(failed) > 3 and set(failed) == {0, 1}  # a batch a step, while two run
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "not said again" in warned[0].getMessage()


def test_off_by_default_on_a_cpu_and_never_with_drafts(runner, refs):
    with SpecEngine(runner, None, EngineConfig(max_sessions=8), stop_ids={2}) as engine:
        assert not engine.ahead.enabled
        assert engine.generate(Request(PROMPTS[0], NEW[0])).token_ids == refs[0]
        assert engine.ahead.launched == 0
    from edgespec.drafters import build_drafter

    with SpecEngine(runner, build_drafter("mag", None, None),
                    EngineConfig(max_sessions=8, decode_ahead=True), stop_ids={2}) as engine:
        assert engine.generate(Request(PROMPTS[0], NEW[0])).token_ids == refs[0]
        assert engine.ahead.launched == 0  # its next step may verify drafts


def test_a_resting_batch_runs_ahead_and_drafts_again_when_its_window_comes(runner, refs,
                                                                           monkeypatch):
    """MaG in process, its drafting measured slower (the regimes set here: 6 steps resting, a
    window of 3 drafting, resting after; the guess of the next step's regime wrong at the
    window): the resting steps run ahead, the window drafts, every output target-only's."""
    from edgespec.drafters import build_drafter
    from edgespec.engine.drafting_worth import DRAFT, REST

    regimes, at = [REST] * 6 + [DRAFT] * 3 + [REST] * 200, [0]

    def choose(rows, plain_rate):
        at[0] += 1
        return regimes[at[0] - 1]

    with SpecEngine(runner, build_drafter("mag"),
                    EngineConfig(max_sessions=8, decode_ahead=True), stop_ids={2}) as engine:
        assert engine.worth is not None
        monkeypatch.setattr(engine.worth, "choose", choose)
        monkeypatch.setattr(engine.worth, "next_regime", lambda rows: REST)  # a wrong guess once
        results = engine.generate_many([Request(p, n) for p, n in zip(PROMPTS, NEW)])
        assert [r.token_ids for r in results] == refs
        assert sum(r.stats.draft_tokens for r in results) > 0  # the window drafted
        assert engine.ahead.claimed > 10


def test_a_claim_takes_the_rows_still_where_the_launch_put_them(runner):
    """The next step's rows: a session one position on, in its slot, takes its row; one that
    moved otherwise waits; a step verifying a draft drops the forward run ahead."""
    from types import SimpleNamespace

    from edgespec.engine.decode_ahead import DecodeAhead

    ahead = DecodeAhead(runner, True)
    slots = [runner.cache.allocate(), runner.cache.allocate()]
    try:
        for slot, prompt in zip(slots, ([1, 10, 11, 12], [1, 50, 51])):
            runner.prefill(slot, prompt)
        class Act:  # a session: hashed by identity, as ActiveSession is
            def __init__(self, i: int, slot: int):
                self.sid, self.slot, self.output = f"s{i}", slot, []
                self.req = SimpleNamespace(max_new_tokens=8, params=SamplingParams())

        acts = [Act(i, s) for i, s in enumerate(slots)]
        kv = [runner.cache.lengths[s] for s in slots]
        drafts = [SimpleNamespace(act=a, start=k + 1, width=1) for a, k in zip(acts, kv)]

        def launch():  # from the step whose roots sit at ``kv`` (not yet committed)
            for s, k in zip(slots, kv):
                runner.cache.commit(s, k)
            ahead.launch(drafts, torch.tensor([13, 52]))

        def next_step(widths=(1, 1), moved=()):
            for s, k in zip(slots, kv):
                runner.cache.commit(s, k + 1)  # what the step's commit leaves
            return [SimpleNamespace(act=d.act, start=d.start + 1 + (i in moved), width=w)
                    for i, (d, w) in enumerate(zip(drafts, widths))]

        launch()
        claim = ahead.claim(next_step())
        assert claim is not None and claim.index == [0, 1] and not claim.waiting
        assert ahead.pending is None and (ahead.launched, ahead.claimed) == (1, 1)
        launch()
        claim = ahead.claim(next_step(moved={0}))
        assert claim is not None and claim.index == [1] and len(claim.waiting) == 1
        launch()
        assert ahead.claim(next_step(widths=(1, 3))) is None and ahead.dropped == 1
    finally:
        for s in slots:
            runner.cache.release(s)


def test_a_server_streams_a_burst_run_ahead_identical_to_target_only(tiny, refs):
    """The scheduler's loop (sessions admitted between steps, streamed as they go) over an
    engine whose steps run ahead, its sessions in the Redis draft cache (embedded), as a server
    without boards serves them."""
    from cache_service.redis_conn import RedisHandle
    from cache_service.store import RedisSessionStore
    from verifier_node.scheduler import Scheduler
    from verifier_node.tickets import Ticket

    handle = RedisHandle()
    store = RedisSessionStore(handle.client, ttl_s=60)
    runner = TargetRunner(tiny.model, n_slots=4, max_len=128)
    engine = SpecEngine(runner, None, EngineConfig(max_sessions=4, decode_ahead=True),
                        stop_ids={2}, store=store)
    sched = Scheduler(engine, max_queue=8)
    try:
        tickets = [sched.submit(Ticket(Request(p, n), None)) for p, n in zip(PROMPTS, NEW)]
        sched.start()
        for t in tickets:
            with t.cond:
                assert t.cond.wait_for(lambda t=t: t.result is not None or t.error is not None,
                                       120)
        sched.stop()
        assert not sched.is_alive()
        assert [t.error for t in tickets] == [None] * len(PROMPTS)
        assert [t.result.token_ids for t in tickets] == refs
        assert engine.ahead.claimed > 10
    finally:
        sched.stop()
        engine.close()
        store.shutdown()
        handle.close()
