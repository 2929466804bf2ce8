"""What the retriever is asked for a question that may continue a conversation.

A follow-up such as "And when was it automated?" names its subject only through the earlier turns, so on its
own it resembles no passage well enough to pass the retrieval threshold, and its answer came without
sources. The request's one ranking (``Retriever.rank``) is therefore scored for two queries, embedded together:
the question, and the question after the conversation's last ``FOLLOW_UP_TURNS`` questions (which name the
subject); a chunk keeps the better of its two scores. A question that changes the subject still finds its own
chunks through the first query.
"""

from __future__ import annotations

from collections.abc import Sequence

FOLLOW_UP_TURNS = 2


def retrieval_queries(question: str, history: Sequence[tuple[str, str]]) -> list[str]:
    """The question, and after the conversation's earlier questions (none without history)."""
    earlier = [q.strip() for q, _answer in history[-FOLLOW_UP_TURNS:] if q.strip()]
    return [question, " ".join([*earlier, question])] if earlier else [question]
