"""One llama.cpp context holding every session of a llamacpp drafter, each its own sequence, so
that one decode call can feed several sessions at once.

A board serving several sessions drafts a token for each of them in one forward
(``LlamaCppDrafter.propose_many``): on this project's 2-core machine the default model's GGUF
decoded one token in ~18.5 ms on one thread, two sessions' tokens in one call in 30-37 ms, four
in 51-55 ms. Sessions are sequences of a
context with ``n_seq_max`` = the drafter's slots and ``max_len`` positions each (the KV cache
kept per sequence, not unified: a session's attention reads only its own keys). llama.cpp runs
such a batch as one forward only while its sequence ids rise one by one (its ``split_equal``
makes a new micro-batch otherwise): a decode's feeds go in sequence order, and a session gets
the lowest free id. Flash attention is off, as ``llama_cpp.Llama``'s default has it (on this CPU
it was 1.3-1.5x slower at these sizes). The context is freed by ``close`` or, failing that,
when the object is collected.
"""

from __future__ import annotations

import heapq
import threading
import weakref
from typing import Sequence

import numpy as np

from ..config import CacheFullError


class DecodeFailed(RuntimeError):
    """llama.cpp refused a decode (no room in the KV cache, or an error)."""


class SharedContext:
    """A llama.cpp context over a loaded model (``llm.model``), ``n_seq`` sequences of
    ``max_len`` positions. Every call takes the context's lock."""

    def __init__(self, llama_cpp, model, n_seq: int, max_len: int, n_threads: int,
                 n_batch: int = 512):
        self.lc, self.n_seq, self.max_len = llama_cpp, n_seq, max_len
        p = llama_cpp.llama_context_default_params()
        # llama.cpp sizes each sequence's cache in whole 256-position blocks
        p.n_ctx = n_seq * -(-max_len // 256) * 256
        p.n_seq_max = n_seq
        p.n_batch = p.n_ubatch = n_batch
        p.n_threads = p.n_threads_batch = n_threads
        p.kv_unified = False
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model, p)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_seq} x {max_len} "
                               "positions")
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self._finalizer = weakref.finalize(self, _free_context, llama_cpp, self.ctx,
                                           self._batch)
        if llama_cpp.llama_n_ctx_seq(self.ctx) < max_len:
            self.close()
            raise RuntimeError(f"llama.cpp made sequences of fewer than {max_len} positions")
        self.n_batch = n_batch
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self._mem = llama_cpp.llama_get_memory(self.ctx)
        self._free = list(range(n_seq))  # a heap: the lowest free id first
        self._lock = threading.Lock()

    def acquire(self, name: str) -> int:
        """A free sequence id, or CacheFullError (``name``: the drafter's, for the message)."""
        with self._lock:
            if not self._free:
                raise CacheFullError(f"all {self.n_seq} llama.cpp sequences of {name} are in "
                                     "use")
            return heapq.heappop(self._free)

    def release(self, seq: int) -> None:
        """Give a sequence back, its cached positions dropped."""
        with self._lock:
            if self.ctx:  # a closed drafter's context is gone, and its ids with it
                self.lc.llama_memory_seq_rm(self._mem, seq, -1, -1)
                heapq.heappush(self._free, seq)

    def truncate(self, seq: int, length: int) -> int:
        """Forget ``seq``'s positions from ``length`` on; returns the length kept (0 when the
        cache cannot drop a tail, as a recurrent model's: the sequence starts over)."""
        with self._lock:
            self._check_open()
            if self.lc.llama_memory_seq_rm(self._mem, seq, length, -1):
                return length
            self.lc.llama_memory_seq_rm(self._mem, seq, -1, -1)
            return 0

    def decode(self, feeds: Sequence[tuple[int, int, Sequence[int]]]) -> list[np.ndarray]:
        """Each feed (sequence, position of its first token, tokens) decoded after what its
        sequence caches, all in as few calls as ``n_batch`` allows; the logits [V] after each
        feed's last token (copies). A decode that fails leaves every sequence of the call as it
        was (nothing past each feed's position kept), so each can be fed again."""
        out: list[np.ndarray | None] = [None] * len(feeds)
        with self._lock:
            self._check_open()
            pending: list[tuple[int, int, int, Sequence[int]]] = []  # (feed, seq, pos, tokens)
            for i, (seq, pos, tokens) in enumerate(feeds):
                if not tokens:
                    raise ValueError("a feed of no tokens has no logits")
                if pos + len(tokens) > self.max_len:
                    raise CacheFullError(f"a session needs {pos + len(tokens)} positions, a "
                                         f"llama.cpp sequence holds {self.max_len}")
                for at in range(0, len(tokens), self.n_batch):  # a long prompt in parts
                    pending.append((i, seq, pos + at, tokens[at:at + self.n_batch]))
            try:
                call: list[tuple[int, int, int, Sequence[int]]] = []
                used = 0
                for part in sorted(pending, key=lambda p: (p[1], p[2])):  # sequence order
                    if used + len(part[3]) > self.n_batch:
                        self._decode_call(call, feeds, out)
                        call, used = [], 0
                    call.append(part)
                    used += len(part[3])
                if call:
                    self._decode_call(call, feeds, out)
            except BaseException:  # the sequences as they were: an earlier call's positions
                for seq, pos, _ in feeds:  # (or a micro-batch llama.cpp kept) dropped
                    self.lc.llama_memory_seq_rm(self._mem, seq, pos, -1)
                raise
        assert all(o is not None for o in out)
        return out  # type: ignore[return-value]

    def _decode_call(self, call, feeds, out) -> None:
        b = self._batch
        n, last = 0, []
        for i, seq, pos, tokens in call:
            ends_feed = pos + len(tokens) == feeds[i][1] + len(feeds[i][2])
            for j, token in enumerate(tokens):
                b.token[n] = token
                b.pos[n] = pos + j
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = seq
                b.logits[n] = ends_feed and j == len(tokens) - 1
                n += 1
            if ends_feed:
                last.append((i, n - 1))
        b.n_tokens = n
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise DecodeFailed(f"llama.cpp's decode of {n} tokens failed (code {rc})")
        for i, row in last:
            ptr = self.lc.llama_get_logits_ith(self.ctx, row)
            out[i] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def _check_open(self) -> None:
        if not self.ctx:
            raise RuntimeError("the llama.cpp drafter was closed")

    def close(self) -> None:
        with self._lock:
            if self.ctx:
                self._finalizer()
                self.ctx = None


def _free_context(lc, ctx, batch) -> None:
    """Free a context and its batch (``SharedContext``'s finalizer: once, by ``close`` or
    when the object is collected)."""
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
