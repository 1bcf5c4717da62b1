"""The drift measures a lossy benchmark reports: token match against a reference output, and a
task score (ROUGE-L F1 on words) against Spec-Bench's reference answers."""

import json
from pathlib import Path

import pytest

from edgespec_cli.bench.drift import first_reference, rouge_l_f1, task_score, token_match_rate

QUESTIONS = Path(__file__).resolve().parent.parent / "edgespec_cli" / "bench" / \
    "spec_bench_questions.jsonl"


def test_token_match_rate_is_position_wise_over_the_reference():
    assert token_match_rate([1, 2, 3], [1, 2, 3]) == 1.0
    assert token_match_rate([1, 9, 3, 4], [1, 2, 3, 4]) == 0.75
    assert token_match_rate([1, 2], [1, 2, 3, 4]) == 0.5  # a short output misses the rest
    assert token_match_rate([1, 2, 3, 4, 5], [1, 2]) == 1.0  # extra tokens are not counted
    assert token_match_rate([2, 3, 4], [1, 2, 3]) == 0.0  # shifted: no position matches
    assert token_match_rate([], []) == 1.0 and token_match_rate([1], []) == 0.0


def test_rouge_l_f1_on_words():
    assert rouge_l_f1("The cat sat on the mat.", "the cat sat on the mat") == 1.0
    # LCS "the cat on the mat" = 5 of 6 words each side
    assert rouge_l_f1("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    assert rouge_l_f1("dogs bark", "the cat sat") == 0.0
    assert rouge_l_f1("", "anything") == 0.0
    # order matters: a common subsequence, not a bag of words
    assert rouge_l_f1("a b c d", "d c b a") == pytest.approx(0.25)


def test_task_score_takes_the_best_of_several_references():
    refs = [["data", "control and signaling information"]]
    assert task_score("It carries control and signaling information.", refs) == \
        pytest.approx(rouge_l_f1("It carries control and signaling information.",
                                 "control and signaling information"))
    assert task_score("anything", "") == 0.0 and task_score("anything", None) == 0.0
    assert task_score("the answer is 1000", "#### 1000") > task_score("the answer is 7",
                                                                       "#### 1000")


def test_first_reference_reads_spec_bench_questions():
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines()]
    by_cat = {}
    for q in questions:
        by_cat.setdefault(q["category"], []).append(first_reference(q))
    assert all(isinstance(r, str) and r for r in by_cat["summarization"])
    assert all(isinstance(r, list) for r in by_cat["rag"])
    assert all(r is None for r in by_cat["qa"])  # Spec-Bench's qa has no references
    assert first_reference({"reference": ["", "second turn only"]}) is None
    assert first_reference({}) is None
