"""``POST /v1/ask``: a question over documents; JSON, or SSE (sources, token..., stats, done)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from app import answering
from app.answering import Plan, Question
from app.deps import ServicesDep, TenantDep
from app.errors import error_body, translate
from app.routes.documents import ERRORS
from app.schemas import AskRequest, AskResponse
from app.services import Services
from app.sse import frame, sse_response
from decoding.generation import PrefillEvent, SamplingParams

logger = logging.getLogger(__name__)

router = APIRouter(tags=["ask"])

STREAM_DOC: dict[int | str, dict[str, Any]] = {
    "200": {
        "description": "JSON answer, or with `stream: true` a text/event-stream of `sources`, `progress` "
        '(data `{"stage": "prefill", "done", "total", "reused"}`: prompt tokens whose KV is ready, of which '
        "reused from the prefix cache; sent while the prompt is read), `token` "
        '(data `{"text"}`), `stats` and `done` events (`error` then `done` on a failure mid-stream)',
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


@router.post("/v1/ask", response_model=AskResponse, responses={**ERRORS, **STREAM_DOC})
async def ask(body: AskRequest, request: Request, services: ServicesDep, tenant: TenantDep) -> Any:
    session_id = body.session_id or uuid.uuid4().hex
    history = []
    if body.session_id is not None:
        history = [(t.question, t.answer) for t in await services.sessions.history(tenant, body.session_id)]
    question = Question(
        question=body.question,
        document_ids=body.document_ids,
        max_tokens=body.max_tokens,
        sampling=SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed, eta=body.eta),
        mode=body.mode,
        history=history,
        session_id=session_id,
    )
    plan = await answering.plan(services, tenant, question)
    answering.start(services, plan)
    if body.stream:
        return sse_response(_stream(services, plan, session_id))
    done = await answering.complete(services, plan, request)
    return AskResponse(
        answer=done.text,
        session_id=session_id,
        sources=plan.sources,
        usage=answering.usage_out(done.stats),
        stats=answering.stats_out(done.stats, plan.question.mode),
    )


async def _stream(services: Services, plan: Plan, session_id: str) -> AsyncIterator[str]:
    try:
        yield frame([s.model_dump() for s in plan.sources], "sources")
        async for event in answering.events(plan):
            if isinstance(event, PrefillEvent):
                yield frame(answering.progress_out(event), "progress")
            elif event.text:
                yield frame({"text": event.text}, "token")
        await answering.finish(services, plan)
        if plan.done is not None:
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
