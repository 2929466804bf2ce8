"""Token-aware chunking with recursive separators (RAPID: ~512-token chunks with character offsets).

The text is tokenized ONCE with the target's fast tokenizer (``return_offsets_mapping``); every chunk
boundary is the start of a token of that one tokenization, so a chunk's token count is exact with
respect to the whole-text tokens and never above ``max_tokens``.

Split points are chosen like a recursive splitter, level by level: paragraph (blank line), line,
sentence end (``. ? !`` + space), clause (``; ,`` + space), word (space) and finally any token
boundary (hard cut). For each chunk we look at the token boundaries that would give it between
``MIN_FILL * max_tokens`` and ``max_tokens`` tokens and take the last one of the best level present.
Chunks therefore hold at least half the budget (except the last), and split on the strongest
separator available in that range.

Invariants (tested with hypothesis):
- ``n_tokens`` (whole-text tokens whose start lies in the chunk) <= ``max_tokens`` (for ``max_tokens`` >= 8:
  a byte-level tokenizer may split one character into up to 4 tokens that cannot be separated);
- re-tokenizing ``chunk.text`` alone gives at most ``max_tokens + RETOKENIZE_SLACK`` tokens (a cut can
  make the tokenizer merge differently at the chunk's two edges);
- spans are in order and cover the text: the first starts at 0, the last ends at ``len(text)``, and with
  ``overlap == 0`` each chunk starts where the previous one ended; with overlap each chunk starts inside
  the previous one, at most ``overlap`` tokens before its end (at the first word boundary from there).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from retrieval.parsing import PageSpan

MIN_FILL = 0.5  # a chunk (not the last) holds at least this fraction of max_tokens
RETOKENIZE_SLACK = 2  # extra tokens re-tokenizing a chunk alone may give (one per edge)

# Separator levels, best first; NONE is a hard cut at any token boundary.
PARAGRAPH, LINE, SENTENCE, CLAUSE, WORD, NONE = range(6)
_SENTENCE_END = ".?!"
_CLAUSE_END = ";,:"
_CLOSERS = "\"')]}»”’"


class Tokenizer(Protocol):
    """What we need of an HF fast tokenizer."""

    def __call__(self, text: str, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class Chunk:
    """A span ``text[start:end]`` of the document holding ``n_tokens`` target tokens."""

    id: int
    text: str
    start: int
    end: int
    n_tokens: int
    page: int | None = None
    page_end: int | None = None  # PDFs: the page of the chunk's last character (= page within one page)


@dataclass(frozen=True)
class TokenizedText:
    """One tokenization of a whole text: ids and character offsets per token (no special tokens)."""

    ids: np.ndarray  # [n] int32
    starts: np.ndarray  # [n] int64 char offsets
    ends: np.ndarray  # [n] int64

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def tokenize(text: str, tokenizer: Tokenizer) -> TokenizedText:
    """Tokenize ``text`` once with offsets (HF fast tokenizer), without special tokens."""
    enc = tokenizer(
        text, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False,
        return_token_type_ids=False, verbose=False,
    )
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)  # [n, 2]
    return TokenizedText(ids=ids, starts=offsets[:, 0].copy(), ends=offsets[:, 1].copy())


def chunk_text(
    text: str,
    tokenizer: Tokenizer,
    max_tokens: int = 512,
    overlap: int = 0,
    pages: list[PageSpan] | None = None,
    *,
    tokens: TokenizedText | None = None,
) -> list[Chunk]:
    """Split ``text`` into chunks of at most ``max_tokens`` target tokens (see module doc).

    ``tokens`` is the text's tokenization when the caller already has it (the store keeps the ids), so
    the text is tokenized only once. ``pages`` (PDF) gives each chunk its page range: the pages of its first
    and last visible characters (whitespace at its edges, such as the blank line between two pages, does not
    count; a blank chunk takes the page of its start).
    A text without any token (empty, or whitespace for some tokenizers) gives no chunk.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not 0 <= overlap <= max_tokens // 2:
        raise ValueError(f"overlap must be in [0, max_tokens // 2], got {overlap} with max_tokens={max_tokens}")
    if tokens is None:
        tokens = tokenize(text, tokenizer)
    n = len(tokens)
    if n == 0:
        return []
    starts = tokens.starts
    levels = boundary_levels(text, tokens)  # [n + 1]; level of cutting before token j
    page_starts = [start for _no, start, _end in pages] if pages else []

    spans: list[tuple[int, int]] = []  # token index ranges [i, j)
    i = j = 0
    while True:
        if n - i <= max_tokens:
            spans.append((i, n))
            break
        hi = i + max_tokens
        lo = min(hi, i + max(int(MIN_FILL * max_tokens), overlap + 1, 1))
        j = _best_cut(levels, max(i, j), lo, hi)  # past the previous cut: no chunk inside another
        spans.append((i, j))
        # the next chunk starts after this one's start (always progress), at most `overlap` tokens back
        i = _next_start(levels, max(j - overlap, i + 1), j) if overlap and j - i > 1 else j

    chunks: list[Chunk] = []
    for cid, (i, j) in enumerate(spans):
        start = 0 if i == 0 else int(starts[i])
        end = len(text) if j == n else int(starts[j])
        page = page_end = None
        if pages:
            page, page_end = _page_range(pages, page_starts, text, start, end)
        chunks.append(
            Chunk(id=cid, text=text[start:end], start=start, end=end, n_tokens=j - i, page=page, page_end=page_end)
        )
    return chunks


def _page_range(pages: list[PageSpan], page_starts: list[int], text: str, start: int, end: int) -> tuple[int, int]:
    """Pages of the first and last non-whitespace characters of ``text[start:end]``."""
    piece = text[start:end]
    first = start + (len(piece) - len(piece.lstrip()))
    last = start + len(piece.rstrip()) - 1
    if last < first:  # nothing but whitespace
        first = last = start

    def page_at(pos: int) -> int:
        return pages[max(bisect.bisect_right(page_starts, pos) - 1, 0)][0]

    return page_at(first), page_at(last)


def _best_cut(levels: np.ndarray, floor: int, lo: int, hi: int) -> int:
    """Last token boundary in [lo, hi] of the best (lowest) level present.

    Only when no boundary there is allowed (a character split into more tokens than the window is
    wide; byte-level tokenizers split a character into at most 4 tokens, and the window holds at least
    ``max_tokens // 2`` boundaries, so this needs ``max_tokens`` < 8) we take the last allowed one in
    (floor, lo), and failing that the first after ``hi`` (that chunk then exceeds ``max_tokens``).
    """
    window = levels[lo : hi + 1]
    best = window.min()
    if best <= NONE:
        return lo + int(len(window) - 1 - np.argmax(window[::-1] == best))  # last index of `best`
    before = np.flatnonzero(levels[floor + 1 : lo] <= NONE)
    if before.size:
        return floor + 1 + int(before[-1])
    after = np.flatnonzero(levels[hi + 1 :] <= NONE)
    return hi + 1 + int(after[0]) if after.size else len(levels) - 1


def _next_start(levels: np.ndarray, lo: int, hi: int) -> int:
    """Start of the next chunk with overlap: the earliest word (or better) boundary in [lo, hi), so the
    overlap stays close to the configured one; any valid boundary when there is none."""
    window = levels[lo:hi]
    good = window <= WORD
    if good.any():
        return lo + int(np.argmax(good))
    allowed = window <= NONE
    return lo + int(np.argmax(allowed)) if allowed.any() else hi


def boundary_levels(text: str, tokens: TokenizedText) -> np.ndarray:
    """Separator level of cutting before token j, for j in 0..n (index n = end of text). [n + 1] int8.

    A boundary's level comes from the whitespace run around the cut position (tokenizers differ in
    whether spaces belong to the token before, after, or none): a run holding a blank line is a
    paragraph break, one holding a newline a line break, one after ``. ? !`` a sentence end, after
    ``; , :`` a clause end, any other run a word break. A cut inside a token, or at a position two tokens
    share, is never allowed (level NONE + 1).
    """
    n = len(tokens)
    starts, ends = tokens.starts, tokens.ends
    levels = np.full(n + 1, NONE, dtype=np.int8)
    levels[0] = levels[n] = PARAGRAPH
    if n < 2:
        return levels
    cut = starts[1:]  # [n - 1] char position of the cut before token j = 1..n-1
    valid = (starts[1:] > starts[:-1]) & (ends[:-1] <= starts[1:])

    runs = [(m.start(), m.end()) for m in re.finditer(r"\s+", text)]
    if runs:
        run_start = np.fromiter((a for a, _ in runs), dtype=np.int64, count=len(runs))
        run_end = np.fromiter((b for _, b in runs), dtype=np.int64, count=len(runs))
        run_level = np.array([_run_level(text, a, b) for a, b in runs], dtype=np.int8)
        k = np.searchsorted(run_end, cut, side="left")  # first run ending at or after the cut
        k_clip = np.minimum(k, len(runs) - 1)
        inside = (k < len(runs)) & (run_start[k_clip] <= cut)
        levels[1:n] = np.where(inside, run_level[k_clip], NONE)
    levels[1:n] = np.where(valid, levels[1:n], NONE + 1)
    return levels


def _run_level(text: str, a: int, b: int) -> int:
    run = text[a:b]
    newlines = run.count("\n")
    if newlines >= 2:
        return PARAGRAPH
    if newlines == 1:
        return LINE
    k = a - 1
    while k >= 0 and text[k] in _CLOSERS:
        k -= 1
    before = text[k] if k >= 0 else ""
    if before and before in _SENTENCE_END:
        return SENTENCE
    if before and before in _CLAUSE_END:
        return CLAUSE
    return WORD


PASSAGE_WORDS = 60
PASSAGE_STRIDE = 30
_WORD = re.compile(r"\S+")


def passage_spans(chunk: Chunk, words: int = PASSAGE_WORDS, stride: int = PASSAGE_STRIDE) -> list[tuple[int, int]]:
    """Document character spans of overlapping windows of ``words`` words, ``stride`` words apart, covering the
    chunk (at least one, even for a chunk without words). A chunk's dense score is its best window's: one
    vector for a whole 512-token chunk averages its sentences away, and the question is about one of them."""
    found = [(m.start(), m.end()) for m in _WORD.finditer(chunk.text)]
    if not found:
        return [(chunk.start, chunk.end)]
    spans = []
    for first in range(0, max(len(found) - words, 0) + 1, stride):
        last = min(first + words, len(found)) - 1
        spans.append((chunk.start + found[first][0], chunk.start + found[last][1]))
    if spans[-1][1] != chunk.start + found[-1][1]:  # the last stride did not reach the chunk's last word
        spans.append((chunk.start + found[max(len(found) - words, 0)][0], chunk.start + found[-1][1]))
    return spans
