"""A target runner's KV slots (allocated, freed, rolled back, committed), the prompts written
into them (``prefill``: one prompt in chunks of ``PREFILL_CHUNK`` tokens; ``prefill_parts``:
parts of several prompts in shared forwards of rows of similar length, the logits of those
asked for read), and the states after
its first layers (``early_hidden``, ``early_states``: an early exit's and imitation drafting's
input). ``SlotPrompts`` is a part of ``TargetRunner`` (its base class): it runs the runner's own
chains (``_hidden``, ``_chains``) over the runner's cache, so every prompt token's keys and
values have the bits a step would write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from .host_transfers import longs_to_device
from .kv_cache import KVCache

if TYPE_CHECKING:
    from .step_rows import Scored

PREFILL_CHUNK = 512  # prompt tokens per prefill forward

ReadLogits = Callable[[torch.Tensor], None]  # gets a prompt part's logits [1, T, V] float32


class SlotPrompts:
    """``TargetRunner``'s slots, prefill and early states."""

    cache: KVCache
    embed: torch.Tensor  # [V, H]: the input embeddings
    device: torch.device
    dtype: torch.dtype
    n_layers: int
    prefill_rows: int  # the most prompt tokens one shared prefill forward takes

    def _hidden(self, slots: list[int], rows: list[list[int]], taps: tuple[int, ...] = (),
                embeds: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        raise NotImplementedError

    def _scored(self, x: torch.Tensor) -> Scored:
        raise NotImplementedError

    def _chains(self, slots: list[int], tokens: torch.Tensor, start_t: torch.Tensor,
                longest: int, slot_index: torch.Tensor | None = None, taps: tuple[int, ...] = (),
                embeds: torch.Tensor | None = None, upto: int | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        raise NotImplementedError

    # -- a session's KV slot ---------------------------------------------------------------------
    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def new_slot(self) -> int:
        return self.cache.allocate()

    def free_slot(self, slot: int) -> None:
        self.cache.release(slot)

    def rollback(self, slot: int, length: int) -> None:
        self.cache.rollback(slot, length)

    def commit(self, slot: int, length: int) -> None:
        self.cache.commit(slot, length)

    # -- prompts, and the first layers' states ----------------------------------------------------
    def early_hidden(self, slots: list[int], tokens: torch.Tensor, starts: list[int],
                     layers: int) -> torch.Tensor:
        """The hidden state after the first ``layers`` decoder layers [B, T, H] of tokens
        [B, T] (long, on the device) placed at positions ``starts[b]``.. of each slot: those
        layers' keys/values are written there (deeper layers' are not; no length pointer
        moves). The same bits the full forward has after that many layers (the kernels are
        batch-invariant). An early exit, and imitation drafting (``edgespec.heads.imitation``),
        read it."""
        return self.early_states(slots, tokens, starts, [layers])[0]

    @torch.inference_mode()
    def early_states(self, slots: list[int], tokens: torch.Tensor, starts: list[int],
                     layers: list[int]) -> list[torch.Tensor]:
        """``early_hidden`` after each of ``layers`` (one forward through the deepest): a
        [B, T, H] state per layer, in their order."""
        if not layers or not all(1 <= n <= self.n_layers for n in layers):
            raise ValueError(f"layers must be in 1..{self.n_layers}, got {layers}")
        B, T = tokens.shape
        for s, st in zip(slots, starts):
            self.cache.check_room(s, st, T)
        order = sorted(set(layers))
        start_t, slot_t = longs_to_device([starts, slots], self.device)
        _, kept = self._chains(slots, tokens, start_t, max(starts), slot_index=slot_t,
                               taps=tuple(order), upto=order[-1])
        return [kept[order.index(n)] for n in layers]

    @torch.inference_mode()
    def prefill(self, slot: int, tokens: list[int], chunk: int = PREFILL_CHUNK,
                embeds: torch.Tensor | None = None) -> None:
        """Write a prompt's keys/values into a fresh slot, in chunks (no logits computed).
        ``embeds`` [len(tokens), H] in the runner's dtype: the prompt's input embeddings, given
        instead of looked up (a vision-language prompt: ``edgespec.models.vision``); the rows
        of its text tokens are their embedding rows, so only the image positions differ."""
        self.cache.check_room(slot, 0, len(tokens))
        if embeds is not None and tuple(embeds.shape) != (len(tokens), self.embed.shape[1]):
            raise ValueError(f"embeds must be [{len(tokens)}, {self.embed.shape[1]}], got "
                             f"{list(embeds.shape)}")
        self.rollback(slot, 0)
        for i in range(0, len(tokens), chunk):
            part = tokens[i:i + chunk]
            given = None if embeds is None else embeds[i:i + chunk][None].to(self.device,
                                                                           self.dtype)
            self._hidden([slot], [part], embeds=given)
            self.commit(slot, i + len(part))

    @torch.inference_mode()
    def copy_prompt(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst`` holds slot ``src``'s first ``length`` prompt positions, as a prefill of
        the same tokens would write them (a token's keys and values depend only on the tokens
        before it): an identical prompt's prefill shared (``PrefillQueue``)."""
        self.cache.copy_prefix(src, dst, length)

    @torch.inference_mode()
    def prefill_parts(self, slots: Sequence[int], parts: Sequence[list[int]],
                      reads: Sequence[ReadLogits | None] | None = None) -> None:
        """Each slot's ``part`` of its prompt written after what the slot holds, in shared
        forwards of rows of similar length, at most ``prefill_rows`` tokens a forward (rows x
        the longest; within the row counts the start check proved batch-invariant).
        ``reads``: for each part, None or what gets its logits [1, T, V] float32 (its T
        positions', each the target's distribution of the token after it: its hidden states
        through the final norm and the LM head, a row at a time, so that one part's logits are
        the most held at once); the keys and values written are the same either way."""
        reads = [None] * len(slots) if reads is None else reads
        group: list[tuple[int, list[int], ReadLogits | None]] = []
        for slot, part, read in sorted(((s, p, r) for s, p, r in zip(slots, parts, reads) if p),
                                       key=lambda spr: len(spr[1])):
            # ascending: ``part`` is the longest of its group
            if group and (len(group) + 1) * len(part) > self.prefill_rows:
                self._prefill_rows(group)
                group = []
            group.append((slot, part, read))
        if group:
            self._prefill_rows(group)

    def _prefill_rows(self, group: list[tuple[int, list[int], ReadLogits | None]]) -> None:
        starts = [self.cache.lengths[slot] for slot, _, _ in group]
        x, _ = self._hidden([slot for slot, _, _ in group], [part for _, part, _ in group])
        for (slot, part, _), start in zip(group, starts):
            self.commit(slot, start + len(part))
        for row, (_, part, read) in enumerate(group):
            if read is not None:  # x [B, T, H]: the row's own positions, as a forward of it alone
                read(self._scored(x[row:row + 1, :len(part)]).logits)
