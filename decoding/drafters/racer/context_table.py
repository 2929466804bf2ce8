"""Context-keyed logit cues: the target's top-k next tokens after the last three / two tokens of a text.

The logits table (``logits_table``) keys the target's prediction by the last token only, so a row holds
whatever followed that token the last time the target read it, anywhere. In a RAG answer the same token
is followed by different things in different places; keyed by the trigram (or bigram) ending with it, the
prediction is the one the target made in the same local context. Measured on the bundled model (6
questions x 64 answer tokens over the benchmark documents): the top-1 of trigram -> bigram -> token
backoff predicts the next answer token 37 % of the time, the token-keyed row 18-21 %.

One table per request (contexts are the document's): filled from the prefill top-k at every prompt
position and from every verified node (rejected ones included: the target's prediction after a wrong
draft is still its prediction after that context). The latest occurrence of a context wins. Bounded by
``max_entries`` keys per order; past it, known contexts are still updated but new ones are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ORDERS = (3, 2)  # context lengths kept here, longest first; order 1 is the shared logits table


class ContextTable:
    """``lookup(context)``: the target's latest top-k after the longest known suffix of ``context``."""

    def __init__(self, k: int = 4, max_entries: int = 200_000) -> None:
        if k < 1 or max_entries < 1:
            raise ValueError(f"need k >= 1 and max_entries >= 1, got {k}, {max_entries}")
        self.k = int(k)
        self.max_entries = int(max_entries)
        self._rows: dict[int, dict[tuple[int, ...], list[int]]] = {order: {} for order in ORDERS}

    def __len__(self) -> int:
        return sum(len(rows) for rows in self._rows.values())

    def _put(self, text: Sequence[int], end: int, row: list[int]) -> None:
        """Record ``row`` as the prediction after ``text[: end + 1]``."""
        for order in ORDERS:
            if end + 1 < order:
                continue
            rows = self._rows[order]
            key = tuple(text[end + 1 - order : end + 1])
            if key in rows or len(rows) < self.max_entries:
                rows[key] = row

    def feed_prompt(self, ids: Sequence[int], topk: torch.Tensor | None) -> None:
        """Row j of ``topk`` (``[len(ids), k']``) is the target's top-k after ``ids[: j + 1]``."""
        if topk is None or not len(ids):
            return
        rows = topk[: len(ids), : self.k].tolist()
        text = list(ids)
        for end, row in enumerate(rows):
            self._put(text, end, [int(t) for t in row if t >= 0])

    def feed(self, contexts: Sequence[Sequence[int]], topk: torch.Tensor) -> None:
        """``contexts[i]`` (its last tokens) was followed by the target's top-k ``topk[i]``."""
        rows = topk[: len(contexts), : self.k].tolist()
        for ctx, row in zip(contexts, rows, strict=False):
            if ctx:
                self._put(ctx, len(ctx) - 1, [int(t) for t in row if t >= 0])

    def lookup(self, context: Sequence[int]) -> list[tuple[int, list[int]]]:
        """Known rows for the suffixes of ``context``, longest first: ``[(order, top-k ids), ...]``."""
        found: list[tuple[int, list[int]]] = []
        for order in ORDERS:
            if len(context) >= order:
                row = self._rows[order].get(tuple(context[-order:]))
                if row:
                    found.append((order, row))
        return found
