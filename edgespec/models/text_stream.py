"""Committed token chunks to printable text increments, decoding incrementally.

Re-decoding the whole output at every chunk costs O(n) per chunk; this decodes only a short
window: the last few tokens already written (so a tokenizer that joins tokens with spaces or
merges bytes sees its context) plus the new ones, and writes what the window's text adds.

What a reader has after n tokens depends on those n tokens alone, not on how they came in
chunks: the text of their longest prefix that decodes to whole characters (of the last
``BACK_OFF`` prefixes; where none does, their text up to its trailing U+FFFDs). A multi-byte
character's first bytes decode as U+FFFD until the rest arrives, and a byte-fallback tokenizer
(Llama's, Mistral's) turns a whole unfinished run of byte tokens into U+FFFDs, characters
already whole in it included: so the text is taken at a token where it ends whole, not cut at
its U+FFFDs. ``flush`` writes what is held back at the output's end, as the whole output
decodes. The window only ever starts where decoding starts a character (its text does not begin
with U+FFFD: not inside a character's bytes, nor inside a run of byte tokens; not on a skipped
special token), so its text is the whole output's from there on. A stream resumed after n
tokens (``shown_ids``) therefore knows exactly what its reader has. Where that cannot hold: text
held back for more than ``MAX_WINDOW`` tokens (invalid bytes, a run of U+FFFD) is written as it
then decodes, and an invalid byte run (bytes that make no character) may be resumed with a
U+FFFD more or fewer than an unbroken stream writes for it (a byte-fallback tokenizer's run of
byte tokens holding an invalid byte; once in 300 random token sequences of a byte-level one):
the token ids are exact, only the replacement characters of bytes that are no text differ.
Text is decoded without the tokenizer's clean-up of
spaces: the clean-up rewrites text already written (``"Bob 's"`` becomes ``"Bob's"`` once the
``s`` comes), which a stream cannot take back.
"""

from __future__ import annotations

from typing import Callable, Sequence

CONTEXT_TOKENS = 6  # the tokens before the new ones a window keeps, where it can
BACK_OFF = 8  # the tokens looked back over for a prefix that decodes to whole characters
# a window past this many tokens (held back: a run of U+FFFD, invalid bytes) writes what it
# holds as it decodes and moves on: the cost of a call stays bounded, whatever the output
MAX_WINDOW = 64
STARTS = 8  # the latest token positions tried as a window's start
PARTIAL = "\ufffd"  # what a character's bytes decode as until it is whole


class TextStream:
    def __init__(self, tokenizer, write: Callable[[str], None], shown_ids: Sequence[int] = ()):
        """``shown_ids``: output tokens the reader already has, with their text up to its last
        whole character (what a stream of them wrote: a resumed stream's)."""
        self.tokenizer, self.write = tokenizer, write
        # skipped in decoding: a window starting on them would decode its first real token as
        # a text's first (a leading space dropped, a ## kept)
        self.specials = set(getattr(tokenizer, "all_special_ids", None) or ())
        self.ids: list[int] = list(shown_ids)
        self.window_start = 0
        target = len(self.ids) - CONTEXT_TOKENS
        if target > 0:
            self.window_start = self._character_start(max(0, target - MAX_WINDOW), target) or 0
        # characters of the window's text the reader has
        self.written = len(self._whole()[0])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    def _character_start(self, low: int, high: int) -> int | None:
        """The latest start in (low, high] (of the last ``STARTS``) on a token that is not a
        skipped special one and whose decoding begins a character; None if none."""
        for start in range(high, max(low, high - STARTS), -1):
            if self.ids[start] in self.specials:
                continue
            if not self._decode(self.ids[start:start + MAX_WINDOW]).startswith(PARTIAL):
                return start
        return None

    def _whole(self) -> tuple[str, int | None]:
        """The window's text up to the latest token where it decodes to whole characters (of
        the last ``BACK_OFF``), and that token's index; else its text up to its trailing
        U+FFFDs, and None."""
        end = len(self.ids)
        for stop in range(end, max(self.window_start, end - BACK_OFF) - 1, -1):
            text = self._decode(self.ids[self.window_start:stop])
            if not text.endswith(PARTIAL):
                return text, stop
        return self._decode(self.ids[self.window_start:]).rstrip(PARTIAL), None

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        whole, stop = self._whole()
        if len(whole) > self.written:
            self.write(whole[self.written:])
            self.written = len(whole)
        too_long = len(self.ids) - self.window_start > MAX_WINDOW
        if stop is None:
            if not too_long:
                return  # held back: stay
            self.flush()  # held back for too long: written as it decodes (U+FFFDs)
            stop = len(self.ids)
        # the window moves on to a character's start, no later than the whole text's end
        target = min(len(self.ids) - CONTEXT_TOKENS, stop)
        if target <= self.window_start:
            return
        start = self._character_start(self.window_start, target)
        if start is None and too_long:
            start = target
        if start is not None:
            self.window_start = start
            self.written = len(self._decode(self.ids[start:stop]))

    def flush(self) -> None:
        """Write what is held back (the output ended in the middle of a character): the reader
        then has the whole output's text."""
        text = self._decode(self.ids[self.window_start:])
        if len(text) > self.written:
            self.write(text[self.written:])
            self.written = len(text)
