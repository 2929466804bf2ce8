"""BM25 postings and scoring (retrieval/lexical.py) on literal examples, and passage windows."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.chunking import Chunk, passage_spans
from retrieval.errors import RetrievalError
from retrieval.lexical import LEXICAL_FILE, LexicalIndex, bm25_scores, terms

DOC_A = ["the cat sat on the mat", "a dog chased the cat", "licence fees are waived"]
DOC_B = ["the dog sleeps", "sublicensing requires written consent from the licensor"]


def test_terms_lowercase_drop_stop_words_and_single_characters() -> None:
    assert terms("The Cat sat on a mat, and I sat too: x-ray 2024!") == ["cat", "sat", "mat", "sat", "ray", "2024"]
    assert terms("") == [] and terms("the of and") == []
    assert terms("Größe café") == ["größe", "café"]  # unicode word characters


def test_bm25_on_a_literal_example() -> None:
    ix = LexicalIndex.build(DOC_A)
    [scores] = bm25_scores("cat", [ix])
    # by hand: 3 chunks of 3 terms each ("on", "the", "a", "are" are stop words), "cat" once in 2 of them:
    # idf = ln(1 + (3 - 2 + 0.5) / (2 + 0.5)), tf part = 1 * 2.2 / (1 + 1.2 * (0.25 + 0.75 * 3 / 3)) = 1,
    # divided by the most a chunk could score, idf * (k1 + 1)
    assert [ix.n_chunks, *ix.lengths] == [3, 3, 3, 3]
    assert scores[:2] == pytest.approx([1 / 2.2, 1 / 2.2], rel=1e-6)
    [two] = bm25_scores("cat licence", [ix])  # one term of two matched: its share of the two terms' ceiling
    idf_cat, idf_licence = math.log(1 + 1.5 / 2.5), math.log(1 + 2.5 / 1.5)
    assert two[0] == pytest.approx(idf_cat / (2.2 * (idf_cat + idf_licence)), rel=1e-6)
    assert scores[2] == 0.0
    assert np.all((scores >= 0) & (scores < 1))


def test_statistics_are_those_of_all_the_documents_asked() -> None:
    """Two documents scored together rank exactly as one document holding both's chunks."""
    apart = bm25_scores("dog licensor consent", [LexicalIndex.build(DOC_A), LexicalIndex.build(DOC_B)])
    [together] = bm25_scores("dog licensor consent", [LexicalIndex.build(DOC_A + DOC_B)])
    np.testing.assert_allclose(np.concatenate(apart), together, rtol=1e-6)
    # DOC_B alone: "dog" and "consent" are each in 1 of 2 chunks, the shorter chunk ("dog sleeps") wins;
    # with DOC_A, "dog" is in 2 of 5 chunks and "consent" in 1: the rarer term's chunk wins
    [alone] = bm25_scores("dog consent", [LexicalIndex.build(DOC_B)])
    _, with_a = bm25_scores("dog consent", [LexicalIndex.build(DOC_A), LexicalIndex.build(DOC_B)])
    assert alone[0] > alone[1] > 0 and with_a[1] > with_a[0] > 0


def test_rare_terms_outweigh_common_ones_and_unknown_terms_lower_every_score() -> None:
    ix = LexicalIndex.build(DOC_A + DOC_B)
    [scores] = bm25_scores("sublicensing the dog", [ix])
    assert int(np.argmax(scores)) == 4  # the one chunk holding the rare term
    [with_unknown] = bm25_scores("sublicensing the dog zeppelin", [ix])
    assert np.all(with_unknown <= scores) and with_unknown[4] < scores[4]
    assert np.all(bm25_scores("the of and", [ix])[0] == 0)  # only stop words
    assert [len(s) for s in bm25_scores("cat", [])] == []


def test_save_load_round_trip_and_a_corrupt_file(tmp_path: Path) -> None:
    ix = LexicalIndex.build(DOC_A)
    ix.save(tmp_path)
    again = LexicalIndex.load(tmp_path)
    for name in ("vocab", "ptr", "chunk_ids", "counts", "lengths"):
        np.testing.assert_array_equal(getattr(again, name), getattr(ix, name))
    np.testing.assert_array_equal(bm25_scores("cat mat", [again])[0], bm25_scores("cat mat", [ix])[0])
    empty = LexicalIndex.build(["", "the"])  # chunks without terms
    empty.save(tmp_path / "empty")
    assert LexicalIndex.load(tmp_path / "empty").n_chunks == 2
    (tmp_path / LEXICAL_FILE).write_bytes(b"not an npz file")
    with pytest.raises(RetrievalError, match="unreadable"):
        LexicalIndex.load(tmp_path)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["alpha", "beta", "  ", "\n\n", "gamma.", "δ"]), min_size=0, max_size=300),
       st.integers(0, 50))
def test_passage_windows_cover_the_chunk_in_overlapping_runs_of_words(words: list[str], offset: int) -> None:
    text = " ".join(words)
    chunk = Chunk(id=0, text=text, start=offset, end=offset + len(text), n_tokens=1)
    spans = passage_spans(chunk, words=6, stride=3)
    assert spans and all(offset <= a <= b <= offset + len(text) for a, b in spans)
    found = text.split()
    if not found:
        assert spans == [(offset, offset + len(text))]
        return
    windows = [text[a - offset : b - offset].split() for a, b in spans]
    assert all(1 <= len(w) <= 6 for w in windows)
    assert windows[0][0] == found[0] and windows[-1][-1] == found[-1]
    covered = set()
    for a, b in spans:  # every word lies in some window
        covered.update(i for i, m in enumerate(_word_starts(text)) if a - offset <= m < b - offset)
    assert covered == set(range(len(found)))
    starts = [a for a, _ in spans]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)


def _word_starts(text: str) -> list[int]:
    import re

    return [m.start() for m in re.finditer(r"\S+", text)]
