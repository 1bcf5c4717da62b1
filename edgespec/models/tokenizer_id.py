"""Whether two tokenizers give token ids the same meaning, without torch (a board computes the
fingerprint it registers with from its drafter's tokenizer)."""

from __future__ import annotations

import hashlib
import json

from ..config import ConfigError


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary and special tokens: equal hashes mean interchangeable ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    blob = json.dumps([vocab, special], ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def check_same_tokenizer(target_tok, draft_tok, draft_name: str) -> None:
    """Refuse a draft model whose token ids do not mean what the target's mean."""
    a, b = tokenizer_fingerprint(target_tok), tokenizer_fingerprint(draft_tok)
    if a != b:
        raise ConfigError(
            f"draft model {draft_name!r} uses a different tokenizer than the target "
            f"(fingerprint {b} vs {a}); speculative decoding needs the same vocabulary"
        )
