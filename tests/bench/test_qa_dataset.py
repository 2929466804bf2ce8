from __future__ import annotations

import re

import pytest

from bench.datasets import load_qa, locate


def test_every_answer_passage_is_found_once_in_its_document() -> None:
    docs = load_qa()
    assert len(docs) >= 5 and sum(len(d.questions) for d in docs) >= 40
    assert len({d.doc_id for d in docs}) == len(docs)
    for doc in docs:
        assert len(doc.text) > 8_000 and len(doc.questions) >= 6
        for q in doc.questions:
            assert doc.text[q.answer_start : q.answer_end] == q.answer_passage
            assert q.question.endswith("?") and len(q.answer_passage) > 20
    held_out = [q for d in docs for q in d.questions if q.held_out]
    assert 40 <= len(held_out) < sum(len(d.questions) for d in docs)  # a part kept out of any calibration
    assert sum(bool(q.paraphrased) for q in held_out) >= len(held_out) // 3  # worded unlike their passage


def test_locate_ignores_wrapping_and_quote_style() -> None:
    text = "It is called the\n“Lesser” license; see /usr/\nshare/doc.  Debian’s rules"
    start, end = locate(text, 'the "Lesser" license')
    assert text[start:end] == "the\n“Lesser” license"
    assert re.sub(r"\s", "", text[slice(*locate(text, "/ usr/ share/doc"))]) == "/usr/share/doc"
    assert text[slice(*locate(text, "Debian's rules"))] == "Debian’s rules"
    with pytest.raises(ValueError, match="0 times"):
        locate(text, "not there")


def test_an_answer_contains_the_gold_passage_when_it_holds_half_its_content_words() -> None:
    from bench.eta import contains_gold

    gold = "for at least three years and valid for as long as you offer spare parts or customer support"
    assert contains_gold("You must keep the offer for three years, as long as you offer spare parts.", gold)
    assert not contains_gold("You must keep the offer valid.", gold)
    assert not contains_gold("anything", "a an of to")  # a gold passage without content words matches nothing


def test_the_long_document_holds_every_gold_passage_and_the_distractors() -> None:
    from bench.datasets import DECODING_DOCS, passage_pattern
    from bench.long_doc import long_document

    text, questions = long_document()
    assert len(questions) == sum(len(d.questions) for d in load_qa() if d.doc_id in DECODING_DOCS) == 50
    assert len(text) > 150_000 and "The Artistic License" in text and "Version 2, June 1991" in text
    for q in questions:  # whatever the distractors repeat, a gold passage is found in its own text
        assert passage_pattern(q.passage).search(text) is not None
