"""A conversation's token ids through the model's chat template, its messages' text kept text.

A tokenizer reads its special tokens' text wherever it appears in what it encodes: ``Say
hi.<|im_end|>`` in a user's message becomes the token that ends a turn, so the text an
application passes on from its own users could close the user's turn and open a forged system
or assistant turn (the chat template's markers are those same tokens). OpenAI's API reads such
text as text; so does this.

A conversation none of whose messages holds a special token's text is encoded as before, the
rendered template in one call (what transformers' ``apply_chat_template(tokenize=True)`` does):
the ids of every ordinary prompt are unchanged. One where some message does is rendered with a
marker in place of each message's text; the template's own text between the markers is encoded
with its special tokens read, each message's text with them split into ordinary tokens
(``split_special_tokens``), and the pieces' ids joined. The model then sees the same characters,
the markers of turns only where the template put them; only where a piece meets a message's text
may its tokens differ from what one call would give (a piece is encoded on its own).

A template that does not place a message's text verbatim (one that trims it, say) cannot be
rendered so: such a conversation is refused, the message and the token named.

A role is the template's own text, and some templates write it inside a special token's
delimiters (Phi-3's ``<|{{ role }}|>``), so a role's text could form special tokens with the
template's, which no check of the role alone can see (``end|><|system`` renders
``<|end|><|system|>``). Every surface therefore takes OpenAI's chat roles alone (``CHAT_ROLES``:
the HTTP API's, the SDK's and gRPC's alike), ``developer`` given to the template as ``system``
(``chat_roles``).

A tokenizer call sets whether special tokens are split on the tokenizer it is given, then
encodes (transformers' fast tokenizers): two threads encoding through one tokenizer, one of them
splitting, could each get the other's setting. So messages' text is encoded through a copy of
the tokenizer kept for splitting (``_splitter``), and the tokenizer a server shares is only
ever called not splitting.
"""

from __future__ import annotations

import copy
import threading
import weakref

from ..config import ConfigError

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles

# a message's text stands in the template's output as this; private-use characters no template
# writes and no special token holds
_MARK = "\ue000edgespec-message-{}\ue001"


def special_texts(tokenizer) -> list[str]:
    """The text of each token the tokenizer reads as special wherever it appears, longest first
    (one may hold another)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = {t.content for t in decoder.values() if getattr(t, "special", False) and t.content}
    texts.update(t for t in getattr(tokenizer, "all_special_tokens", []) or [] if t)
    return sorted(texts, key=len, reverse=True)


def special_text_in(text: str, specials: list[str]) -> str | None:
    """The first special token's text ``text`` holds (None: none)."""
    return next((s for s in specials if s in text), None)


def _render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


_SPLITTERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_SPLITTERS_LOCK = threading.Lock()


def _splitter(tokenizer):
    """A copy of ``tokenizer`` only ever called splitting special tokens, made once."""
    with _SPLITTERS_LOCK:
        out = _SPLITTERS.get(tokenizer)
        if out is None:
            out = _SPLITTERS[tokenizer] = copy.deepcopy(tokenizer)
        return out


def _ids(tokenizer, text: str, split: bool) -> list[int]:
    if not text:
        return []
    if split:
        out = _splitter(tokenizer)(text, add_special_tokens=False, split_special_tokens=True)
    else:
        out = tokenizer(text, add_special_tokens=False)
    return [int(t) for t in out["input_ids"]]


def chat_roles(messages: list[dict]) -> list[dict]:
    """``messages`` with each role checked: one of ``CHAT_ROLES`` (another is refused by name),
    OpenAI's ``developer`` read as ``system`` (newer OpenAI models' system messages: a chat
    template knows ``system``)."""
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in CHAT_ROLES:
            shown = repr(role[:40]) if isinstance(role, str) else type(role).__name__
            raise ConfigError(f"messages[{i}] has the unknown role {shown}: the roles are "
                              f"{', '.join(CHAT_ROLES)}")
    return [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, a generation prompt
    added; roles checked (``chat_roles``); special tokens' text in a message read as text (the
    module's docstring)."""
    messages = chat_roles(messages)
    specials = special_texts(tokenizer)
    texts = {i: m["content"] for i, m in enumerate(messages) if isinstance(m.get("content"), str)}
    found = [(i, s) for i, t in texts.items() if (s := special_text_in(t, specials)) is not None]
    if not found:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    marked = [{**m, "content": _MARK.format(i)} if i in texts else m
              for i, m in enumerate(messages)]
    rendered, whole = _render(tokenizer, marked), _render(tokenizer, messages)
    # the template places each message's text as it stands, or trimmed (Llama 3's): the pieces
    # must spell what it renders from the conversation itself
    for place in (lambda t: t, str.strip):
        pieces = _pieces(rendered, {i: place(t) for i, t in texts.items()})
        if pieces is not None and "".join(p for p, _ in pieces) == whole:
            break
    else:
        i, token = found[0]
        raise ConfigError(f"messages[{i}] holds {token!r}, a special token of this model, and "
                          f"its chat template does not place a message's text as it stands, so "
                          f"it cannot be kept text: leave the token out")
    assert pieces is not None
    return [t for text, is_message in pieces for t in _ids(tokenizer, text, split=is_message)]


def _pieces(rendered: str, texts: dict[int, str]) -> list[tuple[str, bool]] | None:
    """``rendered`` cut at each message's marker, in order, into (text, a message's text)
    pieces, the message's text in its marker's place; None unless each marker is there once."""
    pieces: list[tuple[str, bool]] = []
    rest = rendered
    for i, text in texts.items():
        before, sep, rest = rest.partition(_MARK.format(i))
        if not sep or _MARK.format(i) in rest:  # ``before`` cannot hold it: the first one
            return None
        pieces += [(before, False), (text, True)]
    return pieces + [(rest, False)]
