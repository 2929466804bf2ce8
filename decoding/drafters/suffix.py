"""Suffix drafting: the continuation of the longest exact match of the text's end, over everything the answer
may copy (SuffixDecoding's and SAM-Decoding's idea, kept to what pays on a CPU).

A RAG answer copies its document in spans: once the last few tokens of the answer occur in the prompt (or in
the answer itself, or in an earlier answer over the same document), what followed there is very likely what
comes next, and the longer the match, the likelier (on the decoding benchmark's answers: a 1-token match
continues right about a quarter of the time, 3 tokens half the time, 9 or more over 90%). So each step drafts
one chain: the tokens after the most recent occurrence of the longest suffix of the text, and labels every
node with the match length it would stand on (``suffix/m3``...). The engine's budget policy learns each
label's acceptance and cuts the chain where one more verified row stops paying (``decoding.speculative.budget``):
long where the match is long, nothing where it is one token and a row is dear.

``SuffixIndex`` keeps the match incrementally: when the text goes on the way the match's occurrence went on,
the match grows by one token for free; otherwise one vectorised search over the text (numpy, O(n) with a
small constant) finds the new longest match. The text is a growing int32 buffer, so a step costs tens of
microseconds on an 8K-token prompt.

Earlier answers of other sessions reach the drafts through the cross-session tier
(``decoding.drafters.racer.tier_drafter``), which the ``auto`` mode runs before this drafter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from decoding.speculative.drafter import BaseDrafter, DraftRequest, PromptInfo
from decoding.speculative.tree import ROOT, DraftTree

SOURCE_TEXT = "suffix"
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
    """The longest match of a text's end earlier in the same text, kept up to date as the text grows (see the
    module doc)."""

    def __init__(self, max_match: int = 64) -> None:
        self.max_match = max_match
        self.match = Match()
        self._seen = 0  # text tokens the match accounts for

    def update(self, text: TokenText) -> Match:
        """The match for ``text``'s end, advancing the kept one by the tokens added since the last call: while
        the text goes on as the occurrence did, the match grows (it cannot grow by more than the one token);
        after the first token that does not, one search at the end."""
        m: Match | None = self.match
        while self._seen < len(text) and m is not None:
            token = text[self._seen]
            self._seen += 1
            m = Match(min(m.length + 1, self.max_match), m.end + 1) if m.length and text[m.end] == token else None
        if m is None:
            m = self._search(text)
            self._seen = len(text)
        self.match = m
        return m

    def _search(self, text: TokenText) -> Match:
        full = text.view
        length, end = longest_suffix(full[:-1], full, self.max_match)  # an occurrence ending before the end
        return Match(length, end) if length else Match()

    def continuation(self, text: TokenText, most: int) -> list[int]:
        """Up to ``most`` tokens after the match's occurrence."""
        m = self.match
        if not m.length or most <= 0:
            return []
        return text.view[m.end : m.end + most].tolist()


class SuffixDrafter(BaseDrafter):
    """One chain a step: what followed the most recent occurrence of the longest suffix of prompt + answer so
    far, nodes labelled ``suffix/m<match length bucket>`` for the budget policy."""

    name = SOURCE_TEXT
    priors = suffix_priors(SOURCE_TEXT)

    def __init__(self, max_draft: int = 24, max_match: int = 64) -> None:
        self.max_draft = max_draft
        self.max_match = max_match
        self.reset()

    def reset(self) -> None:
        self.text = TokenText()
        self._fed = 0  # generated tokens already in ``text``
        self.index = SuffixIndex(self.max_match)

    def begin(self, prompt: PromptInfo) -> None:
        self.reset()
        self.text = TokenText(prompt.prompt_ids, capacity=len(prompt.prompt_ids) + 1024)

    def propose(self, request: DraftRequest) -> DraftTree:
        if len(request.generated) > self._fed:
            self.text.extend(request.generated[self._fed :])
            self._fed = len(request.generated)
        tree = DraftTree()
        length = self.index.update(self.text).length
        tokens = self.index.continuation(self.text, min(request.budget, self.max_draft))
        parent = ROOT
        for depth, token in enumerate(tokens):
            label = match_label(min(length + depth, self.max_match))
            parent = tree.add(parent, token, SOURCE_TEXT, kind=f"{SOURCE_TEXT}/m{label}")
        return tree
