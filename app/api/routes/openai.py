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
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from sse_starlette import ServerSentEvent

from app.answering import pipeline as answering
from app.answering.events import AnswerEvent, Failed, Finished, Prefill, Reasoning, Token, Waiting
from app.answering.followup import split_turns
from app.answering.pipeline import Question
from app.answering.prompts import SYSTEM_PROMPT
from app.answering.sampling import logprobs_asked, sampling_params
from app.api.deps import ServicesDep, TenantDep, arrival
from app.api.openapi import ERRORS
from app.api.sse import comment, frame, sse_response
from app.errors import InvalidRequest
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
    TokenLogprobOut,
    Usage,
)

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
    history, question = split_turns([(m.role, _text(m)) for m in messages if m.role in ("user", "assistant")],
                                    "messages")
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
        collection_ids=body.collection_ids,
        filter=body.filter,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        sampling=sampling_params(body, services.config.penalties, services.vocab_size, temperature=body.temperature,
                                 top_p=body.top_p, seed=body.seed),
        stop=_stops(body.stop),
        history=history,
        system=system,
        logprobs=logprobs_asked(body),
    )
    # a stream's disconnect cancels its generator (app/api/sse.py); a JSON answer polls for its client
    disconnected = None if body.stream else request.is_disconnected
    events = answering.answer(services, tenant, q, arrived=arrived, disconnected=disconnected)  # 4xx here
    completion_id = "chatcmpl-" + uuid.uuid4().hex
    created = int(time.time())
    if body.stream:
        usage_chunk = body.stream_options is not None and body.stream_options.include_usage
        chunks = _Chunks(services.target.name, completion_id, created, usage_chunk)
        return sse_response(_stream(events, chunks), services.config.streaming.sse_ping_s)
    done = await answering.complete(events)
    return ChatCompletionResponse(
        id=completion_id,
        created=created,
        model=services.target.name,
        choices=[
            ChatChoice(
                message=ChatChoiceMessage(content=done.text, reasoning_content=done.reasoning),
                finish_reason=FINISH_REASONS.get(done.finish_reason, "stop"),
                logprobs=None if done.logprobs is None else ChoiceLogprobs(content=list(done.logprobs)),
            )
        ],
        usage=_usage(done.usage),
        sources=list(done.sources),
        citations=done.citations.citations,
        stats=done.stats,
    )


def _usage(usage: Usage) -> ChatUsage:
    return ChatUsage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                     total_tokens=usage.prompt_tokens + usage.completion_tokens)


class _Chunks:
    """One stream's ``chat.completion.chunk`` objects. With ``include_usage`` (OpenAI's ``stream_options``) every
    chunk has ``usage`` null and a last chunk without choices carries it; without, the finishing chunk does."""

    def __init__(self, model: str, completion_id: str, created: int, include_usage: bool) -> None:
        self.base = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}
        self.include_usage = include_usage

    def __call__(self, delta: dict[str, Any], finish: str | None = None,
                 logprobs: Sequence[TokenLogprobOut] | None = None, **extra: Any) -> dict[str, Any]:
        lp = None if logprobs is None else {"content": [e.model_dump() for e in logprobs]}
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        usage = {"usage": None} if self.include_usage else {}
        return {**self.base, "choices": [choice], **usage, **extra}

    def usage(self, usage: ChatUsage) -> dict[str, Any]:
        return {**self.base, "choices": [], "usage": usage.model_dump()}


async def _stream(events: AsyncGenerator[AnswerEvent, None], chunk: _Chunks) -> AsyncIterator[ServerSentEvent]:
    yield frame(chunk({"role": "assistant", "content": ""}))  # the first bytes, before retrieval and the queue
    async for event in answering.in_band(events):
        if isinstance(event, Waiting | Prefill):  # a comment: OpenAI clients skip it, proxies see bytes
            yield comment(json.dumps(event.payload(), separators=(",", ":")))
        elif isinstance(event, Token):
            yield frame(chunk({"content": event.text}, logprobs=event.logprobs))
        elif isinstance(event, Reasoning):  # a harmony model's analysis channel, as vLLM streams it
            yield frame(chunk({"reasoning_content": event.text}))
        elif isinstance(event, Finished):
            usage = _usage(event.usage)
            yield frame(
                chunk(
                    {},
                    FINISH_REASONS.get(event.finish_reason, "stop"),
                    logprobs=event.trailing_logprobs or None,  # tokens whose text never showed (a stop string)
                    **({} if chunk.include_usage else {"usage": usage.model_dump()}),
                    sources=[s.model_dump() for s in event.sources],
                    citations=[c.model_dump() for c in event.citations.citations],
                    stats=event.stats.model_dump(),
                )
            )
            if chunk.include_usage:
                yield frame(chunk.usage(usage))
        elif isinstance(event, Failed):  # after the stream began: reported in band, then the stream ends properly
            yield frame({"error": {"code": event.code, "message": event.message}})
    yield frame("[DONE]")
