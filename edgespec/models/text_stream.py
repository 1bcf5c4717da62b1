"""Committed token chunks to printable text increments, decoding incrementally.

Re-decoding the whole output at every chunk costs O(n) per chunk; this decodes only a short
window: the last few tokens already written (so a tokenizer that joins tokens with spaces or
merges bytes sees its context) plus the new ones, and writes what the window's text adds.

What a reader has after n tokens depends on those n tokens alone, not on how they came in
chunks: their text up to its last whole character. The first bytes of a multi-byte character
decode as U+FFFD until the rest arrives, so trailing U+FFFDs are held back (``flush`` writes
them at the output's end, as the whole output decodes). A stream resumed after n tokens
(``shown_ids``) therefore knows exactly what its reader has. Text is decoded without the
tokenizer's clean-up of spaces: the clean-up rewrites text already written (``"Bob 's"``
becomes ``"Bob's"`` once the ``s`` comes), which a stream cannot take back.
"""

from __future__ import annotations

from typing import Callable, Sequence

CONTEXT_TOKENS = 6
PARTIAL = "\ufffd"  # what a multi-byte character's first bytes decode as


class TextStream:
    def __init__(self, tokenizer, write: Callable[[str], None], shown_ids: Sequence[int] = ()):
        """``shown_ids``: output tokens the reader already has, with their text up to its last
        whole character (what a stream of them wrote: a resumed stream's)."""
        self.tokenizer, self.write = tokenizer, write
        self.ids: list[int] = list(shown_ids)
        self.window_start = max(0, len(self.ids) - CONTEXT_TOKENS)
        # characters of the window's text the reader has
        self.written = len(self._decode(self.ids[self.window_start:]).rstrip(PARTIAL))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self._decode(self.ids[self.window_start:])
        whole = text.rstrip(PARTIAL)  # up to the last whole character
        if len(whole) > self.written:
            self.write(whole[self.written:])
            self.written = len(whole)
        start = max(0, len(self.ids) - CONTEXT_TOKENS)
        if whole == text and start > self.window_start:  # nothing held back: move on
            self.window_start = start
            self.written = len(self._decode(self.ids[start:]))

    def flush(self) -> None:
        """Write what is held back (the output ended in the middle of a character): the reader
        then has the whole output's text."""
        text = self._decode(self.ids[self.window_start:])
        if len(text) > self.written:
            self.write(text[self.written:])
            self.written = len(text)
