"""``POST /v1/ask``: a question over documents; JSON, or SSE (sources, progress..., token..., stats, done).

A stream starts as soon as the request's checks pass: its first bytes (a comment) leave before retrieval,
and pings (comments) every ``RAGSPEC_SSE_PING_S`` keep it alive until the first token.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Request
from sse_starlette import ServerSentEvent

from app.answering import pipeline as answering
from app.answering.pipeline import Plan, Question
from app.answering.sampling import logprobs_asked, sampling_params
from app.api.deps import ServicesDep, TenantDep, arrival
from app.api.openapi import ERRORS
from app.api.sse import comment, frame, sse_response
from app.errors import InvalidRequest, error_body, translate
from app.schemas import AskRequest, AskResponse
from app.services import Services
from app.serving.scheduler import Queued
from app.serving.sessions import Turn, last_documents
from decoding.speculative.generation import PrefillEvent, TokenLogprob

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
    question = Question(
        question=body.question,
        document_ids=body.document_ids or _conversation_documents(turns, body.session_id),
        max_tokens=body.max_tokens,
        sampling=sampling_params(body, services.config.penalties, services.vocab_size, temperature=body.temperature,
                                 top_p=body.top_p, seed=body.seed, eta=body.eta),
        mode=body.mode,
        history=[(t.question, t.answer) for t in turns],
        session_id=session_id,
        logprobs=logprobs_asked(body),
    )
    prepare = answering.admit(services, tenant, question, arrived)  # 4xx here, before any streaming
    if body.stream:
        return sse_response(_stream(services, prepare, session_id), services.config.streaming.sse_ping_s)
    plan = await prepare()
    answering.start(services, plan)
    done = await answering.complete(services, plan, request)
    cited = answering.citations_of(plan)
    return AskResponse(
        answer=done.text,
        cited_answer=cited.cited_answer,
        citations=cited.citations,
        session_id=session_id,
        sources=plan.sources,
        usage=answering.usage_out(done.stats),
        stats=answering.stats_out(done.stats, plan.question.mode),
        logprobs=None if done.logprobs is None else services.logprob_text(done.logprobs),
    )


async def _stream(
    services: Services, prepare: Callable[[], Awaitable[Plan]], session_id: str
) -> AsyncIterator[ServerSentEvent]:
    try:
        yield comment("accepted")  # the first bytes, before retrieval and the queue
        plan = await prepare()
        yield frame([s.model_dump() for s in plan.sources], "sources")
        answering.start(services, plan)
        asked, sent = plan.question.logprobs is not None, 0
        async for event in answering.events(plan):
            if isinstance(event, PrefillEvent | Queued):
                yield frame(answering.progress_out(event), "progress")
            elif event.text:
                sent += len(event.logprobs)
                lp = {"logprobs": _logprobs(services, event.logprobs)} if asked else {}
                yield frame({"text": event.text, **lp}, "token")
        await answering.finish(services, plan)
        if plan.done is not None:
            if plan.done.logprobs and sent < len(plan.done.logprobs):  # tokens whose text never showed (a stop)
                yield frame({"text": "", "logprobs": _logprobs(services, plan.done.logprobs[sent:])}, "token")
            yield frame(answering.citations_of(plan).model_dump(), "citations")  # app/answering/citations.py
            yield frame(answering.stats_out(plan.done.stats, plan.question.mode).model_dump(), "stats")
            usage = answering.usage_out(plan.done.stats).model_dump()
            yield frame(
                {"session_id": session_id, "finish_reason": plan.done.finish_reason, "usage": usage}, "done"
            )
        else:
            yield frame(error_body("cancelled", "the generation was cancelled")["error"], "error")
            yield frame({"session_id": session_id}, "done")
    except Exception as exc:  # after the stream began: report in band
        err = translate(exc)
        if err is None:
            logger.exception("generation failed mid-stream")
        code, message = (
            (err.code, err.message) if err is not None else ("internal_error", "generation failed")
        )
        yield frame({"code": code, "message": message}, "error")
        yield frame({"session_id": session_id}, "done")


def _logprobs(services: Services, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    return [e.model_dump() for e in services.logprob_text(entries)]


def _conversation_documents(turns: Sequence[Turn], session_id: str | None) -> list[str]:
    """A follow-up that names no documents asks about its conversation's last ones."""
    if documents := last_documents(turns):
        return documents
    if session_id is None:
        raise InvalidRequest("document_ids: name at least one document (or continue a conversation with session_id)")
    raise InvalidRequest(
        f"document_ids: none given, and conversation {session_id} has asked about no documents to continue with"
    )
