"""A GGUF draft model run by llama.cpp (``llama-cpp-python``), the runtime edge boards use.

``llamacpp:FILE.gguf`` drafts with any GGUF causal LM whose vocabulary is the target's (token
texts compared id by id); ``llamacpp:default`` is the default model's own Q4_1 GGUF. Each
session is a sequence of one llama.cpp context of ``n_slots`` sequences (``llamacpp_batch``), so
that a board drafts a token for each of its sessions in one forward (``propose_many``); a
verifier fix rolls a session's KV cache back by removing the positions after the fix. Drafting
is ``logits_session``'s loop, as the torch model drafter's: greedy sessions draft the argmax,
sampling sessions draw the session's keyed sample from the llama logits (``token_choice``), and
a draft stops when the top probability falls below ``min_confidence``; ``propose_tree`` adds
one-token branches from the logits already computed.

llama-cpp-python is the optional ``llamacpp`` extra (``pip install ".[llamacpp]"`` in a clone),
imported only when
such a drafter is built, before anything else (a missing extra is reported before the default
GGUF is fetched). Nothing here needs torch: a board runs it with the core install plus the extra.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Sequence, cast

import numpy as np

from ..runner.threads import threads_in_use
from ..config import LLAMACPP_HEAD, LLAMACPP_WINDOW, ConfigError, SamplingParams
from .base import Draft, Drafter, DraftSession
from .llamacpp_batch import SharedContext
from .logits_session import LogitsDraftSession, Proposing, propose_together


def import_llama_cpp():
    """The ``llama_cpp`` module, or a ConfigError saying how to install it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ConfigError(
            f"the llamacpp drafter needs llama-cpp-python ({e}), the llamacpp extra: "
            "pip install \".[llamacpp]\" in the edgespec repository (or WHEEL[llamacpp]) "
            "(it compiles llama.cpp from source, which takes a while and needs a C++ compiler "
            "and cmake)") from None
    return llama_cpp


_LOAD_LOCK = threading.Lock()


def load_llama(path, extra_buffers: bool = False, **kwargs):
    """``llama_cpp.Llama(path, **kwargs)``, quiet, its weights in plain CPU buffers unless
    ``extra_buffers``. llama.cpp otherwise puts weights in its extra buffer types (repacked
    layouts, AMX tiles) wherever the CPU advertises them, and some virtual machines advertise AMX
    but fault on its instructions (SIGILL on this project's build machine). The ``Llama`` class
    has no option for it, so its default model parameters are wrapped while it loads."""
    llama_cpp = import_llama_cpp()
    low = llama_cpp.llama_cpp
    with _LOAD_LOCK:
        default_params = low.llama_model_default_params

        def params():
            p = default_params()
            p.use_extra_bufts = extra_buffers
            return p

        low.llama_model_default_params = params
        try:
            return llama_cpp.Llama(str(path), verbose=False, **kwargs)
        finally:
            low.llama_model_default_params = default_params


def resolve_gguf(spec: str) -> Path:
    """The GGUF file a ``llamacpp:`` spec names: ``default`` is the default model's own GGUF."""
    if spec == "default":
        from ..models.files import default_model_gguf

        return default_model_gguf()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"llamacpp drafter: GGUF file {spec!r} not found")
    return path


def gguf_token_texts(llm) -> list[str]:
    """The vocabulary llama.cpp loaded from a GGUF: the text of each token id, in id order."""
    llama_cpp = import_llama_cpp()
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return [llama_cpp.llama_vocab_get_text(vocab, i).decode("utf-8", errors="replace")
            for i in range(llama_cpp.llama_vocab_n_tokens(vocab))]


def vocab_fingerprint(texts: Sequence[str | None]) -> str:
    """A short hash of a vocabulary given as token texts in id order."""
    return hashlib.sha256(json.dumps(texts, ensure_ascii=False).encode()).hexdigest()[:16]


def check_gguf_tokenizer(target_tokenizer, gguf_texts: list[str], draft_name: str) -> None:
    """Refuse a GGUF whose token ids do not mean what the target tokenizer's mean."""
    by_id = {i: t for t, i in target_tokenizer.get_vocab().items()}
    target_texts = [by_id.get(i) for i in range(max(by_id, default=-1) + 1)]
    if target_texts == gguf_texts:
        return
    first = next((i for i, (a, b) in enumerate(zip(target_texts, gguf_texts)) if a != b),
                 min(len(target_texts), len(gguf_texts)))
    ours, theirs = (repr(t[first]) if first < len(t) else "nothing"
                    for t in (gguf_texts, target_texts))
    raise ConfigError(
        f"draft model {draft_name!r} uses a different tokenizer than the target (vocabulary "
        f"fingerprint {vocab_fingerprint(gguf_texts)} vs {vocab_fingerprint(target_texts)}, "
        f"{len(gguf_texts)} vs {len(target_texts)} tokens; token {first} is {ours} vs "
        f"{theirs}); speculative decoding needs the same vocabulary")


class LlamaCppDraftSession(LogitsDraftSession):
    drafter: LlamaCppDrafter

    def __init__(self, drafter: "LlamaCppDrafter", tokens: list[int], params: SamplingParams):
        super().__init__(tokens, params)
        self.drafter = drafter
        self.seq: int | None = drafter.context.acquire(drafter.name)
        # a long prompt is read as its first LLAMACPP_HEAD tokens (the chat template's opening)
        # and its last ones, ``context_window`` in all, its last token included: the ``skip``
        # tokens between are not read, and the sequence's position j holds token j, or j + skip
        # from LLAMACPP_HEAD on; tokens[:kv_len] but the skipped are in the context; the last
        # token is always fed next
        self.skip = self.kv_len = 0
        try:
            self._read_anew(len(tokens))
        except BaseException:  # e.g. a prompt longer than the context
            self.close()
            raise

    def _skipped(self, length: int) -> int:
        """How many tokens a session of ``length`` tokens leaves unread after its first
        LLAMACPP_HEAD, so that it reads at most ``context_window`` (0: none)."""
        window = self.drafter.context_window
        return max(0, length - window) if window else 0

    def _read_anew(self, length: int) -> None:
        """Read the session's first ``length`` tokens but the last (fed with the next draft)
        into its empty sequence, skipping what its window leaves out."""
        self.skip = self._skipped(length)  # 0 for a session within its window
        self.kv_len = self.skip  # the feed's first position: kv_len - skip = 0
        if length <= 1:
            return
        read = self.tokens[:length - 1]
        try:
            self._forward(read[:LLAMACPP_HEAD] + read[LLAMACPP_HEAD + self.skip:])
        except BaseException:  # the sequence holds nothing (the decode dropped its positions)
            self.skip = self.kv_len = 0
            raise

    def _forward(self, feed: list[int]) -> np.ndarray:
        """Decode ``feed`` after the cached positions; the logits [V] after its last token."""
        return self.drafter.feed_many([(self, feed)])[0]

    def _truncate(self, length: int) -> None:
        """Forget the cached positions from token ``length`` on."""
        assert self.seq is not None, "the draft session was closed"
        kept = self.drafter.context.truncate(self.seq, length - self.skip)
        if kept == length - self.skip:
            self.kv_len = length
        else:  # the sequence started over (a recurrent model's): read the window again
            self._read_anew(length + 1)

    def _max_len(self) -> int:
        return self.skip + self.drafter.max_len

    def _feed(self, feed: list[int]) -> np.ndarray:
        return self._forward(feed)

    def _unfeed(self, n: int) -> None:
        self._truncate(self.kv_len - n)

    def rollback(self, length: int) -> None:
        super().rollback(length)
        if self._holds_logits():  # the rollback removed nothing
            return
        if self.skip and length - 1 <= LLAMACPP_HEAD + self.skip:
            # back into what was not read (never a verifier's fix: it rolls back to committed
            # positions, past the prompt): read again, as a session of ``length`` tokens
            assert self.seq is not None, "the draft session was closed"
            self.drafter.context.truncate(self.seq, 0)
            self._read_anew(length)
        elif self.kv_len > max(0, length - 1):
            self._truncate(max(0, length - 1))

    def close(self) -> None:
        self._held = None
        if self.seq is not None:
            self.drafter.context.release(self.seq)
            self.seq = None


class LlamaCppDrafter(Drafter):
    """A GGUF draft model; its sessions are the sequences of one llama.cpp context
    (``llamacpp_batch.SharedContext``), so that ``propose_many`` drafts for several in one
    forward a token."""

    wait_ms = 100.0  # a decode per drafted token, like ModelDrafter

    def __init__(self, path: str, n_slots: int = 4, max_len: int = 2048, target_tokenizer=None,
                 n_threads: int | None = None, min_confidence: float = 0.3,
                 extra_buffers: bool = False, branch_min_prob: float = 0.1,
                 context_window: int | None = None):
        self.llama_cpp = import_llama_cpp()
        self.path = resolve_gguf(path)
        self.name = f"llamacpp:{self.path.name}"
        self.n_slots, self.max_len = n_slots, max_len
        if context_window is None:  # the default, where a session has room for it
            context_window = LLAMACPP_WINDOW if 2 * LLAMACPP_WINDOW <= max_len else 0
        if context_window and not LLAMACPP_HEAD < context_window <= max_len // 2:
            raise ConfigError(f"a llama.cpp drafter's context window is 0 (the whole session) "
                              f"or {LLAMACPP_HEAD + 1} to {max_len // 2} tokens (half a "
                              f"session's {max_len}: room to draft), got {context_window}")
        self.context_window = context_window  # the most tokens a session reads when it opens
        self.batch_jobs = n_slots  # a drafting loop's jobs a turn: every session in one forward
        # the process's thread policy (cli_args.set_threads), else every core
        self.n_threads = n_threads or threads_in_use() or os.cpu_count() or 1
        self.min_confidence = min_confidence
        self.branch_min_prob = branch_min_prob  # the least probability a tree branch needs
        self.extra_buffers = extra_buffers  # see load_llama
        try:  # the weights (a file llama.cpp cannot load fails here, not in a session)
            self.llm = load_llama(self.path, extra_buffers, n_ctx=64, n_threads=self.n_threads,
                                  n_threads_batch=self.n_threads)
        except (ValueError, RuntimeError) as e:
            raise ConfigError(f"llama.cpp could not load {self.path}: {e}") from None
        try:
            self.context = SharedContext(self.llama_cpp, self.llm.model, n_slots, max_len,
                                         self.n_threads)
        except RuntimeError as e:  # e.g. more slots than llama.cpp's most sequences
            self.llm.close()
            raise ConfigError(f"llama.cpp could not hold {n_slots} sessions of {max_len} "
                              f"tokens for {self.path.name}: {e}") from None
        self.n_vocab = self.context.n_vocab
        if target_tokenizer is not None:
            try:
                check_gguf_tokenizer(target_tokenizer, gguf_token_texts(self.llm), str(self.path))
            except ConfigError:
                self.close()
                raise

    def open(self, tokens: list[int], params: SamplingParams) -> LlamaCppDraftSession:
        return LlamaCppDraftSession(self, tokens, params)

    def feed_many(self, feeds: list[tuple[LlamaCppDraftSession, list[int]]]) -> list[np.ndarray]:
        """Each session's feed decoded after its cached positions, in one call where
        ``n_batch`` allows; the logits [V] after each feed (the sessions' caches moved on)."""
        parts = []
        for s, feed in feeds:
            if s.seq is None:
                raise RuntimeError("the draft session was closed")
            parts.append((s.seq, s.kv_len - s.skip, feed))
        logits = self.context.decode(parts)  # too long for a sequence: CacheFullError
        for s, feed in feeds:
            s.kv_len += len(feed)
        return logits

    def propose_many(self, jobs: Sequence[tuple[DraftSession, int]], width: int
                     ) -> list[Draft]:
        """Every job's proposal (its session, k), a token of each session a forward."""
        proposals = [Proposing(cast(LlamaCppDraftSession, s), k, width) for s, k in jobs]
        return propose_together(proposals, self.feed_many)  # type: ignore[arg-type]

    def close(self) -> None:
        """Free the context and the weights (sessions still open hold sequences of nothing)."""
        self.context.close()
        self.llm.close()
