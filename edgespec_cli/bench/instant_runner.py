"""``bench-host``'s stand-in for the target runner: the real KV cache's slots and lengths with no
layers and no weights, answering a step at once with deterministic logits. Row b's token at
position t is followed by ``next_token``: with probability ``right`` (fixed per position) the
next token of a cycle of ``CYCLE`` tokens through a permutation of the vocabulary, which MaG can
learn from the context, else a token drawn once per (position, token)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


VOCAB = 512


CYCLE = 24  # the target's cycles: what MaG can learn from the context


class InstantRunner:
    """A target runner that answers at once: row b's logits at position t point at
    ``next_token(token, position)``, a fixed function of the context."""

    def __init__(self, n_slots: int, right: float, max_len: int = 2048, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(VOCAB, generator=g)
        cycle_next = torch.empty(VOCAB, dtype=torch.long)
        for i in range(0, VOCAB, CYCLE):  # cycles of CYCLE tokens through a permutation
            ring = perm[i:i + CYCLE]
            cycle_next[ring] = torch.roll(ring, -1)
        self.cycle_next = cycle_next
        self.noise = torch.randint(0, VOCAB, (max_len + 64, VOCAB), generator=g)
        self.off = torch.rand(max_len + 64, generator=g) >= right  # positions off the cycle
        from edgespec.runner.kv_cache import KVCache

        # the real cache's slots and lengths; no layers, so no tensors
        self.cache = KVCache(0, n_slots, max_len, kv_heads=1, head_dim=1)
        self.vocab_size, self.max_len = VOCAB, max_len
        self.device, self.dtype = torch.device("cpu"), torch.float32
        from edgespec.runner.kernel_set import KernelSet

        self.kernel_set = KernelSet("instant", "none", "none", 0, "", False, "float32", "cpu",
                                    0, torch.__version__, "-", "bench-host")
        self.runner_s = 0.0  # time spent answering steps
        self.runner_cpu_s = 0.0  # the same on the answering thread's CPU clock

    def new_slot(self) -> int:
        return self.cache.allocate()

    def free_slot(self, slot: int) -> None:
        self.cache.release(slot)

    def prefill(self, slot: int, tokens: list[int], embeds=None) -> None:
        self.cache.commit(slot, len(tokens))

    def prefill_parts(self, slots, parts, reads=None) -> None:
        if reads is not None and any(r is not None for r in reads):
            raise NotImplementedError("bench-host's runner reads no prompt's logits")
        for slot, part in zip(slots, parts):
            self.cache.commit(slot, self.cache.lengths[slot] + len(part))

    def copy_prompt(self, src: int, dst: int, length: int) -> None:
        self.cache.copy_prefix(src, dst, length)

    def rollback(self, slot: int, length: int) -> None:
        self.cache.rollback(slot, length)

    def commit(self, slot: int, length: int) -> None:
        self.cache.commit(slot, length)

    def compact_many(self, paths) -> list[None]:
        for slot, path in paths:
            self.cache.commit(slot, self.cache.lengths[slot] + 1 + len(path))
        return [None] * len(paths)

    def next_token(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The target's choice after ``tokens`` at ``positions`` (same shapes)."""
        import torch

        positions = positions.clamp(max=self.noise.shape[0] - 1)
        return torch.where(self.off[positions], self.noise[positions, tokens],
                           self.cycle_next[tokens])

    def score_rows(self, rows, tap=None):
        import torch

        from edgespec.runner.step_rows import Scored

        t0, cpu0 = time.perf_counter(), time.thread_time()
        B, T = rows.tokens.shape
        positions = rows.start_index[:, None] + rows.depths[:, :T]  # [B, T] tokens' positions
        nxt = self.next_token(rows.tokens, positions + 1)  # [B, T]
        logits = torch.zeros(B, T, VOCAB)
        logits.scatter_(2, nxt[..., None], 10.0)
        cpu1 = time.thread_time()  # (a system call: read inside the wall's window, not after it)
        self.runner_s += time.perf_counter() - t0
        self.runner_cpu_s += cpu1 - cpu0
        return Scored(logits, torch.zeros(B, T, 8))
