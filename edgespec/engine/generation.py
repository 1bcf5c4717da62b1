"""What a generation is to the engine: the ``Request`` a caller makes (an ``Admission`` when
it is admitted), the ``Result`` it gets, the ``ActiveSession`` the verifier keeps while it
runs, and ``SessionFailed``, the error that ends one session and no other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from typing import Callable

from ..config import SamplingParams
from ..drafters.adaptive import DraftLength
from ..models.vision import ImageInput
from ..protocol.lineage import Lineage
from ..protocol.request_stats import Stats
from ..protocol.token_logprob import TokenLogprob


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    params: SamplingParams = field(default_factory=SamplingParams)
    # called with each committed chunk; one that raises fails its own session (SessionFailed)
    on_tokens: Callable[[list[int]], None] | None = None
    # output already committed by an earlier verifier (a resumed session); counts towards
    # max_new_tokens
    committed: list[int] = field(default_factory=list)
    # "": the engine's verification mode; "exact" forces lossless verification on a loose
    # engine; "loose" is refused unless the engine was configured with verify="loose"
    verify: str = ""
    # a vision-language target's images (``edgespec.models.vision``): their features are
    # prefilled at the prompt's image tokens; None for a text prompt
    images: ImageInput | None = None
    # the kernel set whose decoding ``committed`` is (a resumed or re-created session:
    # ``protocol.lineage.continued_on``); None: the engine's own, nothing decoded elsewhere
    lineage: Lineage | None = None
    # the target's logprob of each emitted token, with this many alternatives beside it
    # (0-20, ``verify.token_logprobs``); None: none
    logprobs: int | None = None
    # called with each committed chunk's logprobs, right before ``on_tokens`` with its tokens
    on_logprobs: Callable[[list[TokenLogprob]], None] | None = None
    # the target's logprob of each prompt token after the first, given the tokens before it,
    # with this many alternatives (0-20; the prompt scored as it is prefilled); None: none
    prompt_logprobs: int | None = None
    # called once with them, when the prompt is in (before any output token)
    on_prompt_logprobs: Callable[[list[TokenLogprob]], None] | None = None


@dataclass
class Admission:
    """A request to admit (``SpecEngine.add_many``): its session id (None: the engine names
    it) and the drafter to ask for its drafts (a distributed store's device)."""

    request: Request
    session_id: str | None = None
    device: str | None = None


@dataclass
class Result:
    token_ids: list[int]
    stats: Stats
    finish_reason: str  # "stop" (a stop token), "length" or "cancelled"
    # with ``Request.logprobs``: each token's logprob, for the tokens this engine emitted (a
    # resumed session's ``committed`` have none); None otherwise
    logprobs: list[TokenLogprob] | None = None
    # with ``Request.prompt_logprobs``: each prompt token's after the first; None otherwise
    prompt_logprobs: list[TokenLogprob] | None = None


class SessionFailed(Exception):
    """One session could not go on (it vanished from the store, its commit was refused, its
    forward failed); the others are unaffected."""


class ActiveSession:
    """The verifier's view of one session it is running (``SpecEngine.add`` returns it)."""

    def __init__(self, sid: str, req: Request, slot: int, draft_len: DraftLength):
        self.sid, self.req, self.slot, self.draft_len = sid, req, slot, draft_len
        self.output: list[int] = list(req.committed)
        # the logprobs of the tokens emitted here (``Request.logprobs``), else None
        self.logprobs: list[TokenLogprob] | None = None if req.logprobs is None else []
        self.prompt_logprobs: list[TokenLogprob] | None = None  # ``Request.prompt_logprobs``
        self.last_token = (req.prompt_ids + req.committed)[-1]
        self.on_finish: Callable[[Result], None] | None = None
        self.on_error: Callable[[Exception], None] | None = None
        self.stats = Stats()
        self.finish: str | None = None
        self.verify = "exact"  # "exact" or "loose": how this session's drafts are verified
        self.chooser: Any = None  # --auto: its ``stack_choice.StackChooser``
        self.drafter = ""  # the drafter asked for its drafts ("": none)
        # what its verdict tells its drafter this step asked of it (step_planning.told_wants:
        # its ask, at least 1, or 0 when the drafters rest)
        self.wanted: int | None = None
        # its last commit sent its drafter a fix (a draft token rejected, or a step's own token
        # its draft did not hold): its next draft starts anew from there (a commit sent again
        # after its reply was lost reports no fix)
        self.fixed = False
        # its board's drafts as the steps that asked for one took them: one held tokens at
        # least once; the last one held none (``lateness.EmptyDrafts``)
        self.board_drafted = False
        self.board_empty = False

    def hand_to(self, drafter: str) -> None:
        """Its drafts asked of ``drafter`` from now on (the verifier handed it over: it had no
        board, or its board was gone): what its board's drafts showed and its draft length
        start again, as a new session's."""
        self.drafter, self.wanted = drafter, None
        self.board_drafted = self.board_empty = self.fixed = False
        self.draft_len = DraftLength.of_row(self.draft_len.table, self.draft_len.row)

    @property
    def end(self) -> int:
        """Position after the last committed token."""
        return len(self.req.prompt_ids) + len(self.output)
