"""``POST /v1/ask``: a question over documents; JSON, or SSE (sources, progress..., token..., stats, done).

A stream starts as soon as the request's checks pass: its first bytes (a comment) leave before retrieval,
and pings (comments) every ``RAGSPEC_SSE_PING_S`` keep it alive until the first token.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any

from fastapi import APIRouter, Request
from sse_starlette import ServerSentEvent

from app.answering import pipeline as answering
from app.answering.events import AnswerEvent, Failed, Finished, Prefill, Sources, Token, Waiting
from app.answering.pipeline import Question
from app.answering.sampling import logprobs_asked, sampling_params
from app.api.deps import ServicesDep, TenantDep, arrival
from app.api.openapi import ERRORS
from app.api.sse import comment, frame, sse_response
from app.errors import InvalidRequest
from app.schemas import AskRequest, AskResponse, TokenLogprobOut
from app.serving.sessions import Turn, last_scope

logger = logging.getLogger(__name__)

router = APIRouter(tags=["ask"])

STREAM_DOC: dict[int | str, dict[str, Any]] = {
    "200": {
        "description": "JSON answer, or with `stream: true` a text/event-stream of `sources`, `progress` "
        '(data `{"stage": "queued", "position"}` while the generation waits for the engine, position 1 next; '
        '`{"stage": "prefill", "done", "total", "reused"}`: prompt tokens whose KV is ready, of which '
        "reused from the prefix cache, while the prompt is read), `token` "
        '(data `{"text"}`), `citations` (data `{"citations", "cited_answer", "highlights"}`: the answer\'s '
        "sentences cited to sources, attributed after the last token), `stats` and `done` events (`error` then "
        "`done` on a failure mid-stream); "
        "comment frames (`: ping`) keep the connection alive until the first token",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


@router.post("/v1/ask", response_model=AskResponse, responses={**ERRORS, **STREAM_DOC})
async def ask(body: AskRequest, request: Request, services: ServicesDep, tenant: TenantDep) -> Any:
    arrived = arrival(request)
    session_id = body.session_id or uuid.uuid4().hex
    turns = await services.sessions.history(tenant, body.session_id) if body.session_id is not None else []
    document_ids, collection_ids = body.document_ids, body.collection_ids
    where: Mapping[str, Any] | None = body.filter
    if not document_ids and not collection_ids:  # a follow-up: the conversation's last documents and collections
        document_ids, collection_ids, where = _conversation_scope(turns, body.session_id)
    question = Question(
        question=body.question,
        document_ids=document_ids,
        collection_ids=collection_ids,
        filter=where,
        max_tokens=body.max_tokens,
        sampling=sampling_params(body, services.config.penalties, services.vocab_size, temperature=body.temperature,
                                 top_p=body.top_p, seed=body.seed, eta=body.eta),
        mode=body.mode,
        history=[(t.question, t.answer) for t in turns],
        session_id=session_id,
        logprobs=logprobs_asked(body),
    )
    # a stream's disconnect cancels its generator (app/api/sse.py); a JSON answer polls for its client
    disconnected = None if body.stream else request.is_disconnected
    events = answering.answer(  # 4xx here, before any streaming
        services, tenant, question, arrived=arrived, disconnected=disconnected
    )
    if body.stream:
        return sse_response(_stream(events, session_id), services.config.streaming.sse_ping_s)
    done = await answering.complete(events)
    return AskResponse(
        answer=done.text,
        cited_answer=done.citations.cited_answer,
        citations=done.citations.citations,
        session_id=session_id,
        sources=list(done.sources),
        usage=done.usage,
        stats=done.stats,
        logprobs=None if done.logprobs is None else list(done.logprobs),
    )


async def _stream(events: AsyncGenerator[AnswerEvent, None], session_id: str) -> AsyncIterator[ServerSentEvent]:
    yield comment("accepted")  # the first bytes, before retrieval and the queue (``events`` start when read)
    async for event in answering.in_band(events):
        if isinstance(event, Sources):
            yield frame([s.model_dump() for s in event.sources], "sources")
        elif isinstance(event, Waiting | Prefill):
            yield frame(event.payload(), "progress")
        elif isinstance(event, Token):
            lp = {} if event.logprobs is None else {"logprobs": _dumped(event.logprobs)}
            yield frame({"text": event.text, **lp}, "token")
        elif isinstance(event, Finished):
            if event.trailing_logprobs:  # tokens whose text never showed (a stop string)
                yield frame({"text": "", "logprobs": _dumped(event.trailing_logprobs)}, "token")
            yield frame(event.citations.model_dump(), "citations")  # app/answering/citations.py
            yield frame(event.stats.model_dump(), "stats")
            yield frame(
                {"session_id": session_id, "finish_reason": event.finish_reason, "usage": event.usage.model_dump()},
                "done",
            )
        elif isinstance(event, Failed):  # failed after the stream began: reported in band
            yield frame({"code": event.code, "message": event.message}, "error")
            yield frame({"session_id": session_id}, "done")


def _dumped(entries: Sequence[TokenLogprobOut]) -> list[dict[str, Any]]:
    return [e.model_dump() for e in entries]


def _conversation_scope(
    turns: Sequence[Turn], session_id: str | None
) -> tuple[list[str], list[str], Mapping[str, Any] | None]:
    """A follow-up that names no documents or collections asks about its conversation's last ones (and filter)."""
    documents, collections, where = last_scope(turns)
    if documents or collections:
        return documents, collections, where
    if session_id is None:
        raise InvalidRequest("document_ids: name at least one document or collection_ids a collection (or continue "
                             "a conversation with session_id)")
    raise InvalidRequest(
        f"document_ids: none given, and conversation {session_id} has asked about no documents to continue with"
    )
