"""Retrieval for a follow-up question: what the retriever is asked when a question continues a conversation.

A follow-up such as "And when was it automated?" names its subject only through the earlier turns, so on its
own it resembles no passage well enough to pass the retrieval threshold, and its answer came without
sources. The retriever is therefore asked twice: with the question, and with the question after the
conversation's last ``FOLLOW_UP_TURNS`` questions (which name the subject); a chunk either query finds is a
source, with the better of its two scores. A question that changes the subject still finds its own chunks
through the first query.
"""

from __future__ import annotations

from collections.abc import Sequence

from retrieval.retriever import Hit

FOLLOW_UP_TURNS = 2


def follow_up_query(question: str, history: Sequence[tuple[str, str]]) -> str | None:
    """The question after the last earlier questions of the conversation (None without history)."""
    earlier = [q.strip() for q, _answer in history[-FOLLOW_UP_TURNS:] if q.strip()]
    return " ".join([*earlier, question]) if earlier else None


def merge_hits(first: Sequence[Hit], second: Sequence[Hit]) -> list[Hit]:
    """Hits of both lists, each chunk once with its better score (the order of ``first`` then ``second``)."""
    merged: dict[tuple[str, int], Hit] = {}
    for hit in [*first, *second]:
        key = (hit.document_id, hit.chunk_id)
        kept = merged.get(key)
        if kept is None or hit.score > kept.score:
            merged[key] = hit
    return list(merged.values())
