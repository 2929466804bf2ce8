"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/models``.

Extra request field ``document_ids``; extra response fields ``sources``, ``citations`` (sentences of the
content and their sources; the content is the model's text unchanged) and ``stats`` (in the final chunk when
streaming). The last user message is the question, earlier user/assistant pairs the history, system
messages replace the service's system prompt.

A stream's first chunk (the assistant role) leaves as soon as the request's checks pass, before retrieval;
until the first token its progress (queued, prefill) and pings go as SSE comments, which OpenAI clients skip.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from sse_starlette import ServerSentEvent

from app.answering import pipeline as answering
from app.answering.pipeline import Plan, Question
from app.answering.prompts import SYSTEM_PROMPT
from app.answering.sampling import logprobs_asked, sampling_params
from app.api.deps import ServicesDep, TenantDep, arrival
from app.api.openapi import ERRORS
from app.api.sse import comment, frame, sse_response
from app.errors import InvalidRequest, translate
from app.schemas import (
    ChatChoice,
    ChatChoiceMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatUsage,
    ChoiceLogprobs,
    ModelCard,
    ModelList,
)
from app.services import Services
from app.serving.scheduler import Queued
from decoding.speculative.generation import PrefillEvent, TokenLogprob

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["openai"])

FINISH_REASONS = {"stop": "stop", "length": "length"}
MAX_STOP = 4


def _text(message: ChatMessage) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequest("messages: only text content parts are supported")
        parts.append(part["text"])
    return "".join(parts)


def conversation(messages: list[ChatMessage]) -> tuple[str, list[tuple[str, str]], str]:
    """(system text, history pairs, question) from OpenAI messages."""
    system = "\n\n".join(_text(m) for m in messages if m.role in ("system", "developer")) or SYSTEM_PROMPT
    turns: list[tuple[str, str]] = [(m.role, _text(m)) for m in messages if m.role in ("user", "assistant")]
    if not turns or turns[-1][0] != "user":
        raise InvalidRequest("messages: the last message must come from the user")
    merged: list[tuple[str, str]] = []  # consecutive messages of one role are joined
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
    return system, history, question


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise InvalidRequest(f"stop: at most {MAX_STOP} non-empty strings")
    return tuple(stops)


@router.get("/models", response_model=ModelList, responses=ERRORS)
async def list_models(services: ServicesDep, tenant: TenantDep) -> ModelList:
    return ModelList(
        data=[
            ModelCard(
                id=services.target.name,
                created=int(services.started_at),
                max_context=services.engine.max_context,
            )
        ]
    )


@router.post("/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, services: ServicesDep, tenant: TenantDep
) -> Any:
    arrived = arrival(request)
    system, history, question = conversation(body.messages)
    if body.model and body.model != services.target.name:
        logger.debug("chat request names model %r; serving %s", body.model, services.target.name)
    if body.user:
        logger.info("chat request for end user %r", body.user)
    q = Question(
        question=question,
        document_ids=body.document_ids,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        sampling=sampling_params(body, services.config.penalties, services.vocab_size, temperature=body.temperature,
                                 top_p=body.top_p, seed=body.seed),
        stop=_stops(body.stop),
        history=history,
        system=system,
        logprobs=logprobs_asked(body),
    )
    prepare = answering.admit(services, tenant, q, arrived)  # 4xx here, before any streaming
    completion_id = "chatcmpl-" + uuid.uuid4().hex
    created = int(time.time())
    if body.stream:
        usage_chunk = body.stream_options is not None and body.stream_options.include_usage
        stream = _stream(services, prepare, completion_id, created, usage_chunk)
        return sse_response(stream, services.config.streaming.sse_ping_s)
    plan = await prepare()
    answering.start(services, plan)
    done = await answering.complete(services, plan, request)
    stats = done.stats
    return ChatCompletionResponse(
        id=completion_id,
        created=created,
        model=services.target.name,
        choices=[
            ChatChoice(
                message=ChatChoiceMessage(content=done.text),
                finish_reason=FINISH_REASONS.get(done.finish_reason, "stop"),
                logprobs=None if done.logprobs is None else ChoiceLogprobs(
                    content=services.logprob_text(done.logprobs)),
            )
        ],
        usage=_usage(stats.prompt_tokens, stats.completion_tokens),
        sources=plan.sources,
        citations=answering.citations_of(plan).citations,
        stats=answering.stats_out(stats, plan.question.mode),
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> ChatUsage:
    return ChatUsage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


class _Chunks:
    """One stream's ``chat.completion.chunk`` objects. With ``include_usage`` (OpenAI's ``stream_options``) every
    chunk has ``usage`` null and a last chunk without choices carries it; without, the finishing chunk does."""

    def __init__(self, services: Services, completion_id: str, created: int, include_usage: bool) -> None:
        self.base = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                     "model": services.target.name}
        self.include_usage = include_usage
        self.services = services

    def __call__(self, delta: dict[str, Any], finish: str | None = None,
                 logprobs: list[TokenLogprob] | None = None, **extra: Any) -> dict[str, Any]:
        lp = None if logprobs is None else {"content": [e.model_dump() for e in self.services.logprob_text(logprobs)]}
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        usage = {"usage": None} if self.include_usage else {}
        return {**self.base, "choices": [choice], **usage, **extra}

    def usage(self, usage: ChatUsage) -> dict[str, Any]:
        return {**self.base, "choices": [], "usage": usage.model_dump()}


async def _stream(
    services: Services, prepare: Callable[[], Awaitable[Plan]], completion_id: str, created: int,
    include_usage: bool = False,
) -> AsyncIterator[ServerSentEvent]:
    chunk = _Chunks(services, completion_id, created, include_usage)
    try:  # the role chunk first: the stream's first bytes, before retrieval and the queue
        yield frame(chunk({"role": "assistant", "content": ""}))
        plan = await prepare()
        answering.start(services, plan)
        asked, sent = plan.question.logprobs is not None, 0
        async for event in answering.events(plan):
            if isinstance(event, PrefillEvent | Queued):  # a comment: OpenAI clients skip it, proxies see bytes
                yield comment(json.dumps(answering.progress_out(event), separators=(",", ":")))
            elif event.text:
                sent += len(event.logprobs)
                yield frame(chunk({"content": event.text}, logprobs=event.logprobs if asked else None))
        await answering.finish(services, plan)
        if plan.done is not None:
            stats = plan.done.stats
            usage = _usage(stats.prompt_tokens, stats.completion_tokens)
            rest = plan.done.logprobs[sent:] if plan.done.logprobs is not None else None  # tokens of no text
            yield frame(
                chunk(
                    {},
                    FINISH_REASONS.get(plan.done.finish_reason, "stop"),
                    logprobs=rest or None,
                    **({} if include_usage else {"usage": usage.model_dump()}),
                    sources=[s.model_dump() for s in plan.sources],
                    citations=[c.model_dump() for c in answering.citations_of(plan).citations],
                    stats=answering.stats_out(stats, plan.question.mode).model_dump(),
                )
            )
            if include_usage:
                yield frame(chunk.usage(usage))
        else:
            yield frame({"error": {"code": "cancelled", "message": "the generation was cancelled"}})
    except Exception as exc:  # after the stream began: report in band, then end it properly
        err = translate(exc)
        if err is None:
            logger.exception("generation failed mid-stream")
        code, message = (
            (err.code, err.message) if err is not None else ("internal_error", "generation failed")
        )
        yield frame({"error": {"code": code, "message": message}})
    yield frame("[DONE]")
