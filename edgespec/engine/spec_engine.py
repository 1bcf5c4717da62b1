"""The in-process engine: a drafter thread and a batching verifier over the session protocol.

The drafter thread (``DraftWorker``) drafts ahead into each session's draft, up to the window W,
in chunks of c tokens, and applies fixes by rollback. The verifier (``SpecEngine.step``) waits a
short deadline for drafts, verifies every active session in one forward pass, commits, and
publishes fixes. A session whose draft is empty is decoded one token by the verifier alone, so
drafting can only cost the verification width, never correctness.

Token trees: a draft may carry branches (``tree_width`` > 1 for the in-process drafter, or a
remote drafter's tree chunks). The step then gives each session a share of the batch's token
budget left after the chains (at most ``tree_nodes``), and a batch where any session has
branches is run as one tree forward (``TargetRunner.forward_tree``, chains as trees). Every
step, chains and trees alike, is verified by one call on the device
(``edgespec.verify.verify_step.verify_step``); a tree's accepted path has its keys/values compacted
into place.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import ConfigError, EngineConfig, session_verify_mode
from .draft_planner import ForwardCost
from .draft_worker import DraftWorker
from ..drafters import DraftLength, Drafter
from ..protocol.fleet_table import FleetTable
from .generation import ActiveSession, Request, Result, SessionFailed
from ..heads.proposer import HeadProposer, head_branch, held_branch
from ..protocol.contract import DraftWant, SessionStore, TakenDraft, Verdict
from ..runner.target_runner import TargetRunner
from ..verify.keyed_noise import with_session_seed
from ..protocol.local_store import LocalSessionStore
from .step_planning import plan_branch_budgets, plan_drafts
from .stack_choice import StackChooser, accepted_prefix
from .step_report import StepReport, step_report
from ..verify.trees import DraftTree, tree_of_draft
from ..verify.verify_step import VerifyBatch, verify_step

__all__ = ["ActiveSession", "Request", "Result", "SessionFailed", "SpecEngine", "StepReport"]

log = logging.getLogger("edgespec.engine.spec_engine")


@dataclass(frozen=True)
class _Checked:
    """One row's verification: n chain tokens accepted, then ``branch`` (tokens of a branch,
    trees only), then the target's own ``token``."""

    n: int
    token: int
    branch: tuple[int, ...] = ()
    own: bool = False  # the branch is the verifier's head's draft, not the drafter's


@dataclass
class _Decided:
    """A session's verdict of this step, waiting for the store to take it."""

    act: ActiveSession
    verdict: Verdict
    new: list[int]  # tokens it adds to the output (cut at a stop token or the length limit)
    drafted: int  # draft tokens verified: the chain's and the branches'
    chain: int = 0  # of which the chain's
    head_offer: tuple[int, ...] = ()  # the head's proposal verified this step

    @property
    def accepted(self) -> int:
        return self.verdict.n_accepted + len(self.verdict.branch)


class SpecEngine:
    """The verifier. With a ``drafter`` it drafts in process (a ``DraftWorker`` thread over a
    ``LocalSessionStore``); with a ``store`` (the distributed draft cache) drafts come from
    remote drafters through it."""

    def __init__(self, target: TargetRunner, drafter: Drafter | None = None,
                 config: EngineConfig | None = None, stop_ids: set[int] | None = None,
                 store: SessionStore | None = None, fleet: FleetTable | None = None,
                 head: HeadProposer | None = None):
        if store is not None and drafter is not None:
            raise ValueError("give a local drafter or an external store, not both")
        self.target = target
        self.drafter = drafter
        self.cfg = config or EngineConfig()
        if head is None and self.cfg.head:
            from ..heads.manifest import load_head

            head = HeadProposer(load_head(self.cfg.head, target), source=self.cfg.head,
                                learn=self.cfg.learn)
        self.head = head  # a draft head drafting from the verification forward's features
        self.stop_ids = set(stop_ids or ())
        # fleet: a Cacheback fleet table the local store teaches each finished session's output
        self.worker: DraftWorker | None = None
        self.store: SessionStore  # mypy checks that both stores are one
        if store is None:
            local = LocalSessionStore(fleet)  # the worker drafts only over a local store
            if drafter:
                self.worker = DraftWorker(drafter, local, self.cfg)
            self.store = local
        else:
            self.store = store
        if self.worker:
            self.worker.start()
        self._ids = itertools.count()
        wait_ms = self.cfg.draft_wait_ms
        if wait_ms is None:
            wait_ms = drafter.wait_ms if drafter else self.store.wait_ms
        self.wait_ms: float = wait_ms
        self.active: list[ActiveSession] = []
        self.cost = ForwardCost()  # the measured cost of the verification forward
        self._undelivered: list[_Decided] = []

    @property
    def free_slots(self) -> int:
        """Sessions the target's KV cache can take now."""
        return self.target.cache.free_slots

    def close(self) -> None:
        if self.worker:
            self.worker.stop()
        if self.head is not None:
            self.head.close()

    def __enter__(self) -> "SpecEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- sessions ------------------------------------------------------------------------------
    def validate(self, req: Request) -> str:
        """Refuse a request that cannot be served, before any work; returns the session's
        verification mode ("exact" or "loose")."""
        n = len(req.prompt_ids)
        if n == 0:
            raise ConfigError("the prompt is empty")
        if req.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        need = n + req.max_new_tokens + self.cfg.max_draft + 1
        if need > self.target.max_len:
            raise ConfigError(f"prompt ({n} tokens) + max_new_tokens ({req.max_new_tokens}) "
                              f"exceeds the context limit ({self.target.max_len})")
        vocab = self.target.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_ids + req.committed):
            raise ConfigError(f"prompt token ids must be in [0, {vocab})")
        if len(req.committed) >= req.max_new_tokens:
            raise ConfigError("the resumed session has already produced max_new_tokens")
        return session_verify_mode(req.verify, self.cfg.verify)

    def add(self, req: Request, session_id: str | None = None, device: str | None = None
            ) -> ActiveSession:
        """Prefill a request into a KV slot and register its session. ``device``: the drafter
        to ask for (distributed store); the local store drafts with its own drafter. A request
        with ``committed`` output resumes a session: prompt + committed are prefilled."""
        req.params = with_session_seed(req.params)
        verify = self.validate(req)
        slot = self.target.new_slot()
        t0 = time.perf_counter()
        try:
            self.target.prefill(slot, (req.prompt_ids + req.committed)[:-1])
            sid = session_id or f"local-{next(self._ids)}"
            drafter = device if self.worker is None else self.worker.drafter.name
            self.store.create(sid, req.prompt_ids, req.params, drafter, req.max_new_tokens,
                              committed=req.committed, verify=verify)
        except BaseException:
            self.target.free_slot(slot)
            raise
        act = ActiveSession(sid, req, slot,
                            DraftLength(self.cfg.max_draft, adaptive=self.cfg.adaptive))
        act.verify = verify
        if self.head is not None:
            act.head_context = self.head.new_context(self.target.device)
        if self.cfg.auto:
            act.chooser = StackChooser()
            act.stats.stacks = act.chooser.chosen
        act.stats.prefill_s = time.perf_counter() - t0
        act.stats.start = t0
        act.stats.lossy = verify == "loose"
        self.active.append(act)
        return act

    def cancel(self, sid: str, reason: str = "cancelled") -> bool:
        """Stop a session now (finish reason ``reason``: "cancelled", or "stop" for a stop
        string found by a front door); False if it is not active."""
        for act in self.active:
            if act.sid == sid:
                act.finish = reason
                self._finish(act)
                return True
        return False

    def _drop(self, act: ActiveSession) -> None:
        """Forget a session here and free its KV slot (the store is not told)."""
        if act in self.active:
            self.active.remove(act)
            self.target.free_slot(act.slot)
            if self.head is not None:
                self.head.finish(act.sid)

    def _release(self, act: ActiveSession, finish: str) -> None:
        act.stats.tokens = len(act.output) - len(act.req.committed)
        act.stats.elapsed_s = time.perf_counter() - act.stats.start
        self._drop(act)
        self.store.close(act.sid, finish)  # never raises

    def _finish(self, act: ActiveSession) -> None:
        finish = act.finish
        assert finish is not None  # called once the session has ended
        self._release(act, finish)
        if act.on_finish:
            act.on_finish(Result(act.output, act.stats, finish))

    def abandon(self, act: ActiveSession, exc: Exception) -> None:
        """Drop a session here but leave it in the store as it is, so that it can be resumed
        (this verifier is stopping)."""
        self._drop(act)
        if act.on_error:
            act.on_error(exc)

    def fail(self, act: ActiveSession, exc: Exception) -> None:
        """End one session with an error; the others go on."""
        log.warning("session %s failed: %s", act.sid, exc)
        self._release(act, "error")
        if act.on_error:
            act.on_error(exc)

    # -- one verification step over every active session -----------------------------------------
    def step(self) -> StepReport | None:
        """Take drafts, verify every active session in one forward, commit. If the store cannot
        be reached, this raises with the engine unchanged, or with the step's verdicts kept
        aside: the next call commits those first (the store recognises a commit that landed).
        Returns what the step did (None when nothing was verified)."""
        if self._undelivered:  # verdicts of a step whose commit did not reach the store
            decided = self._undelivered
            t0 = time.perf_counter()
            return _report(self._commit(decided), len(decided),
                           sum(1 + d.drafted for d in decided), 0.0, 0.0,
                           time.perf_counter() - t0)
        acts = list(self.active)
        ks = plan_drafts(acts, self.cfg, self.cost)
        budgets = plan_branch_budgets(acts, ks, self.cfg, self.cost, self.target.max_len)
        t0 = time.perf_counter()
        wants = [DraftWant(a.sid, k, b) for a, k, b in zip(acts, ks, budgets)]
        taken = self.store.take_when_ready(wants, self.wait_ms / 1000)
        batch: list[tuple[ActiveSession, TakenDraft]] = []
        for act, t in zip(acts, taken):
            if isinstance(t, Exception):
                self.fail(act, SessionFailed(str(t)))
            elif t.start != act.end:
                self.fail(act, SessionFailed(f"the cache holds {t.start} tokens of session "
                                             f"{act.sid}, the verifier {act.end}"))
            else:
                # the cache validates; never verify garbage (nor branches, unless exactly)
                vocab = self.target.vocab_size
                if any(not 0 <= x < vocab for x in t.tokens):
                    t.tokens, t.branches = [], []
                if act.verify != "exact" or any(not 0 <= x < vocab for b in t.branches
                                                for x in b.tokens):
                    t.branches = []
                batch.append((act, t))
        # --auto: every source's proposal, verified or not
        proposals: list[dict | None] = [None] * len(batch)
        if self.cfg.auto:
            proposals = [{"drafter": list(t.tokens),
                          "head": None if act.head_draft is None else list(act.head_draft)}
                         for act, t in batch]
            self._choose_stacks(batch)
        room = self.cfg.max_batch_tokens - sum(1 + len(t.tokens) + t.branch_tokens
                                               for _, t in batch)
        offers = []
        for act, t in batch:  # the head's drafts, within the batch's token budget
            before = t.branch_tokens
            offers.append(self._offer_head_draft(act, t, room))
            room -= t.branch_tokens - before
        if not batch:
            return None
        t1 = time.perf_counter()
        verdicts = self._verify(batch)
        t2 = time.perf_counter()
        width = sum(1 + len(t.tokens) + t.branch_tokens for _, t in batch)
        self.cost.observe(width, t2 - t1)
        decided = []
        for (act, t), c, offer, proposed in zip(batch, verdicts, offers, proposals):
            if c is None:
                continue  # its forward failed: already failed alone
            new, finish = self._truncate(act, t.tokens[:c.n] + list(c.branch) + [c.token])
            if proposed is not None:
                act.chooser.observe(proposed, new)
            # commit exactly what the output keeps: a stop token or the length limit may cut
            # the accepted run (the kept last token is then a draft token the draft holds)
            n, branch = min(c.n, len(new) - 1), tuple(new[c.n:len(new) - 1])
            decided.append(_Decided(act, Verdict(act.sid, t.epoch, t.start, n, new[-1],
                                                 finish_reason=finish or "", branch=branch,
                                                 own_branch=c.own and bool(branch)),
                                    new, len(t.tokens) + t.branch_tokens, len(t.tokens),
                                    offer))
            act.stats.take_s += t1 - t0
            act.stats.forward_s += t2 - t1
        t3 = time.perf_counter()
        applied = self._commit(decided)
        return _report(applied, len(batch), width, t1 - t0, t2 - t1, time.perf_counter() - t3)

    def _choose_stacks(self, batch: list[tuple[ActiveSession, TakenDraft]]) -> None:
        """--auto: drop the draft sources each session's chooser leaves out this step."""
        fixed, per_token = self.cost.fit() or (1.0, 0.05)
        costs = {"head": self.head.cost_s / len(batch)} if self.head is not None else {}
        for act, t in batch:
            offered = {"drafter": len(t.tokens),
                       "head": len(act.head_draft or ()) if act.verify == "exact" else 0}
            stack = act.chooser.choose(offered, fixed, per_token, costs)
            if "drafter" not in stack:
                t.tokens, t.branches = [], []
            if "head" not in stack:
                act.head_draft = []

    def _head_wanted(self, batch: list[tuple[ActiveSession, TakenDraft]]) -> bool:
        """--auto: whether a session of the batch would choose the head's drafts next step."""
        assert self.head is not None  # asked only with a head
        fixed, per_token = self.cost.fit() or (1.0, 0.05)
        costs = {"head": self.head.cost_s / len(batch)}
        return any(a.verify == "exact" and
                   a.chooser.wants("head", self.head.depth, fixed, per_token, costs)
                   for a, _ in batch)

    def _offer_head_draft(self, act: ActiveSession, t: TakenDraft, room: int
                          ) -> tuple[int, ...]:
        """Add the head's draft for this session to its draft as a branch (exact sessions), at
        most ``room`` tokens of it; returns what the head proposed (empty: nothing)."""
        offer = tuple(act.head_draft or ())[:max(0, room)]
        act.head_draft = []
        if not offer or act.verify != "exact":
            return ()
        branch = head_branch(t.tokens, offer)
        if branch is not None:
            t.branches.append(branch)
        return offer

    def _verify(self, batch: list[tuple[ActiveSession, TakenDraft]]
                ) -> Sequence[_Checked | None]:
        """One forward over the batch; if it fails, each session alone, so that a failure
        fails only the session it concerns (None marks those)."""
        try:
            return self._forward_and_verify(batch)
        except Exception:
            if len(batch) == 1:
                act, _ = batch[0]
                log.exception("verification of session %s failed", act.sid)
                self.fail(act, SessionFailed("verification failed"))
                return [None]
        out: list[_Checked | None] = []
        for item in batch:
            out.extend(self._verify([item]))
        return out

    def _forward_and_verify(self, batch: list[tuple[ActiveSession, TakenDraft]]) -> list[_Checked]:
        """One forward over the batch (a tree forward if any row has branches: chains are
        trees whose node i hangs from node i - 1), then every row verified at once on the
        device (``edgespec.verify.verify_step``): one host sync."""
        trees = [tree_of_draft(t.tokens, t.branches) if t.branches
                 else DraftTree.chain(t.tokens) for _, t in batch]
        slots, roots = [a.slot for a, _ in batch], [a.last_token for a, _ in batch]
        if any(t.branches for _, t in batch):
            scored = self.target.score_tree(slots, roots, trees)  # [B, 1 + N, V]
        else:
            scored = self.target.score(slots, [[r] + t.tokens for r, (_, t) in
                                               zip(roots, batch)])  # [B, 1 + k, V]
        vb = VerifyBatch.build([(list(tr.tokens), list(tr.parents)) for tr in trees],
                               [t.start for _, t in batch], [a.req.params for a, _ in batch],
                               [a.verify for a, _ in batch], self.target.vocab_size,
                               self.target.device)
        proposal = None
        if self.head is not None:
            wanted = not self.cfg.auto or self._head_wanted(batch)
            proposal = self.head.for_step([a.head_context for a, _ in batch], scored.features,
                                          vb.tokens, vb.depths, wanted)
        out = verify_step(scored.logits, vb, self.cfg.loose, proposal)
        if proposal is not None and self.head is not None:
            self.head.ran(proposal)
        checked = []
        for b, ((act, t), tree, path, token) in enumerate(zip(batch, trees, out.paths,
                                                             out.tokens)):
            self.target.compact(act.slot, path)  # a branch's keys/values into place
            n = sum(1 for i in path if i < len(t.tokens))  # the path's chain nodes come first
            branch = tuple(tree.tokens[i] for i in path[n:])
            checked.append(_Checked(n, token, branch,
                                    own=bool(branch) and not held_branch(t.branches, n, branch)))
            if proposal is not None and self.head is not None:
                act.head_context = proposal.after[b]
                self.head.observe(act.sid, act.head_context, len(path) + 1)
                act.head_draft = list(itertools.takewhile(lambda x: x >= 0, out.proposals[b])) \
                    if proposal.drafting else None
        return checked

    def _commit(self, decided: list[_Decided]) -> list[_Decided]:
        """Commit verdicts in the store, then apply the ones it took; returns those."""
        decided = [d for d in decided if d.act in self.active]  # not cancelled meanwhile
        self._undelivered = decided
        t0 = time.perf_counter()
        outcomes = self.store.commit_many([d.verdict for d in decided])  # may raise: retried
        self._undelivered = []
        dt = time.perf_counter() - t0
        applied = []
        for d, outcome in zip(decided, outcomes):
            act, v = d.act, d.verdict
            if not outcome.ok:
                self.fail(act, SessionFailed(f"the cache refused a commit: {outcome.error}"))
                continue
            applied.append(d)
            # KV of last + accepted (a tree's accepted path was compacted into place)
            self.target.commit(act.slot, v.start + v.n_accepted + len(v.branch))
            act.draft_len.update(d.chain, v.n_accepted)  # the chain's own acceptance
            act.draft_len.update_branches(d.drafted - d.chain, len(v.branch))
            act.stats.record_step(d.drafted, d.accepted, len(v.branch))
            if d.head_offer and self.head is not None:
                got = accepted_prefix(d.head_offer, d.new[:v.n_accepted + len(v.branch)])
                act.stats.head_tokens += len(d.head_offer)
                act.stats.head_accepted += got
                self.head.offered(len(d.head_offer), got)
            act.stats.commit_s += dt
            act.output.extend(d.new)
            act.last_token = v.token
            act.finish = v.finish_reason or None
            if act.req.on_tokens:
                act.req.on_tokens(d.new)
            if act.finish:
                self._finish(act)
        return applied

    def _truncate(self, act: ActiveSession, new: list[int]) -> tuple[list[int], str | None]:
        room = act.req.max_new_tokens - len(act.output)
        for i, tok in enumerate(new[:room]):
            if tok in self.stop_ids:
                return new[: i + 1], "stop"
        if len(new) >= room:
            return new[:room], "length"
        return new, None

    # -- whole generations ---------------------------------------------------------------------
    def generate_many(self, requests: list[Request]) -> list[Result]:
        errors: list[Exception] = []
        acts = [self.add(r) for r in requests]
        for a in acts:
            a.on_error = errors.append
        while self.active:
            self.step()
        if errors:
            raise errors[0]
        results: list[Result] = []
        for a in acts:
            assert a.finish is not None  # no error: every session ended with a finish reason
            results.append(Result(a.output, a.stats, a.finish))
        return results

    def generate(self, req: Request) -> Result:
        return self.generate_many([req])[0]


def _report(applied: list[_Decided], sessions: int, tokens: int, take_s: float,
            forward_s: float, commit_s: float) -> StepReport:
    return step_report([d.accepted for d in applied], [d.drafted for d in applied], sessions,
                       tokens, take_s, forward_s, commit_s)
