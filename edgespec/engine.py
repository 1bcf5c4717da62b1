"""The in-process engine: a drafter thread and a batching verifier over the session protocol.

The drafter thread (``DraftWorker``) drafts ahead into each session's draft, up to the window W,
in chunks of c tokens, and applies fixes by rollback. The verifier (``SpecEngine.step``) waits a
short deadline for drafts, verifies every active session in one forward pass, commits, and
publishes fixes. A session whose draft is empty is decoded one token by the verifier alone, so
drafting can only cost the verification width, never correctness.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .config import ConfigError, EngineConfig, SamplingParams
from .drafters import DraftLength, Drafter, DraftSession
from .metrics import Stats
from .runner import TargetRunner
from .sampling import make_generator, verify_batch
from .session import LocalSessionStore, SessionState, StaleChunkError, Verdict

log = logging.getLogger("edgespec.engine")


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    params: SamplingParams = field(default_factory=SamplingParams)
    on_tokens: Callable[[list[int]], None] | None = None  # called with each committed chunk


@dataclass
class Result:
    token_ids: list[int]
    stats: Stats
    finish_reason: str  # "stop" (a stop token) or "length"


class _Active:
    """The verifier's view of one session."""

    def __init__(self, sid: str, req: Request, slot: int, k: DraftLength):
        self.sid, self.req, self.slot, self.k = sid, req, slot, k
        self.generator = None if req.params.greedy else make_generator(req.params.seed)
        self.output: list[int] = []
        self.last_token = req.prompt_ids[-1]
        self.last_new: list[int] = []
        self.on_finish: Callable[[Result], None] | None = None
        self.stats = Stats()
        self.finish: str | None = None


class DraftWorker(threading.Thread):
    """Drafts for every session of a store, never waiting for the verifier."""

    def __init__(self, drafter: Drafter, store: LocalSessionStore, cfg: EngineConfig):
        super().__init__(daemon=True, name=f"drafter-{drafter.name}")
        self.drafter, self.store, self.cfg = drafter, store, cfg
        self.sessions: dict[str, tuple[DraftSession, list[int]]] = {}  # sid -> (session, [fix id])
        self.stopping = False

    def stop(self) -> None:
        with self.store.cond:
            self.stopping = True
            self.store.cond.notify_all()
        self.join(timeout=5)

    def run(self) -> None:
        while True:
            with self.store.cond:
                if self.stopping:
                    break
                work = self._plan()
                if not work:
                    self.store.cond.wait(timeout=0.5)
                    continue
            for sid, state, session, epoch, start, room in work:
                try:
                    draft = session.propose(min(self.cfg.chunk, room))
                except Exception as exc:  # a broken drafter costs speed, never the session
                    self._give_up(sid, state, exc)
                    continue
                idle = len(draft) == 0
                with self.store.cond:
                    try:
                        state.push_draft(epoch, start, draft.tokens, draft.q, idle=idle,
                                         window=self.cfg.window)
                    except StaleChunkError:
                        pass  # a fix arrived meanwhile; it is applied on the next round
                    self.store.cond.notify_all()
        for session, _ in self.sessions.values():
            session.close()

    def _give_up(self, sid: str, state: SessionState, exc: Exception) -> None:
        log.warning("drafter %s failed on session %s: %r; the verifier decodes it alone",
                    self.drafter.name, sid, exc)
        with self.store.cond:
            state.has_drafter = False
            self.store.cond.notify_all()

    def _plan(self) -> list:
        """Under the lock: open new sessions, apply fixes, close finished ones, and list the
        sessions that have room to draft into."""
        work = []
        for sid, state in self.store.sessions.items():
            if not state.has_drafter or state.done:
                continue
            if sid not in self.sessions:
                self.sessions[sid] = (self.drafter.open(state.tokens, state.params), [0])
            session, last_fix = self.sessions[sid]
            for fix in state.fixes_after(last_fix[0]):
                session.rollback(fix.position)
                session.append([fix.token])
                last_fix[0] = fix.id
            start = len(session.tokens)
            room = self.cfg.window - (start - state.end)
            if state.drafter_idle or room <= 0 or start != state.end + len(state.draft):
                continue
            work.append((sid, state, session, state.epoch, start, room))
        for sid in [s for s in self.sessions if s not in self.store.sessions
                    or self.store.sessions[s].done]:
            self.sessions.pop(sid)[0].close()
        return work


class SpecEngine:
    """The verifier. With a ``drafter`` it drafts in process (a ``DraftWorker`` thread over a
    ``LocalSessionStore``); with a ``store`` (the distributed draft cache) drafts come from
    remote drafters through it."""

    def __init__(self, target: TargetRunner, drafter: Drafter | None = None,
                 config: EngineConfig | None = None, stop_ids: set[int] | None = None,
                 store=None):
        if store is not None and drafter is not None:
            raise ValueError("give a local drafter or an external store, not both")
        self.target = target
        self.drafter = drafter
        self.cfg = config or EngineConfig()
        self.stop_ids = set(stop_ids or ())
        self.store = store if store is not None else LocalSessionStore()
        self.worker = DraftWorker(drafter, self.store, self.cfg) if drafter else None
        if self.worker:
            self.worker.start()
        self._ids = itertools.count()
        self.wait_ms = self.cfg.draft_wait_ms
        if self.wait_ms is None:
            self.wait_ms = drafter.wait_ms if drafter else getattr(store, "wait_ms", 0.0)
        self.active: list[_Active] = []

    def close(self) -> None:
        if self.worker:
            self.worker.stop()

    def __enter__(self) -> "SpecEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- sessions ------------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        """Refuse a request that cannot be served, before any work."""
        n = len(req.prompt_ids)
        if n == 0:
            raise ConfigError("the prompt is empty")
        if req.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        need = n + req.max_new_tokens + self.cfg.max_draft + 1
        if need > self.target.max_len:
            raise ConfigError(f"prompt ({n} tokens) + max_new_tokens ({req.max_new_tokens}) "
                              f"exceeds the context limit ({self.target.max_len})")
        if any(not 0 <= t < self.target.vocab_size for t in req.prompt_ids):
            raise ConfigError(f"prompt token ids must be in [0, {self.target.vocab_size})")

    def add(self, req: Request, session_id: str | None = None, device: str | None = None
            ) -> _Active:
        """Prefill a request into a KV slot and register its session. ``device``: the drafter
        to ask for (distributed store); the local store drafts with its own drafter."""
        self.validate(req)
        slot = self.target.new_slot()
        t0 = time.perf_counter()
        try:
            self.target.prefill(slot, req.prompt_ids[:-1])
            sid = session_id or f"local-{next(self._ids)}"
            drafter = device if self.worker is None else self.drafter.name
            self.store.create(sid, req.prompt_ids, req.params, drafter)
        except BaseException:
            self.target.free_slot(slot)
            raise
        act = _Active(sid, req, slot, DraftLength(self.cfg.max_draft, adaptive=self.cfg.adaptive))
        act.stats.prefill_s = time.perf_counter() - t0
        act.stats.start = t0
        self.active.append(act)
        return act

    def cancel(self, sid: str) -> bool:
        """Stop a session now (finish reason "cancelled"); False if it is not active."""
        for act in self.active:
            if act.sid == sid:
                act.finish = "cancelled"
                self._finish(act)
                return True
        return False

    def _finish(self, act: _Active) -> None:
        act.stats.tokens = len(act.output)
        act.stats.elapsed_s = time.perf_counter() - act.stats.start
        self.active.remove(act)
        self.target.free_slot(act.slot)
        try:
            self.store.close(act.sid)
        finally:
            if act.on_finish:
                act.on_finish(Result(act.output, act.stats, act.finish))

    # -- one verification step over every active session -----------------------------------------
    def step(self) -> None:
        acts = list(self.active)
        plans = [a.k.plan() for a in acts]
        ks = self._draft_budget([k for k, _ in plans])
        t0 = time.perf_counter()
        wants = [(a.sid, k, min(k, w)) for a, k, (_, w) in zip(acts, ks, plans)]
        taken = self.store.take_when_ready(wants, self.wait_ms / 1000)
        t1 = time.perf_counter()
        rows = [[a.last_token] + t.tokens for a, t in zip(acts, taken)]
        logits = self.target.forward([a.slot for a in acts], rows)  # [B, T_max, V]
        verdicts = verify_batch(logits, [t.tokens for t in taken], [t.q for t in taken],
                                [a.req.params for a in acts], [a.generator for a in acts])
        t2 = time.perf_counter()
        commits = []
        for act, t, (n, token) in zip(acts, taken, verdicts):
            new, finish = self._truncate(act, t.tokens[:n] + [token])
            commits.append(Verdict(act.sid, t.epoch, n, token, done=finish is not None))
            self.target.commit(act.slot, t.start + n)  # KV of last committed + accepted
            act.k.update(len(t.tokens), n)
            act.stats.record_step(len(t.tokens), n)
            act.output.extend(new)
            act.last_token = token
            act.finish = finish
            act.last_new = new
        self.store.commit_many(commits)
        t3 = time.perf_counter()
        for act in acts:
            act.stats.take_s += t1 - t0
            act.stats.forward_s += t2 - t1
            act.stats.commit_s += t3 - t2
            if act.req.on_tokens:
                act.req.on_tokens(act.last_new)
            if act.finish:
                self._finish(act)

    def _draft_budget(self, ks: list[int]) -> list[int]:
        """Cap the batch at ``max_batch_tokens`` (one own token per session + drafts) by
        shortening the longest drafts first."""
        budget = max(0, self.cfg.max_batch_tokens - len(ks))
        ks = list(ks)
        while sum(ks) > budget:
            ks[ks.index(max(ks))] -= 1
        return ks

    def _truncate(self, act: _Active, new: list[int]) -> tuple[list[int], str | None]:
        room = act.req.max_new_tokens - len(act.output)
        for i, tok in enumerate(new[:room]):
            if tok in self.stop_ids:
                return new[: i + 1], "stop"
        if len(new) >= room:
            return new[:room], "length"
        return new, None

    # -- whole generations ---------------------------------------------------------------------
    def generate_many(self, requests: list[Request]) -> list[Result]:
        acts = [self.add(r) for r in requests]
        while self.active:
            self.step()
        return [Result(a.output, a.stats, a.finish) for a in acts]

    def generate(self, req: Request) -> Result:
        return self.generate_many([req])[0]
