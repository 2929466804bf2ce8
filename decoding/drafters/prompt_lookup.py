"""Prompt lookup drafter: the continuation of the latest earlier occurrence of the current n-gram.

A deterministic drafter (point-mass drafts) that exercises the engine before the RACER drafter: it
matches the last ``n`` tokens (``max_ngram`` down to ``min_ngram``) against prompt + output and proposes
what followed the most recent match. An index from n-gram to last position keeps each step O(1).
"""

from __future__ import annotations

from collections.abc import Sequence

from decoding.speculative.drafter import BaseDrafter, DraftRequest, PromptInfo
from decoding.speculative.tree import DraftTree


class PromptLookupDrafter(BaseDrafter):
    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_draft: int = 16, branches: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_draft = max_draft
        self.branches = branches
        self.reset()

    def reset(self) -> None:
        self.seq: list[int] = []
        self.n_output = 0  # generated tokens already in ``seq``
        # n -> {ngram: [end positions, most recent last]} (end = index just after the n-gram)
        sizes = range(self.min_ngram, self.max_ngram + 1)
        self.index: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in sizes}

    def _append(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            self.seq.append(int(tok))
            end = len(self.seq)
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end >= n:
                    self.index[n].setdefault(tuple(self.seq[end - n : end]), []).append(end)

    def begin(self, prompt: PromptInfo) -> None:
        self.reset()
        self._append(prompt.prompt_ids)

    def propose(self, request: DraftRequest) -> DraftTree:
        # Keep the sequence in step with the output (root included: it is the last generated token).
        if len(request.generated) > self.n_output:
            self._append(request.generated[self.n_output :])
            self.n_output = len(request.generated)
        tree = DraftTree()
        budget = min(request.budget, self.max_draft * self.branches)
        seen: set[tuple[int, ...]] = set()
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(self.seq) < n:
                continue
            ends = self.index[n].get(tuple(self.seq[-n:]), [])
            for end in reversed(ends):
                if end >= len(self.seq):  # the current suffix itself
                    continue
                cont = tuple(self.seq[end : end + min(self.max_draft, budget - len(tree))])
                if not cont or cont in seen:
                    continue
                seen.add(cont)
                parent = -1
                for tok in cont:
                    # share an equal prefix with an earlier branch
                    kids = [i for i, p in enumerate(tree.parents) if p == parent and tree.tokens[i] == tok]
                    parent = kids[0] if kids else tree.add(parent, tok, self.name, kind=f"{self.name}/m{n}")
                if len(seen) >= self.branches or len(tree) >= budget:
                    return tree
        return tree
