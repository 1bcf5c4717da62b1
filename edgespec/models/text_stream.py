"""Committed token chunks to printable text increments, decoding incrementally.

Re-decoding the whole output at every chunk costs O(n) per chunk; this decodes only a short
window: the last few already-shown tokens (so a tokenizer that joins tokens with spaces or merges
bytes sees its context) plus the new ones, and emits what the window adds. Half of a multi-byte
character (decoded as U+FFFD) is held back until the rest arrives.
"""

from __future__ import annotations

from typing import Callable, Sequence

CONTEXT_TOKENS = 6


class TextStream:
    def __init__(self, tokenizer, write: Callable[[str], None], shown_ids: Sequence[int] = ()):
        """``shown_ids``: output tokens whose text the reader already has (a resumed stream)."""
        self.tokenizer, self.write = tokenizer, write
        self.ids: list[int] = list(shown_ids)
        self.shown_end = len(self.ids)  # tokens whose text was written
        self.window_start = max(0, self.shown_end - CONTEXT_TOKENS)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self.window_start:self.shown_end])
        text = self._decode(self.ids[self.window_start:])
        if text.endswith("\ufffd"):  # half of a multi-byte character: wait for the rest
            return
        self.write(text[len(before):] if text.startswith(before) else text)
        self.shown_end = len(self.ids)
        self.window_start = max(0, self.shown_end - CONTEXT_TOKENS)
