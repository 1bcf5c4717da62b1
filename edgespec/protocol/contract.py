"""The session protocol's contract (query-and-correct, docs/architecture.md): the types the
verifier, the session stores and the drafters exchange, the rules on a draft's branches that
every store applies, and the store interface the verifier drives.

A session's state is the prompt, the committed tokens, the current draft beyond them and the
epoch. A drafter pushes chunks under an epoch at the draft's end; the verifier takes a draft
(``TakenDraft``), commits its ``Verdict``, and when the draft did not hold the verifier's token
the store publishes a ``Fix`` and moves the epoch on, so a late chunk is never verified against
the wrong prefix. All positions are absolute indices into prompt + output.

Token trees have one shape here: a chain (the drafter's belief) and ``Branch``es, alternatives
to some of its tokens, each indexed by ``at`` within the draft that holds it. The wire's nodes
and parents (``edgespec.wire.trees``), the verifier's node layout (``tree_verify.DraftTree``) and
Redis's packed encoding are conversions at those boundaries.

Two stores implement ``SessionStore``: ``edgespec.protocol.local_store.LocalSessionStore`` (in
process) and ``cache_service.store.RedisSessionStore`` (Lua scripts in Redis).
tests/test_store_contract.py holds both to the same rules, replays and refusals.

Failure rules the verifier relies on:
- ``take_when_ready`` and ``commit_many`` answer per session: one session's trouble (it vanished
  from the store, a refused commit) is reported in its own slot, never raised for the batch;
- they raise only ``StoreUnavailable``, when the store itself cannot be reached; nothing was
  then applied by ``take_when_ready``, and ``commit_many`` may be retried with the same verdicts
  (a commit that did land is recognised by its position and last token and answered as applied,
  not applied twice; the answer carries no fix, whose event went out the first time);
- a store may answer a take without reading, where it knows no draft can come (the Redis
  store: a session it created without a board, asked for nothing): that session's trouble (it
  vanished, the store cannot be reached) then shows at its commit, in its slot or raised;
- ``close`` never raises.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

from ..config import SamplingParams
from .lineage import Lineage
from .frozen_value import frozen_value

MAX_BRANCHES = 8  # branches a session's draft keeps (more are dropped)
MAX_BRANCH_TOKENS = 8  # tokens a branch keeps


class StaleChunkError(Exception):
    """A draft chunk or verdict from an old epoch or at the wrong position."""


class SessionVanished(Exception):
    """The store no longer holds the session (expired, or lost with a non-persistent Redis)."""


class StoreUnavailable(Exception):
    """The session store itself cannot be reached (Redis down or restarting): the step that met
    it is retried; no session is failed for it."""


def plain_ids_in_range(ids: Sequence, vocab_size: int) -> bool:
    """Whether ``ids`` are all plain ints in [0, vocab_size), found without a Python loop (what
    the wire gives: a check's fast path; False sends a caller to its own id-by-id rules)."""
    return bool(ids) and set(map(type, ids)) == {int} and min(ids) >= 0 and \
        max(ids) < vocab_size


def is_token_id(t: object, vocab_size: int) -> bool:
    """Whether ``t`` is a token id: an integer (a plain int or another kind, NumPy's; a bool
    is not) in [0, vocab_size). The id-by-id rule behind ``plain_ids_in_range``'s fast path."""
    if type(t) is int:  # the common case, without the ABC check
        return 0 <= t < vocab_size
    return isinstance(t, numbers.Integral) and not isinstance(t, bool) and \
        0 <= int(t) < vocab_size


def check_draft_ids(tokens: Sequence[int], vocab_size: int) -> None:
    """Refuse (ValueError) draft token ids outside [0, vocab_size): the check every store
    applies where drafts enter (the local store on a push, the cache service on a chunk)."""
    if plain_ids_in_range(tokens, vocab_size):
        return
    for t in tokens:
        if not is_token_id(t, vocab_size):
            raise ValueError(f"draft token ids must be in [0, {vocab_size}), got {t!r}")


def spine_length(parents: Sequence[int]) -> int:
    """How many nodes of a tree, given as each node's parent (-1: the root), form its spine:
    the leading nodes that hang each from the one before (the chain the tree carries)."""
    n = 0
    while n < len(parents) and parents[n] == n - 1:
        n += 1
    return n


@frozen_value
class Branch:
    """An alternative to the draft's token ``at`` (0-based in the draft that holds it): it hangs
    from the token before it (the draft's token at - 1, or the session's last committed token
    when at is 0) and continues with ``tokens`` (a chain; its first token differs from the
    draft's)."""

    at: int
    tokens: tuple[int, ...]


def chunk_branches(tokens: Sequence[int], branches: Sequence[Branch], keep: int
                   ) -> list[Branch]:
    """What a store keeps of a chunk's branches (``at`` within the chunk): those that are
    alternatives to one of the ``keep`` tokens kept, differ from the chain there and are not
    repeated, each cut to MAX_BRANCH_TOKENS, at most MAX_BRANCHES."""
    out: list[Branch] = []
    seen = set()
    for b in branches:
        toks = tuple(int(t) for t in b.tokens[:MAX_BRANCH_TOKENS])
        if not 0 <= b.at < keep or not toks or toks[0] == tokens[b.at] or \
                (b.at, toks[0]) in seen:
            continue
        seen.add((b.at, toks[0]))
        out.append(Branch(b.at, toks))
    return out[:MAX_BRANCHES]


def take_branches(branches: Sequence[Branch], n_spine: int, budget: int) -> list[Branch]:
    """The branches that hang from the first ``n_spine`` tokens of their draft (each an
    alternative to one of them), cut so that they hold at most ``budget`` tokens in all."""
    out = []
    for b in branches:
        if budget <= 0:
            break
        if 0 <= b.at < n_spine:
            toks = b.tokens[:budget]
            budget -= len(toks)
            out.append(Branch(b.at, toks))
    return out


@frozen_value
class DraftWant:
    """What the verifier asks of one session's draft this step: up to ``k`` tokens (it waits for
    k, or for the drafter to be idle, until the deadline), and branches hanging from them of at
    most ``branch_budget`` tokens in all. ``wait`` False: the step does not wait for this one
    (its drafter has been late: ``edgespec.engine.lateness``, or its draft is not worth a
    wait: ``draft_planner.wait_worth``); whatever it holds is taken. ``wait_s``: wait for this
    one at most that long (within the step's deadline; None: the whole deadline)."""

    session_id: str
    k: int
    branch_budget: int = 0
    wait: bool = True
    wait_s: float | None = None

    def waits_until(self, deadline: float, now: float) -> float:
        """Until when (``time.monotonic``) the step waits for this draft, the step's
        ``deadline`` and its start ``now`` given."""
        return deadline if self.wait_s is None else min(deadline, now + self.wait_s)


@dataclass
class TakenDraft:
    epoch: int
    start: int  # position of the first draft token (the committed end)
    tokens: list[int]
    branches: list[Branch] = field(default_factory=list)  # at: within tokens
    ready: bool = True  # the draft was ready (k tokens, or its drafter idle) when taken
    # its drafter was there when it was taken (False: the session has none, or its board went:
    # then the draft is ready, since waiting gives nothing, but says nothing of the board's
    # lateness: ``step_drafts._record_lateness`` leaves it out)
    drafting: bool = True

    @property
    def branch_tokens(self) -> int:
        return sum(len(b.tokens) for b in self.branches)


@frozen_value
class Proposal:
    """One source's draft for one session's next verification: a chain from the session's
    committed end, and alternatives hanging from it (``at`` within ``tokens``)."""

    tokens: tuple[int, ...] = ()
    branches: tuple[Branch, ...] = ()


NO_PROPOSAL = Proposal()


class Proposer(Protocol):
    """A source of draft tokens the verifier asks each step (the drafter behind the store, the
    verifier's draft head); ``name`` is its name in ``--auto``'s stacks."""

    name: str

    def propose(self, session_id: str, taken: TakenDraft) -> Proposal | None:
        """This step's draft for the session (``taken``: what the store gave for it); None
        when the source was not asked this step (--auto measures only those it asked)."""
        ...


@frozen_value
class Verdict:
    """The verifier's decision on one session's draft taken under ``epoch``."""

    session_id: str
    epoch: int
    start: int  # position of the first draft token (the committed end before this verdict)
    n_accepted: int
    token: int
    finish_reason: str = ""  # set on the session's last verdict: "stop" or "length"
    # tokens accepted from a branch at start + n_accepted, before ``token`` (trees only)
    branch: tuple[int, ...] = ()
    # the branch was the verifier's own draft (a draft head's), not one the draft holds: the
    # store commits it as a fix without looking for it among the draft's branches
    own_branch: bool = False
    # draft tokens the verifier asked of this session in this step (its planner's k, told as
    # ``step_planning.told_wants`` says: 0 rests the drafter): a board keeps its lead near what
    # is used (``draft_lead.lead_cap``; an inline drafter drafts chains to the window); None:
    # not said
    wanted: int | None = None

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    @property
    def end(self) -> int:
        """The committed end after this verdict."""
        return self.start + self.n_accepted + len(self.branch) + 1


@frozen_value
class Fix:
    """A correction for the drafter: roll back to ``position``, append ``tokens`` (the accepted
    branch's tokens, if the verdict took one, then the verifier's own token), and continue
    under ``epoch``. ``id`` orders the in-process log (0 where the store keeps no log)."""

    id: int
    epoch: int
    position: int
    tokens: tuple[int, ...]

    @classmethod
    def of_verdict(cls, v: Verdict, epoch: int, fix_id: int = 0) -> "Fix":
        """The fix a verdict the draft did not hold publishes, under the new ``epoch``."""
        return cls(fix_id, epoch, v.start + v.n_accepted, (*v.branch, v.token))


@frozen_value
class CommitOutcome:
    """One verdict's fate: applied (``fix`` set when the draft did not hold the token), or
    refused with ``error``."""

    fix: Fix | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


APPLIED = CommitOutcome()  # a verdict applied without a fix (the common outcome, shared)


class SessionStore(Protocol):
    """What the verifier drives, per session life: ``create`` (a new session, or a resumed one
    whose committed output is already known; ``lineage``: the kernel set its output is the
    decoding of, kept where sessions are resumable), ``take_when_ready`` (the drafts to verify this
    step), ``commit_many`` (the verdicts) and ``close`` (or ``close_many``)."""

    wait_ms: float  # the store's suggested draft deadline

    def create(self, session_id: str, prompt: list[int], params: SamplingParams,
               drafter: str | None, max_new_tokens: int,
               committed: Sequence[int] = (), verify: str = "exact",
               lineage: Lineage = Lineage()) -> None: ...

    def take_when_ready(self, wants: list[DraftWant], wait_s: float
                        ) -> list[TakenDraft | SessionVanished]: ...

    def commit_many(self, verdicts: list[Verdict]) -> list[CommitOutcome]: ...

    def close(self, session_id: str, finish_reason: str = "stop") -> None: ...

    def close_many(self, finished: Mapping[str, str]) -> None:
        """``close`` of several sessions (session id -> finish reason) in one call: a step's
        sessions that ended together (the Redis store: one round trip for all)."""
