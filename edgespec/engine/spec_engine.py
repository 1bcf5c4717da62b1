"""The in-process engine: a drafter and a batching verifier over the session protocol.

A model drafter's thread (``DraftWorker``) drafts ahead into each session's draft, up to the
window W, in chunks of c tokens, and applies fixes by rollback; a cheap drafter (MaG, Cacheback)
drafts in the verifier's thread as each step takes its drafts (``InlineDrafts``), unless
``draft_inline`` is off. The verifier (``SpecEngine.step``) waits a short deadline for drafts,
verifies every active session in one forward pass, commits, and publishes fixes. A session
whose draft is empty is decoded one token by the verifier alone, so drafting can only cost the
verification width, never correctness.

Token trees: a draft may carry branches (``tree_width`` > 1, or a remote drafter's tree
chunks), each session a share of the batch's token budget left after the chains (at most
``tree_nodes``); a batch with branches is one tree forward, verified, as chains are, by one call
on the device (``verify_step``), a tree's accepted path then compacted into place.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from ..config import EngineConfig, verifies_trees
from ..drafters import Drafter
from ..drafters.adaptive import Prober
from ..drafters.draft_rates import DraftRates, RowsOf
from ..heads.proposer import HeadProposer, VerifierHead
from ..pad.verify_rule import PadVerifier
from ..protocol.contract import Proposer, SessionStore
from ..models.vision import VisionModel
from ..protocol.fleet_table import FleetTable
from ..protocol.local_store import LocalSessionStore
from ..runner.target_runner import PREFILL_CHUNK, TargetRunner
from ..runner.host_transfers import HostCopy
from ..verify.verify_step import VerifyOutcome, decode_choices, decode_outcome, verify_step
from .decode_ahead import Claim, DecodeAhead
from .draft_planner import ForwardCost
from .draft_worker import DraftWorker
from .drafting_worth import REST, DraftingWorth
from .fill_drafts import FillDrafts, fill_drafter, resolve_fill
from .inline_drafts import InlineDrafts
from .prefill_queue import PrefillQueue
from .generation import ActiveSession, Admission, Request, Result, SessionFailed
from .lateness import Lateness
from .decisions import Decision
from .proposals import DrafterProposer, StepDraft
from .scoring import ScoredStep, row_decisions, score_step, with_logprobs
from .step_commit import report_of
from .step_drafts import StepDrafts
from .step_report import StepReport

__all__ = ["ActiveSession", "Admission", "Request", "Result", "SessionFailed", "SpecEngine",
           "StepReport"]

log = logging.getLogger("edgespec.engine.spec_engine")

IMITATION = "imitation:"  # EngineConfig.head "imitation:DIR": imitation drafting


class SpecEngine(StepDrafts):
    """The verifier. With a ``drafter`` it drafts in process over a ``LocalSessionStore`` (a
    ``DraftWorker`` thread, or ``InlineDrafts`` for a cheap drafter); with a ``store`` (the
    distributed draft cache) drafts come from remote drafters through it."""

    def __init__(self, target: TargetRunner, drafter: Drafter | None = None,
                 config: EngineConfig | None = None, stop_ids: set[int] | None = None,
                 store: SessionStore | None = None, fleet: FleetTable | None = None,
                 head: VerifierHead | None = None, vision: VisionModel | None = None):
        """``vision``: a vision-language target's VLM (``edgespec.models.vision``), which turns
        a request's images into its prompt's embeddings at prefill; None: a text-only target,
        which refuses images."""
        if store is not None and drafter is not None:
            raise ValueError("give a local drafter or an external store, not both")
        self.target, self.vision, self.drafter = target, vision, drafter
        self.cfg = config or EngineConfig()
        if head is None and self.cfg.head.startswith(IMITATION):
            from ..heads.imitation import load_imitation
            from ..heads.imitation_proposer import ImitationProposer

            spec = self.cfg.head.removeprefix(IMITATION)
            head = ImitationProposer(load_imitation(spec, target), target, source=spec)
        elif head is None and self.cfg.head:
            from ..heads.manifest import load_head

            head = HeadProposer(load_head(self.cfg.head, target), source=self.cfg.head,
                                learn=self.cfg.learn)
        # a draft head drafting from the verification forward's features, or the target
        # drafting for itself through an imitation network
        self.head = head
        self.pad: PadVerifier | None = (  # PAD's classifier (--verify pad:DIR)
            PadVerifier.load(self.cfg.pad, target) if self.cfg.verify == "pad" else None)
        self.proposers: list[Proposer] = [DrafterProposer()]  # the sources of each step's drafts
        if head is not None:
            self.proposers.append(head)
        self.stop_ids = set(stop_ids or ())
        # fleet: a Cacheback fleet table the local store teaches each finished session's output
        self.worker: DraftWorker | None = None
        self.inline: InlineDrafts | None = None  # a cheap drafter drafting in the step's thread
        self.store: SessionStore  # mypy checks that both stores are one
        if store is None:
            local = LocalSessionStore(fleet, target.vocab_size)  # the drafter drafts only here
            if drafter and drafter.cheap and self.cfg.draft_inline:
                self.inline = InlineDrafts(drafter, local, self.cfg)
            elif drafter:
                self.worker = DraftWorker(drafter, local, self.cfg)
            self.store = local
        else:
            self.store = store
        if self.worker:
            self.worker.start()
        # the verifier's own drafts for the boards' empty ones (EngineConfig refuses "mag" with
        # a head or --auto; a head handed in here drafts for every row), branch tokens: none
        # where the step verifies none (tree_nodes 0); "auto" fills where boards draft: an
        # engine handed a store (a server's) with no drafter of its own
        spec = resolve_fill(self.cfg.fill_drafts, store is not None and self.drafter is None,
                            head is not None or self.cfg.auto)
        fill = fill_drafter(spec) if head is None and self.cfg.tree_nodes else None
        self.fill: FillDrafts | None = FillDrafts(fill, self.cfg.tree_nodes) \
            if fill is not None else None
        self._asks: list[int] = []  # each taken draft's ask (``_take``), in their order
        self._ids = itertools.count()
        wait_ms = self.cfg.draft_wait_ms
        self.wait_ms: float = wait_ms if wait_ms is not None else \
            drafter.wait_ms if drafter else self.store.wait_ms
        self.active: list[ActiveSession] = []
        # admitted sessions whose prompts are being prefilled, a budget a step (prefill_queue)
        self.prefilling = PrefillQueue(target, min(PREFILL_CHUNK, self.cfg.prefill_budget))
        self.on_prefill: Callable[[int, float], None] | None = None  # (tokens, seconds)
        self.prefill_s = 0.0  # the last step's prefill: not verification time (the pace's)
        self._unwaited_prefill = []  # prefills queued on CUDA, read after the next wait
        self.cost = ForwardCost()  # the measured cost of the verification forward
        self.prober = Prober()  # a step planned without drafts verifies some now and then
        # every session's draft-length state, row r the session in KV slot r (draft_rates)
        self.rates = DraftRates(len(target.cache.lengths), self.cfg.max_draft,
                                adaptive=self.cfg.adaptive)
        self.lateness = Lateness(self.cfg.late_after)  # drafters not waited for (lateness.py)
        # a batch whose drafting measures slower than resting rests (drafting_worth); a head's
        # drafts cost no board and no wait: the planner and --auto's chooser weigh them
        self.worth = DraftingWorth() if self.cfg.adaptive and self.cfg.rest_drafters and \
            head is None else None
        self._regime: str | None = None
        # this step's planned sessions, and their draft-length rows once read (``_rows_of``)
        self._step_acts: list[ActiveSession] = []
        self._step_rows: RowsOf | None = None
        self._undelivered: list[Decision] = []
        self._undelivered_s = (0.0, 0.0)  # their step's take and forward seconds
        self._decide_s = 0.0  # a step's deciding, inside its verification: not the forward's
        # this step's verification forwards that ran, and its forwards (prefill included) that
        # raised: a step with a failure and no verification that ran is ``faulted``
        self._forwards_ok = self._forwards_failed = 0
        self._batch_failing = False  # the last batch forward raised (its warning said once)
        # the head's moves of this step's verified batches, made once their paths are placed
        self._head_pending: list[tuple[list[str], Any, list[int], list[list[int]]]] = []
        # decode steps launched a step ahead (``decode_ahead``): on CUDA, apart from the host
        ahead = self.cfg.decode_ahead
        self.ahead = DecodeAhead(target, target.device.type == "cuda" if ahead is None else ahead)
        self._claim: Claim | None = None  # this step's share of the forward run ahead

    @property
    def faulted(self) -> bool:
        """Whether the last step had a forward raise and no verification forward run: its
        sessions failed one by one, as a device fault fails them all (a prefill that ran does
        not clear it). The scheduler's health counts such steps as failing steps."""
        return self._forwards_failed > 0 and self._forwards_ok == 0

    @property
    def forwards_failed(self) -> int:
        """The last step's forwards that raised: the batch's (its sessions then verified one
        by one), a session's alone, a prefill's (``edgespec:forward_failures_total``)."""
        return self._forwards_failed

    @property
    def free_slots(self) -> int:
        """Sessions the target's KV cache can take now."""
        return self.target.cache.free_slots

    def close(self) -> None:
        self.ahead.drop()
        if self.worker:
            self.worker.stop()
        if self.inline:
            self.inline.close()
        if self.fill:
            self.fill.close()
        if self.head is not None:
            self.head.close()

    def __enter__(self) -> "SpecEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one verification step over every active session -----------------------------------------
    def step(self) -> StepReport | None:
        """Prefill a budget of the waiting prompts, then take drafts, verify every running
        session in one forward, commit: plan -> take -> propose -> verify -> decide -> commit.
        If the store cannot be reached, this raises with the engine unchanged, or with the
        step's verdicts kept aside: the next call commits those first (the store recognises a
        commit that landed). Returns what the step did (None when nothing was verified)."""
        self.prefill_s = 0.0
        self._step_acts, self._step_rows = [], None
        self._forwards_ok = self._forwards_failed = 0
        if self._undelivered:  # verdicts of a step whose commit did not reach the store
            kept, t0 = self._undelivered, time.perf_counter()
            return report_of(self._commit(kept, *self._undelivered_s), len(kept),
                             sum(d.draft.width for d in kept), 0.0, 0.0, time.perf_counter() - t0)
        self._advance_prefill(self.cfg.prefill_budget)  # chunked prefill: a budget a step
        # on CUDA a prefill's kernels (this step's, or an admission's since the last step) run
        # while the host plans (no wait: host_transfers), so the verification's wait holds
        # what is left of them: such a step's forward time is not the verification's cost
        async_prefill = bool(self._unwaited_prefill)
        if not self.active:  # every session still waits for its prompt
            self.ahead.drop()  # its sessions ended meanwhile
            self.prefill_s += self._settle_prefill()  # nothing to overlap: waited for
            return None
        t0 = time.perf_counter()
        self._head_pending = []  # a step that raised before placing left its moves behind
        taken = self._take(self._plan())
        drafts = self._propose(taken)
        # the forward run ahead for these rows (a session it does not hold waits a step)
        claim = self._claim = self.ahead.claim(drafts) if self.ahead.pending else None
        if claim is not None:
            drafts = claim.covered
        launched = self.ahead.launched
        if not drafts:
            self.prefill_s += self._settle_prefill()
            return None
        t1 = time.perf_counter()
        self._decide_s = 0.0
        judged = self._verify(drafts)
        t2 = time.perf_counter() - self._decide_s  # the forward and verification alone
        self.prefill_s += self._settle_prefill()  # waited for with the verdicts
        widths = [d.width for d in drafts]
        width = sum(widths)
        # a claimed forward ran during the last step; a launching step's holds the next one's
        # launch
        if not async_prefill and claim is None and self.ahead.launched == launched:
            self.cost.observe(len(drafts), max(widths), t2 - t1)  # padded
        decided = [d for d in judged if d is not None]  # None: its forward failed, alone
        if self.cfg.auto:  # each source's proposal, judged
            for d in decided:
                if d.draft.offers is not None:
                    d.act.chooser.observe({n: None if p is None else list(p)
                                           for n, p in d.draft.offers.items()}, d.new)
        t3 = time.perf_counter()
        decided = self._place(decided)
        applied = self._commit(decided, t1 - t0, t2 - t1)
        if not self.active:  # every session ended: a forward run ahead has no one to serve
            self.ahead.drop()
        report = report_of(applied, len(drafts), width, t1 - t0, t2 - t1,
                           time.perf_counter() - t3)
        if self._regime is not None:  # the step as a whole: its waits and commit cost too
            assert self.worth is not None  # a regime is chosen only by it
            if not async_prefill:  # (a prefill's kernels in its wait are no regime's cost)
                self.worth.observe(report.sessions, report.sessions + report.accepted,
                                   report.take_s + report.forward_s + report.commit_s)
            report = replace(report, rested=self._regime == REST)
        if claim is not None:
            report = replace(report, ran_ahead=True)
        return report

    def _head_wanted(self, drafts: list[StepDraft]) -> bool:
        """--auto: whether a session of the batch would choose the head's drafts next step."""
        assert self.head is not None  # asked only with a head
        fixed, per_token = self.cost.fit() or (1.0, 0.05)
        costs = {"head": self.head.cost_s / len(drafts)}
        return any(verifies_trees(d.act.verify) and
                   d.act.chooser.wants("head", self.head.depth, fixed, per_token, costs)
                   for d in drafts)

    def _verify(self, drafts: list[StepDraft]) -> Sequence[Decision | None]:
        """One forward over the batch (or its share of one run ahead), each row's verdict
        decided; if it fails, each session by a forward of its own, so that a failure fails
        only the session it concerns (None marks those)."""
        ran_ahead = self._claim is not None
        try:
            decided = self._forward_and_verify(drafts)
            self._forwards_ok += 1
            self._batch_failing &= len(drafts) == 1  # a batch's forward ran: the streak ends
            return decided
        except Exception:
            self._forwards_failed += 1
            self._claim = None  # each session again by a forward of its own
            self.ahead.drop()  # launched from the choices of the batch that failed
            if len(drafts) == 1 and not ran_ahead:
                act = drafts[0].act
                log.exception("verification of session %s failed", act.sid)
                self.fail(act, SessionFailed("verification failed"))
                return [None]
            (log.debug if self._batch_failing else log.warning)(  # once a streak: counted
                "the verification of %d session(s) failed; each is verified by a forward of its "
                "own (not said again until a batch's forward runs)", len(drafts), exc_info=True)
            self._batch_failing = True
        out: list[Decision | None] = []
        for d in drafts:
            out.extend(self._verify([d]))
        return out

    def _forward_and_verify(self, drafts: list[StepDraft]) -> list[Decision]:
        """Score the batch (``scoring.score_step``: one forward), then judge it: one host
        sync. Changes nothing a retry would read: the paths are placed after (``_place``). A
        step whose forward ran ahead (``decode_ahead``) judges that forward's choices."""
        claim, self._claim = self._claim, None
        if claim is not None:
            return self._judge_decode(drafts, claim.choices(), self._runs_ahead(drafts))
        step = score_step(self.target, drafts, self.pad)
        if self._runs_ahead(step.drafts):
            return self._judge_decode(step.drafts, decode_choices(step.scored.logits, step.batch),
                                      launch=True)
        return self._judge(step)

    def _runs_ahead(self, drafts: list[StepDraft]) -> bool:
        """Whether the step after this one can be launched before this one's verdicts are
        read (``decode_ahead``): every active session in it (none left waiting for the next
        step, none verified alone after its batch failed), each row its root alone, verified
        exactly, and the next step asking for no draft either: no drafter, board or head to
        draft for it, or drafters resting now and, as things stand, then too
        (``DraftingWorth.next_regime``: where a window of drafting starts instead, the step
        run ahead is dropped and the drafting step runs its own forward)."""
        if not (self.ahead.enabled and len(drafts) == len(self.active) and self.head is None
                and self.pad is None and not self.cfg.auto and
                all(d.width == 1 and d.act.verify == "exact" and d.act.logprobs is None
                    and not d.act.req.params.adjusts_logits for d in drafts)):
            return False
        if self.drafter is None and not any(d.act.drafter for d in drafts):
            return True  # nothing drafts for these sessions: every step decodes
        return self._regime == REST and self.worth is not None and \
            self.worth.next_regime(len(drafts)) == REST

    def _judge_decode(self, drafts: list[StepDraft], choices: torch.Tensor, launch: bool
                      ) -> list[Decision]:
        """A decode step judged from its choices [B] long (queued on the device): their copy
        to the host queued, the next step launched ahead from them if ``launch``
        (``_runs_ahead``), then the step's one wait and each row decided (as ``verify_step``
        decides such rows)."""
        readback = HostCopy(choices)
        if launch:
            self.ahead.launch(drafts, choices)
        tokens = readback.wait().tolist()
        t0 = time.perf_counter()
        decided = row_decisions(drafts, decode_outcome(tokens), self.stop_ids)
        self._decide_s += time.perf_counter() - t0
        return decided

    def _judge(self, step: ScoredStep) -> list[Decision]:
        """Every row verified at once on the device (``edgespec.verify.verify_step``) and
        decided (``scoring.row_decisions``), the head's next drafts proposed from the same
        scores, the PAD rule's tap read."""
        sids = [d.act.sid for d in step.drafts]
        scored, vb = step.scored, step.batch
        proposal = None
        if self.head is not None:
            wanted = not self.cfg.auto or self._head_wanted(step.drafts)
            proposal = self.head.for_step(sids, scored.features, vb.tokens, vb.depths, wanted)
        lenient = step.pad.rule(scored.tapped, self.stop_ids) \
            if step.pad and scored.tapped is not None else None
        out = verify_step(scored.logits, vb, self.cfg.loose, proposal, lenient)
        t0 = time.perf_counter()
        decided = with_logprobs(scored.logits, self._decide(step, out))
        self._decide_s += time.perf_counter() - t0
        if proposal is not None:  # the head moves on once the paths are in place (``_place``)
            self._head_pending.append((sids, proposal, [len(p) for p in out.paths],
                                       out.proposals))
        return decided

    def _decide(self, step: ScoredStep, out: VerifyOutcome) -> list[Decision]:
        """Each row's verdict, cut where its output ends, in one pass (``row_decisions``)."""
        return row_decisions(step.drafts, out, self.stop_ids)

    # -- whole generations ---------------------------------------------------------------------
    def generate_many(self, requests: list[Request]) -> list[Result]:
        errors: list[Exception] = []
        got = self.add_many([Admission(r) for r in requests])
        acts = [g for g in got if isinstance(g, ActiveSession)]
        refused = [g for g in got if isinstance(g, Exception)]
        if refused:
            for a in acts:  # none of them runs: their slots go back (an ended one's are)
                if a.finish is None:
                    self._release(a, "error")
            raise refused[0]
        for a in acts:
            a.on_error = errors.append
        while self.active:
            self.step()
        if errors:
            raise errors[0]
        results: list[Result] = []
        for a in acts:
            assert a.finish is not None  # no error: every session ended with a finish reason
            results.append(Result(a.output, a.stats, a.finish, a.logprobs, a.prompt_logprobs))
        return results

    def generate(self, req: Request) -> Result:
        return self.generate_many([req])[0]
