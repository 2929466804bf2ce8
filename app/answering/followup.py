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

from app.errors import InvalidRequest

FOLLOW_UP_TURNS = 2


def retrieval_queries(question: str, history: Sequence[tuple[str, str]]) -> list[str]:
    """The question, and after the conversation's earlier questions (none without history)."""
    earlier = [q.strip() for q, _answer in history[-FOLLOW_UP_TURNS:] if q.strip()]
    return [question, " ".join([*earlier, question])] if earlier else [question]


def split_turns(turns: Sequence[tuple[str, str]], field: str) -> tuple[list[tuple[str, str]], str]:
    """(history pairs, question) from a conversation's ``(role, text)`` messages, user and assistant, as the
    OpenAI APIs send them: consecutive messages of one role are joined, the last (a user's) is the question, a user
    message left without an answer joins it. ``field`` names the request's field in the error."""
    if not turns or turns[-1][0] != "user":
        raise InvalidRequest(f"{field}: the last message must come from the user")
    merged: list[tuple[str, str]] = []
    for role, text in turns:
        if merged and merged[-1][0] == role:
            merged[-1] = (role, merged[-1][1] + "\n\n" + text)
        else:
            merged.append((role, text))
    question = merged.pop()[1]
    history: list[tuple[str, str]] = []
    pending: str | None = None
    for role, text in merged:
        if role == "user":
            pending = text
        else:
            history.append((pending or "", text))
            pending = None
    if pending is not None:  # a user message without an answer: part of the question
        question = pending + "\n\n" + question
    return history, question
