"""bench.cluster's own logic (the measured run starts a real cluster: ``python -m bench.cluster``): its documents
are reproducible and its equality check fails when any question got two texts or the configurations differ."""

from __future__ import annotations

from bench.cluster import TOPICS, answers_agree, document


def test_documents_are_reproducible_and_mention_every_topic() -> None:
    assert document(1, 1100) == document(1, 1100) != document(2, 1100)
    assert all(topic in document(0, 1100) for topic in TOPICS)


def test_answers_agree_only_with_one_text_per_question_in_both() -> None:
    one = {"0:q": ["a"], "1:q": ["b"]}
    assert answers_agree(one, {"0:q": ["a"], "1:q": ["b"]})
    assert not answers_agree(one, {"0:q": ["a"], "1:q": ["c"]})
    assert not answers_agree({"0:q": ["a", "a2"]}, {"0:q": ["a", "a2"]})  # two texts for one question
    assert not answers_agree(one, {"0:q": ["a"]})  # a question missing
    assert not answers_agree({}, {})
