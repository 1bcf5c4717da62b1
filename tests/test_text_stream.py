"""``TextStream``, committed tokens to text increments: however the tokens come in chunks, the
reader has their text up to its last whole character after each chunk and the whole output's
text after ``flush``; a stream resumed after any token knows what its reader has (no text
repeated or lost when a break falls inside a multi-byte character); a tokenizer that cleans up
spaces does not make a stream rewrite what it wrote. On a byte-level tokenizer (one token a
byte: every multi-byte character spans tokens) and a byte-fallback one (Llama's and Mistral's
kind: a character out of the vocabulary is a run of byte tokens, decoded together)."""

from __future__ import annotations

import random

import pytest

from edgespec.models.text_stream import PARTIAL, TextStream

TEXT = "Tokyo is 東京 in Japanese 😀, ok: naïve café — ¿qué? ∑x² 𝔘 😀😀 𠀀𠀁 🎉🎉🎉 end"


@pytest.fixture(scope="module")
def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "<|end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="<|end|>", pad_token="<|end|>")


@pytest.fixture(scope="module")
def fallback_tokenizer():
    import string

    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"] + \
        list(string.ascii_letters + string.digits + ".,!?:")
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


@pytest.fixture(params=["byte-level", "byte-fallback"])
def tokenizer(request, byte_tokenizer, fallback_tokenizer):
    return byte_tokenizer if request.param == "byte-level" else fallback_tokenizer


def _chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        out.append(ids[i:i + n])
        i += n
    return out


def _in_one_chunk(tok, ids) -> str:
    got: list[str] = []
    TextStream(tok, got.append)(list(ids))
    return "".join(got)


def _token_by_token(tok, ids) -> str:
    """What a reader has after a stream fed ``ids`` one at a time, then flushed."""
    got: list[str] = []
    stream = TextStream(tok, got.append)
    for i in ids:
        stream([i])
    stream.flush()
    return "".join(got)


def _decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_the_reader_has_the_text_up_to_its_last_whole_character_however_chunked(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    text = _decode(tokenizer, ids)
    assert len(ids) > len(TEXT) and text == TEXT  # multi-byte characters span tokens
    for seed in range(12):
        got: list[str] = []
        stream, n = TextStream(tokenizer, got.append), 0
        for chunk in [[i] for i in ids] if seed == 0 else _chunks(ids, random.Random(seed)):
            stream(chunk)
            n += len(chunk)
            assert "".join(got) == _in_one_chunk(tokenizer, ids[:n])  # not how they came
            assert text.startswith("".join(got))
        stream.flush()
        assert "".join(got) == TEXT


def test_a_stream_resumed_after_any_token_repeats_and_loses_nothing(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    for cut in range(1, len(ids)):
        rng = random.Random(cut)
        got: list[str] = []
        first = TextStream(tokenizer, got.append)
        for chunk in _chunks(ids[:cut], rng):
            first(chunk)
        resumed = TextStream(tokenizer, got.append, ids[:cut])  # what the reader has
        for chunk in _chunks(ids[cut:], rng):
            resumed(chunk)
        resumed.flush()
        assert "".join(got) == TEXT, cut


def test_an_output_ending_mid_character_is_whole_after_flush(byte_tokenizer):
    ids = byte_tokenizer("ok 東", add_special_tokens=False)["input_ids"][:-1]  # 東's last byte cut
    got: list[str] = []
    stream = TextStream(byte_tokenizer, got.append)
    stream(ids)
    assert "".join(got) == "ok "
    stream.flush()
    assert "".join(got) == _decode(byte_tokenizer, ids) and got[-1].endswith(PARTIAL)
    # a stream resumed after the last token (it gets none new): the held-back tail alone
    tail: list[str] = []
    TextStream(byte_tokenizer, tail.append, ids).flush()
    assert "ok " + "".join(tail) == _decode(byte_tokenizer, ids)


def test_a_tokenizer_that_cleans_up_spaces_does_not_make_the_stream_rewrite_its_text():
    from conftest import make_tokenizer

    tok = make_tokenizer()
    tok.clean_up_tokenization_spaces = True
    ids = tok("it is Bob 's , ok .", add_special_tokens=False)["input_ids"]
    assert _token_by_token(tok, ids) == _decode(tok, ids) == "it is Bob 's , ok ."


def test_a_window_never_starts_on_skipped_special_tokens(fallback_tokenizer):
    """Six skipped special tokens in a row: a window starting on them would decode the next
    word as a text's first, its leading space dropped."""
    tok = fallback_tokenizer
    bos = tok.convert_tokens_to_ids("<s>")
    ids = tok("hello", add_special_tokens=False)["input_ids"] + [bos] * 6 + \
        tok(" world", add_special_tokens=False)["input_ids"][1:]
    assert _token_by_token(tok, ids) == _decode(tok, ids) == "hello world"


def test_a_long_run_held_back_is_written_and_the_window_moves_on(byte_tokenizer):
    """Text held back for good (U+FFFD after U+FFFD, as a model that emits invalid bytes
    writes) is written once the window passes ``MAX_WINDOW`` tokens, and the window moves on:
    each call decodes a bounded window, not the whole output."""
    from edgespec.models.text_stream import MAX_WINDOW

    bad = byte_tokenizer("\ufffd", add_special_tokens=False)["input_ids"]
    ids = byte_tokenizer("ok ", add_special_tokens=False)["input_ids"] + bad * 400
    got: list[str] = []
    stream = TextStream(byte_tokenizer, got.append)
    for i in ids:
        stream([i])
        assert len(stream.ids) - stream.window_start <= MAX_WINDOW + 1
    stream.flush()
    assert "".join(got) == _decode(byte_tokenizer, ids)
