"""Citations attributed after generation: which listed source supports each sentence of an answer.

A small target model does not cite its sources reliably, so the answer is never asked to; once it is
generated, each of its sentences is matched against the sources' texts and cited when one of them supports
it well enough. Support is lexical: the share of the sentence's content words (stop words left out, a plural
``s`` folded) that the source holds, each word weighted by how distinctive it is among the listed sources
(a word every source holds says little about which one the sentence came from). A sentence is cited only
when its best source holds at least ``MIN_SUPPORT`` of that weight and ``MIN_SHARED`` distinct content words:
no citation is better than a wrong one. Ties go to the better-ranked source.

The answer itself is never changed (decoding stays lossless: citations are metadata). What comes out:
each cited sentence's span in the answer and its source index, the answer with ``[n]`` markers after the
cited sentences (n = the source's 1-based position), and per source the spans of its text to highlight:
for each sentence citing it, the source sentence sharing the most of that sentence's weighted content
words. Spans are character offsets (Python string indices) that always start and end on whole words.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from app.schemas import Citation, Citations, Source

# least weighted share of a sentence's content words its source must hold: chosen by `python -m bench.citations`
# (bench/results/citations.json: the most sentences cited with no off-topic sentence cited on the QA set)
MIN_SUPPORT = 0.5
MIN_SHARED = 2  # least number of distinct content words a sentence shares with its source
MAX_PASSAGES = 3  # most sentences of a source highlighted for one sentence of the answer

_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")
# a sentence ends at . ! ? followed by optional closing quotes/brackets and whitespace, at a blank line, or at a
# line break before a list item (a single line break inside a paragraph is hard wrapping: the sentence goes on)
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]’”»]*(?=\s|$)|\n[ \t]*\n\s*|\n(?=[ \t]*(?:[-*•]|\d+[.)])[ \t])")
STOPWORDS = frozenset(
    {
        "a", "about", "above", "after", "again", "against", "all", "also", "am", "an", "and", "any", "are", "aren't",
        "as", "at", "be", "because", "been", "before", "being", "below", "between", "both", "but", "by", "can", "could",
        "did", "do", "does", "doing", "don't", "down", "during", "each", "few", "for", "from", "further", "had", "has",
        "have", "having", "he", "her", "here", "hers", "herself", "him", "himself", "his", "how", "i", "if", "in",
        "into", "is", "isn't", "it", "it's", "its", "itself", "just", "let", "me", "more", "most", "my", "myself", "no",
        "nor", "not", "now", "of", "off", "on", "once", "only", "or", "other", "our", "ours", "ourselves", "out",
        "over", "own", "same", "she", "should", "so", "some", "such", "than", "that", "that's", "the", "their",
        "theirs", "them", "themselves", "then", "there", "these", "they", "this", "those", "through", "to", "too",
        "under", "until", "up", "very", "was", "wasn't", "we", "were", "what", "when", "where", "which", "while", "who",
        "whom", "why", "will", "with", "would", "you", "your", "yours", "yourself", "yourselves", "yes",
    }
)


@dataclass(frozen=True)
class Sentence:
    start: int
    end: int
    terms: frozenset[str]


def sentences(text: str) -> list[Sentence]:
    """The sentences of ``text`` that hold at least one word, as spans trimmed to their first and last word
    (a closing punctuation mark right after the last word stays in)."""
    out: list[Sentence] = []
    begin = 0
    for m in _SENTENCE_END.finditer(text):
        _add_sentence(text, begin, m.end(), out)
        begin = m.end()
    _add_sentence(text, begin, len(text), out)
    return out


def _add_sentence(text: str, begin: int, end: int, out: list[Sentence]) -> None:
    words = list(_WORD.finditer(text, begin, end))
    if not words:
        return
    start = words[0].start()
    stop = begin + len(text[begin:end].rstrip())  # keeps the closing punctuation, drops line breaks
    terms = frozenset(t for t in (_term(w.group()) for w in words) if t)
    out.append(Sentence(start, stop, terms))


def _term(word: str) -> str:
    """A content word's normal form ('' for a stop word): lower case, a possessive or plural s dropped."""
    w = word.lower().replace("’", "'")
    if w in STOPWORDS:
        return ""
    if w.endswith("'s"):
        w = w[:-2]
    if len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
        w = w[:-1]
    return w


def terms_of(text: str) -> frozenset[str]:
    return frozenset(t for t in (_term(m.group()) for m in _WORD.finditer(text)) if t)


def _weights(source_terms: Sequence[frozenset[str]]) -> dict[str, float]:
    """Inverse document frequency of each term over the sources (a term no source holds weighs the most)."""
    n = len(source_terms)
    df: dict[str, int] = {}
    for terms in source_terms:
        for t in terms:
            df[t] = df.get(t, 0) + 1
    return {t: math.log(1 + (n + 1) / (k + 1)) for t, k in df.items()}


def _absent_weight(n_sources: int) -> float:
    return math.log(1 + (n_sources + 1))


@dataclass(frozen=True)
class Attribution:
    """Cited sentences (answer span, source index, support) and per source the spans of its text to
    highlight."""

    citations: list[tuple[int, int, int, float]]
    highlights: list[list[tuple[int, int]]]


def attribute(answer: str, texts: Sequence[str]) -> Attribution:
    """Cite each sentence of ``answer`` to the one of ``texts`` (the sources, best first) that supports it
    best, when it does well enough (see the module docstring)."""
    source_terms = [terms_of(t) for t in texts]
    weights = _weights(source_terms)
    absent = _absent_weight(len(texts))
    citations: list[tuple[int, int, int, float]] = []
    chosen: list[set[tuple[int, int]]] = [set() for _ in texts]
    source_sentences: dict[int, list[Sentence]] = {}
    for sentence in sentences(answer):
        total = sum(weights.get(t, absent) for t in sentence.terms)
        if total <= 0:
            continue
        best, best_support = -1, 0.0
        for j, terms in enumerate(source_terms):
            shared = sentence.terms & terms
            if len(shared) < MIN_SHARED:
                continue
            support = sum(weights[t] for t in shared) / total
            if support > best_support:
                best, best_support = j, support
        if best < 0 or best_support < MIN_SUPPORT:
            continue
        citations.append((sentence.start, sentence.end, best, round(min(best_support, 1.0), 4)))
        if best not in source_sentences:
            source_sentences[best] = sentences(texts[best])
        chosen[best].update(supporting_passages(sentence.terms, source_sentences[best]))
    return Attribution(citations=citations, highlights=[sorted(spans) for spans in chosen])


def supporting_passages(terms: frozenset[str], candidates: Sequence[Sentence]) -> list[tuple[int, int]]:
    """Spans of the fewest candidate sentences (at most ``MAX_PASSAGES``) that hold the words of ``terms``:
    greedily the sentence holding the most weight of the words not yet held, while it adds at least
    ``MIN_SHARED`` of them. Words are weighted by how rare they are among the candidates, so the sentence that
    holds a claim's specific words (a date, a name) wins over one that repeats the document's subject."""
    n = len(candidates)
    df: dict[str, int] = {}
    for c in candidates:
        for t in c.terms & terms:
            df[t] = df.get(t, 0) + 1
    weight = {t: math.log(1 + n / k) for t, k in df.items()}
    left = set(terms)
    spans: list[tuple[int, int]] = []
    while len(spans) < MAX_PASSAGES:
        best, best_weight, best_new = None, 0.0, 0
        for c in candidates:
            new = c.terms & left
            w = sum(weight[t] for t in new)
            if w > best_weight:
                best, best_weight, best_new = c, w, len(new)
        if best is None or best_new < min(MIN_SHARED, len(terms)):
            break
        spans.append((best.start, best.end))
        left -= best.terms
    return spans


def with_markers(answer: str, citations: Sequence[tuple[int, int, int, float]]) -> str:
    """``answer`` with ``[n]`` (n = source index + 1) right after each cited sentence."""
    pieces: list[str] = []
    last = 0
    for _start, end, source, _support in sorted(citations, key=lambda c: c[1]):
        pieces.append(answer[last:end])
        pieces.append(f"[{source + 1}]")
        last = end
    pieces.append(answer[last:])
    return "".join(pieces)


def cite(answer: str, sources: Sequence[Source]) -> Citations:
    """The citations of ``answer`` over ``sources``; also sets each source's ``highlights``."""
    found = attribute(answer, [s.text for s in sources])
    for source, spans in zip(sources, found.highlights, strict=True):
        source.highlights = spans
    return Citations(
        citations=[Citation(start=a, end=b, source=j, support=s) for a, b, j, s in found.citations],
        cited_answer=with_markers(answer, found.citations),
        highlights=found.highlights,
    )
