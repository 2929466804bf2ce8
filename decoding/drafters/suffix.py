"""Suffix drafting: the continuation of the longest exact match of the text's end, over everything the answer
may copy (SuffixDecoding's and SAM-Decoding's idea, kept to what pays on a CPU).

A RAG answer copies its document in spans: once the last few tokens of the answer occur in the prompt (or in
the answer itself, or in an earlier answer over the same document), what followed there is very likely what
comes next, and the longer the match, the likelier (docs/benchmarks.md#decoding has the rates). So each step drafts
one chain: the tokens after the most recent occurrence of the longest suffix of the text, and labels every
node with the match length it would stand on (``suffix/m3``...). The engine's budget policy learns each
label's acceptance and cuts the chain where one more verified row stops paying (``decoding.speculative.budget``):
long where the match is long, nothing where it is one token and a row is dear.

``SuffixIndex`` keeps the match incrementally: when the text goes on the way the match's occurrence went on,
the match grows by one token for free; otherwise one vectorised search over the text (numpy, O(n) with a
small constant) finds the new longest match. The text is a growing int32 buffer, so a step costs tens of
microseconds on an 8K-token prompt.

Earlier answers (other sessions of the same tenant over the same documents, kept whole by the cross-session
tier: ``CrossSessionCache.answers``) are a second haystack, searched the same way with the text's end as the
pattern; their chains carry the source ``suffix.session`` so their acceptance is learned apart. Where a question
is asked again word for word the earlier answer is one long match; a paraphrased one retraces stretches of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from decoding.speculative.drafter import BaseDrafter, DraftRequest, PromptInfo
from decoding.speculative.tree import ROOT, DraftTree

if TYPE_CHECKING:
    from decoding.drafters.racer.cross_session import CrossSessionCache

SOURCE_TEXT = "suffix"
SOURCE_SESSION = "suffix.session"
SEPARATOR = -1  # between the answers of a corpus: no match or continuation runs across it
MATCH_BUCKETS = (1, 2, 3, 4, 6, 9, 16)  # match lengths that label drafted nodes (their acceptance differs)


def match_prior(length: int) -> float:
    """What a drafter may expect of a node standing on a match of ``length`` tokens before any is verified:
    rising with the length (a longer exact match is likelier to go on), deliberately below what documents
    show, so the engine's own measurements lift it."""
    return length / (length + 2.5)


def suffix_priors(source: str) -> dict[str, float]:
    """The budget policy's priors for every label of ``source`` at every depth it keys (1, 2, 3+)."""
    return {f"{source}/m{b}@{d}": match_prior(b) for b in MATCH_BUCKETS for d in (1, 2, 3)}


def match_label(length: int) -> int:
    """The bucket a match length falls in (the largest bucket bound not above it)."""
    label = MATCH_BUCKETS[0]
    for b in MATCH_BUCKETS:
        if length >= b:
            label = b
    return label


def longest_suffix(hay: np.ndarray, pattern: np.ndarray, most: int) -> tuple[int, int]:
    """The longest suffix of ``pattern`` (at most ``most`` tokens) that occurs in ``hay``: (its length, the
    position in ``hay`` just after its most recent occurrence), or (0, -1). Vectorised: the candidates are the
    positions holding the pattern's last token, narrowed one token back at a time."""
    if not len(pattern) or not len(hay):
        return 0, -1
    ends = np.flatnonzero(hay == pattern[-1])  # occurrences' last positions
    length, end = 0, -1
    while len(ends):
        length, end = length + 1, int(ends[-1]) + 1
        if length >= most or length >= len(pattern):
            break
        back = ends - length
        ends = ends[back >= 0]
        ends = ends[hay[back[back >= 0]] == pattern[-1 - length]]
    return length, end


class TokenText:
    """A growing int32 token buffer (amortised O(1) appends, numpy views for searching)."""

    def __init__(self, tokens: Sequence[int] = (), capacity: int = 1024) -> None:
        self._buf = np.empty(max(capacity, len(tokens) + 256), dtype=np.int32)
        self._n = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return self._n

    @property
    def view(self) -> np.ndarray:
        return self._buf[: self._n]

    def extend(self, tokens: Sequence[int]) -> None:
        need = self._n + len(tokens)
        if need > len(self._buf):
            grown = np.empty(max(need, 2 * len(self._buf)), dtype=np.int32)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n : need] = np.asarray(tokens, dtype=np.int32)
        self._n = need

    def __getitem__(self, i: int) -> int:
        return int(self._buf[i])


@dataclass
class Match:
    """Where the text's end occurred before: ``length`` tokens, continuing at ``text[end]`` (0, -1: none)."""

    length: int = 0
    end: int = -1


class SuffixIndex:
    """The longest match of a text's end earlier in the same text, or (``corpus``) in earlier answers, kept up
    to date as the text grows (see the module doc)."""

    def __init__(self, max_match: int = 64, corpus: Sequence[Sequence[int]] | None = None) -> None:
        self.max_match = max_match
        self.corpus: TokenText | None = None
        if corpus is not None:
            self.corpus = TokenText(capacity=sum(len(a) + 1 for a in corpus) + 1)
            for answer in corpus:
                self.corpus.extend([*answer, SEPARATOR])
        self.match = Match()
        self._seen = 0  # text tokens the match accounts for

    def update(self, text: TokenText) -> Match:
        """The match for ``text``'s end, advancing the kept one by the tokens added since the last call: while
        the text goes on as the occurrence did, the match grows (it cannot grow by more than the one token);
        after the first token that does not, one search at the end."""
        hay = text if self.corpus is None else self.corpus
        m: Match | None = self.match
        while self._seen < len(text) and m is not None:
            token = text[self._seen]
            self._seen += 1
            m = Match(min(m.length + 1, self.max_match), m.end + 1) if m.length and hay[m.end] == token else None
        if m is None:
            m = self._search(text)
            self._seen = len(text)
        self.match = m
        return m

    def _search(self, text: TokenText) -> Match:
        full = text.view
        if self.corpus is None:
            length, end = longest_suffix(full[:-1], full, self.max_match)  # an occurrence ending before the end
        else:
            length, end = longest_suffix(self.corpus.view, full[-self.max_match :], self.max_match)
        return Match(length, end) if length else Match()

    def continuation(self, text: TokenText, most: int) -> list[int]:
        """Up to ``most`` tokens after the match's occurrence (in a corpus, up to the end of its answer)."""
        m = self.match
        if not m.length or most <= 0:
            return []
        out: list[int] = (text if self.corpus is None else self.corpus).view[m.end : m.end + most].tolist()
        return out[: out.index(SEPARATOR)] if SEPARATOR in out else out


class SuffixDrafter(BaseDrafter):
    """A chain a step from the longest match of prompt + answer so far in itself, and one from its longest match
    in the tenant's earlier answers over the same documents (``earlier``: the cross-session tier), the longer
    match first, sharing their common start; nodes labelled ``<source>/m<match length bucket>`` (``source``: the
    text's own chain's label, ``suffix`` unless a drafter built on it names its own, as RACER's retrieval does)."""

    name = SOURCE_TEXT
    priors = {**suffix_priors(SOURCE_TEXT), **suffix_priors(SOURCE_SESSION)}  # noqa: RUF012  (read only)

    def __init__(self, earlier: CrossSessionCache | None = None, max_draft: int = 24, max_match: int = 64,
                 source: str = SOURCE_TEXT) -> None:
        self.earlier = earlier
        self.source = source
        self.max_draft = max_draft
        self.max_match = max_match
        self.reset()

    def reset(self) -> None:
        self.text = TokenText()
        self._fed = 0  # generated tokens already in ``text``
        self.index = SuffixIndex(self.max_match)
        self.session: SuffixIndex | None = None  # over the earlier answers, once the tier has them here
        self._scope = ""

    def begin(self, prompt: PromptInfo) -> None:
        self.reset()
        self.text = TokenText(prompt.prompt_ids, capacity=len(prompt.prompt_ids) + 1024)
        self._scope = prompt.scope or ""
        if self.earlier is not None:
            self.earlier.prefetch_answers(self._scope)  # a remote tier: on their way while the first token is out

    def propose(self, request: DraftRequest) -> DraftTree:
        if len(request.generated) > self._fed:
            self.text.extend(request.generated[self._fed :])
            self._fed = len(request.generated)
        if self.session is None and self.earlier is not None:
            answers = self.earlier.answers(self._scope)  # a local read; empty until a remote tier's fetch lands
            if answers:
                self.session = SuffixIndex(self.max_match, corpus=answers)
        most = min(request.budget, self.max_draft)
        chains = [(self.index.update(self.text).length, self.source, self.index)]
        if self.session is not None:
            chains.append((self.session.update(self.text).length, SOURCE_SESSION, self.session))
        chains.sort(key=lambda c: -c[0])  # the longer match first: it keeps its nodes when the budget is short
        tree = DraftTree()
        for length, source, index in chains:
            add_chain(tree, index.continuation(self.text, most), length, source, most, self.max_match)
        return tree


def add_chain(tree: DraftTree, tokens: Sequence[int], length: int, source: str, most: int, max_match: int) -> None:
    """Hang ``tokens`` (a match's continuation) below the root of ``tree``, sharing any start an earlier chain
    already holds, each new node labelled ``<source>/m<bucket of the match length it stands on>``; at most
    ``most`` nodes in the tree."""
    parent = ROOT
    for depth, token in enumerate(tokens):
        same = [i for i, p in enumerate(tree.parents) if p == parent and tree.tokens[i] == token]
        if same:  # the chains agree so far: one node
            parent = same[0]
        elif len(tree) < most:
            label = match_label(min(length + depth, max_match))
            parent = tree.add(parent, token, source, kind=f"{source}/m{label}")
        else:
            return
