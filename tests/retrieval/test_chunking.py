from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retrieval.chunking import MIN_FILL, RETOKENIZE_SLACK, Chunk, chunk_text, tokenize

# Text made of the pieces that matter to a splitter: words, sentence / clause punctuation, line and
# paragraph breaks, runs of spaces, very long "words" (hard cuts), accents, CJK and emoji (multi-byte).
_PIECES = st.one_of(
    st.sampled_from(["the", "cat", "sat", "on", "a", "mat", "licence", "Software", "42", "x"]),
    st.sampled_from([". ", "? ", "! ", "; ", ", ", ": ", " ", "  ", "\n", "\n\n", "\n \n", "\t", ".\n"]),
    st.sampled_from(["naïve", "Übergröße", "東京都", "🙂", "👩‍💻", "—", "«quoted»", '"Yes."']),
    st.text(alphabet="abcdefghij", min_size=20, max_size=80),
    st.text(min_size=1, max_size=6),
)
TEXTS = st.lists(_PIECES, min_size=1, max_size=120).map("".join)


def check_invariants(text: str, chunks: list[Chunk], tokenizer: Any, max_tokens: int, overlap: int) -> None:
    tokens = tokenize(text, tokenizer)
    if len(tokens) == 0:
        assert chunks == []
        return
    assert chunks, "a text with tokens gives chunks"
    assert [c.id for c in chunks] == list(range(len(chunks)))
    assert chunks[0].start == 0 and chunks[-1].end == len(text)
    starts = [int(s) for s in tokens.starts]
    for k, c in enumerate(chunks):
        assert c.text == text[c.start : c.end]
        assert 1 <= c.n_tokens <= max_tokens
        # n_tokens counts the whole-text tokens that start inside the chunk (first chunk: from token 0)
        first = 0 if k == 0 else starts.index(c.start)
        last = len(starts) if k == len(chunks) - 1 else starts.index(c.end)
        assert c.n_tokens == last - first
        if k < len(chunks) - 1:
            assert c.n_tokens >= min(max_tokens, max(int(MIN_FILL * max_tokens), overlap + 1))
    for a, b in itertools.pairwise(chunks):
        assert a.start < b.start and a.end < b.end
        if overlap == 0:
            assert b.start == a.end
        else:
            assert b.start <= a.end
            shared = sum(1 for s in starts if b.start <= s < a.end)
            assert shared <= overlap
    if overlap == 0:
        assert "".join(c.text for c in chunks) == text
        assert sum(c.n_tokens for c in chunks) == len(tokens)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS, max_tokens=st.integers(8, 48), overlap_frac=st.floats(0, 0.5), use_overlap=st.booleans())
def test_chunk_invariants_target_tokenizer(
    target_tokenizer: Any, text: str, max_tokens: int, overlap_frac: float, use_overlap: bool
) -> None:
    overlap = min(int(overlap_frac * max_tokens), max_tokens // 2) if use_overlap else 0
    chunks = chunk_text(text, target_tokenizer, max_tokens=max_tokens, overlap=overlap)
    check_invariants(text, chunks, target_tokenizer, max_tokens, overlap)
    # Re-tokenizing a chunk alone may merge differently at its two edges: at most one token per edge.
    for c in chunks:
        alone = len(target_tokenizer(c.text, add_special_tokens=False)["input_ids"])
        assert alone <= max_tokens + RETOKENIZE_SLACK


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS, max_tokens=st.integers(1, 32), overlap=st.integers(0, 16))
def test_chunk_invariants_wordpiece_tokenizer(wordpiece_tokenizer: Any, text: str, max_tokens: int,
                                              overlap: int) -> None:
    overlap = min(overlap, max_tokens // 2)
    chunks = chunk_text(text, wordpiece_tokenizer, max_tokens=max_tokens, overlap=overlap)
    check_invariants(text, chunks, wordpiece_tokenizer, max_tokens, overlap)


def test_prefers_paragraph_then_sentence_then_word(target_tokenizer: Any) -> None:
    para = "This sentence is about cats. This one is about dogs, and birds too. "
    text = (para * 3).strip() + "\n\n" + (para * 3).strip() + "\n\n" + (para * 3).strip()
    n_para = len(tokenize((para * 3).strip() + "\n\n", target_tokenizer))
    chunks = chunk_text(text, target_tokenizer, max_tokens=n_para + 10)
    assert [c.text.endswith("\n\n") for c in chunks] == [True, True, False]
    # without a paragraph break in reach: cut after a sentence end
    chunks = chunk_text(text, target_tokenizer, max_tokens=30)
    assert all(c.text.rstrip(" \n").endswith((".", ",")) for c in chunks)
    assert any(c.text.rstrip().endswith(".") for c in chunks[:-1])


def test_hard_cut_inside_a_long_word(target_tokenizer: Any) -> None:
    text = "x" * 4000
    chunks = chunk_text(text, target_tokenizer, max_tokens=50)
    assert len(chunks) > 2 and "".join(c.text for c in chunks) == text
    assert all(c.n_tokens <= 50 for c in chunks)


def test_overlap_repeats_the_end_of_the_previous_chunk(target_tokenizer: Any) -> None:
    text = " ".join(f"word{i}" for i in range(400))
    chunks = chunk_text(text, target_tokenizer, max_tokens=64, overlap=16)
    for a, b in itertools.pairwise(chunks):
        shared = text[b.start : a.end]
        assert shared and a.text.endswith(shared) and b.text.startswith(shared)
        assert len(tokenize(shared, target_tokenizer)) <= 16


def test_pages_follow_the_first_token(target_tokenizer: Any) -> None:
    page_texts = ["one " * 60, "two " * 60, "three " * 60]
    text = "\n\n".join(t.strip() for t in page_texts)
    pages, pos = [], 0
    for no, t in enumerate(page_texts, start=1):
        pages.append((no, pos, pos + len(t.strip())))
        pos += len(t.strip()) + 2
    chunks = chunk_text(text, target_tokenizer, max_tokens=40, pages=pages)
    for c in chunks:
        word = c.text.split()[0]
        assert c.page == {"one": 1, "two": 2, "three": 3}[word]


def test_given_tokens_are_not_recomputed(target_tokenizer: Any) -> None:
    text = "Some text. " * 100
    tokens = tokenize(text, target_tokenizer)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("tokenizer called again")

    assert chunk_text(text, refuse, max_tokens=32, tokens=tokens) == chunk_text(text, target_tokenizer, 32)


def test_empty_and_bad_arguments(target_tokenizer: Any) -> None:
    assert chunk_text("", target_tokenizer) == []
    with pytest.raises(ValueError):
        chunk_text("abc", target_tokenizer, max_tokens=0)
    with pytest.raises(ValueError):
        chunk_text("abc", target_tokenizer, max_tokens=8, overlap=5)
