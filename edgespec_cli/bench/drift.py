"""How far a lossy run drifts: output against a reference, for ``--verify loose`` benchmarks.

``token_match_rate`` compares token ids position by position with a reference output (the
exact run's): 1.0 means identical. ``task_score`` scores a text against a Spec-Bench reference
answer with ROUGE-L F1 over lower-cased words, so that a loose run's quality can be set beside
the exact run's on the same questions. Spec-Bench gives references per turn (a list of strings;
``rag`` gives a list of acceptable answers per turn; an empty string means none):
``first_reference`` picks the first turn's.
"""

from __future__ import annotations

import re

_WORD = re.compile(r"\w+", re.UNICODE)


def token_match_rate(out: list[int], ref: list[int]) -> float:
    """Fraction of the reference's positions where ``out`` has the same token (a shorter
    ``out`` misses the rest). An empty reference matches only an empty output."""
    if not ref:
        return 1.0 if not out else 0.0
    return sum(1 for a, b in zip(out, ref) if a == b) / len(ref)


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _lcs_length(a: list[str], b: list[str]) -> int:
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l_f1(text: str, reference: str) -> float:
    """ROUGE-L F1 of ``text`` against ``reference`` on lower-cased words."""
    a, b = words(text), words(reference)
    if not a or not b:
        return 0.0
    lcs = _lcs_length(a, b)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)


def task_score(text: str, reference) -> float:
    """ROUGE-L F1 against ``reference``: a string, or a (nested) list of acceptable answers,
    scored against the best of them. No usable reference: 0.0."""
    refs = [r for r in _flatten(reference) if r.strip()]
    return max((rouge_l_f1(text, r) for r in refs), default=0.0)


def first_reference(question: dict):
    """The reference of a Spec-Bench question's first turn, or None when it has none."""
    ref = question.get("reference")
    if isinstance(ref, list):
        ref = ref[0] if ref else None
    return ref if [r for r in _flatten(ref) if r.strip()] else None


def _flatten(ref) -> list[str]:
    if isinstance(ref, str):
        return [ref]
    if isinstance(ref, (list, tuple)):
        return [s for r in ref for s in _flatten(r)]
    return []
