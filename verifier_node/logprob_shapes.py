"""A session's logprobs (``edgespec.verify.token_logprobs.TokenLogprob``) in OpenAI's response
shapes: chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}], "refusal"}`` and
the legacy completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.

A token's ``bytes`` are the bytes it stands for: a byte-level BPE tokenizer's (GPT-2's, Llama
3's, SmolLM's) token maps each of its characters back to one byte, so a token that holds part of
a character (an emoji's first bytes) gives exactly those bytes, and a client can join a
response's tokens' bytes into its text. Its ``token`` is those bytes as text, a part of a
character shown as U+FFFD (as the tokenizer's own ``decode`` shows it). A special token
(``<|im_end|>``) is its text.
"""

from __future__ import annotations

from collections.abc import Sequence

from edgespec.protocol.token_logprob import TokenLogprob


def _unicode_of_bytes() -> dict[str, int]:
    """Byte-level BPE's alphabet, inverted: the printable bytes stand for themselves, each other
    byte for the next code point from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_OF_CHAR = _unicode_of_bytes()


class LogprobShapes:
    """Turns ``TokenLogprob`` entries into OpenAI's shapes for one tokenizer (each token's text
    and bytes worked out once)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None) if backend is not None else None
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {int(i) for i in added}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of one token id."""
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._token(token_id)
        return got

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        if self._byte_level and token_id not in self._added:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in BYTE_OF_CHAR for c in piece):
                raw = bytes(BYTE_OF_CHAR[c] for c in piece)
                return raw.decode("utf-8", errors="replace"), list(raw)
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text, list(text.encode("utf-8"))

    def chat(self, entries: Sequence[TokenLogprob]) -> dict:
        """Chat's ``logprobs`` of a choice (or of a streamed chunk's choice)."""
        def one(token_id: int, logprob: float) -> dict:
            text, raw = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": raw}

        return {"content": [{**one(e.token, e.logprob),
                             "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries],
                "refusal": None}

    def completion(self, entries: Sequence[TokenLogprob], offsets: Sequence[int]) -> dict:
        """The legacy completions' ``logprobs`` of a choice (or a streamed chunk's), given
        where each token's text begins in the completion (``text_offset``: from the text as
        decoded, so a character split across tokens counts once). Each ``top_logprobs`` entry
        holds the alternatives and the token itself, as OpenAI's does (in a dict keyed by text:
        tokens of the same text, parts of characters shown alike, are one entry)."""
        tokens = [self.token(e.token)[0] for e in entries]
        tops = [{**{self.token(t)[0]: lp for t, lp in e.top}, self.token(e.token)[0]: e.logprob}
                for e in entries]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": tops, "text_offset": list(offsets)}


    def echoed(self, prompt: Sequence[int], entries: Sequence[TokenLogprob],
               offsets: Sequence[int]) -> dict:
        """The legacy completions' ``logprobs`` of an echoed prompt: its first token has none
        (nothing precedes it: null, as OpenAI's), each later one its ``entries``' (the
        prompt's logprobs, ``Request.prompt_logprobs``)."""
        rest = self.completion(entries, offsets[1:])
        return {"tokens": [self.token(prompt[0])[0], *rest["tokens"]],
                "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]],
                "text_offset": [offsets[0], *rest["text_offset"]]}


def joined(first: dict | None, then: dict | None) -> dict | None:
    """Two runs of the completions' ``logprobs``, one after the other."""
    if first is None or then is None:
        return first or then
    return {key: [*first[key], *then[key]] for key in first}


class ChoiceLogprobs:
    """A choice's logprobs sent along with its text: each ``upto`` gives, in its transport's
    shape, the logprobs of the ticket's tokens from the last call's end to a position.
    ``starts``: where each token read so far (``ticket.tokens``' positions: an HTTP ticket
    holds no earlier output) begins in the output's text, as the run keeps it: the
    completions' ``text_offset``."""

    def __init__(self, shapes: LogprobShapes, ticket, chat: bool, starts: Sequence[int],
                 base: int = 0):
        self.shapes, self.ticket, self.chat, self.starts = shapes, ticket, chat, starts
        self.base = base  # where the output's text begins in the choice's (after an echo)
        self.sent = len(ticket.request.committed)  # a position in ``ticket.tokens``

    def upto(self, cursor: int) -> dict:
        """The logprobs of ``ticket.tokens[sent:cursor]``."""
        first = self.sent
        entries = self.ticket.logprobs_of(first, cursor)
        self.sent = max(first, cursor)
        if self.chat:
            return self.shapes.chat(entries)
        return self.shapes.completion(entries, [self.base + o for o in
                                                self.starts[first:first + len(entries)]])
