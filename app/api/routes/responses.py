"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``) as a converter around
the answering pipeline, like ``/v1/ask`` and ``/v1/chat/completions``: the request becomes a ``Question`` (the last
user message, the earlier ones and those of the ``previous_response_id`` chain its history, ``instructions`` its
system prompt, a ``file_search`` tool's vector stores its collections and ``filters`` its filter), the answer's
events become the response object or OpenAI's stream of events.

The output holds a ``file_search_call`` (the question as its query; ``results`` when ``include`` asks for them:
the answer's sources, at most ``max_num_results``, above ``ranking_options.score_threshold``; none when no ready
file matches, and the model answers without them, as OpenAI's file search does) and the assistant's
``message``, whose ``output_text`` carries a ``file_citation`` annotation at the end of each sentence ragspec's
citations attribute to a file. ragspec's own figures ride in the extension fields ``stats`` (the speculative
decoding and retrieval figures of ``/v1/ask``) and ``sources``, which the official client keeps in
``model_extra``. Stored responses (``store``, default true) live in the catalogue, so a follow-up by
``previous_response_id`` works on any replica. Errors are OpenAI's shape (``app.errors``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from sse_starlette import ServerSentEvent

from app.answering import pipeline as answering
from app.answering.events import AnswerEvent, Failed, Finished, Prefill, Sources, Token, Waiting
from app.answering.followup import split_turns
from app.answering.pipeline import Question
from app.answering.prompts import SYSTEM_PROMPT
from app.answering.sampling import sampling_params
from app.api.deps import ServicesDep, TenantDep, arrival
from app.api.openapi import ERRORS
from app.api.sse import comment, frame, sse_response
from app.errors import InvalidRequest
from app.openai_schemas import INCLUDABLE, FileSearchTool, InputMessage, ResponseCreate, ResponseDeleted
from app.schemas import LogitControls, Source
from app.services import Services
from app.serving import file_search
from retrieval.errors import CollectionNotReady
from retrieval.filters import parse_filter

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/responses", tags=["openai file search"])

MAX_CHAIN = 64  # responses followed back through previous_response_id for the history


@router.post("", responses=ERRORS, summary="Answer with the model, over vector stores with the file_search tool")
async def create_response(body: ResponseCreate, request: Request, services: ServicesDep, tenant: TenantDep) -> Any:
    arrived = arrival(request)
    limit = services.config.limits.max_new_tokens
    if body.max_output_tokens is not None and body.max_output_tokens > limit:
        raise InvalidRequest(f"max_output_tokens: {body.max_output_tokens} is above the limit of {limit}")
    tool = _tool(body)
    history, question, system = await asyncio.to_thread(_conversation, services, tenant, body)
    if tool is not None:
        await asyncio.to_thread(_active, services, tenant, tool.vector_store_ids)
    q = Question(
        question=question, document_ids=[], collection_ids=tool.vector_store_ids if tool else [],
        filter=tool.filters if tool else None, max_tokens=body.max_output_tokens,
        sampling=sampling_params(LogitControls.model_validate({}), services.config.penalties, services.vocab_size,
                                 temperature=0.0 if body.temperature is None else body.temperature,
                                 top_p=1.0 if body.top_p is None else body.top_p, seed=None),
        history=history, system=system)
    disconnected = None if body.stream else request.is_disconnected
    try:
        events = answering.answer(services, tenant, q, arrived=arrived, disconnected=disconnected)  # 4xx here
    except CollectionNotReady:  # nothing ready matches: as OpenAI's file search, a search without results
        q = replace(q, collection_ids=[], filter=None)
        events = answering.answer(services, tenant, q, arrived=arrived, disconnected=disconnected)
    shape = _Shape(services, tenant, body, tool, question)
    if body.stream:
        return sse_response(_stream(events, shape), services.config.streaming.sse_ping_s)
    done = await answering.complete(events)
    return await asyncio.to_thread(shape.finished, done)


@router.get("/{response_id}", responses=ERRORS, summary="A stored response")
async def get_response(response_id: str, services: ServicesDep, tenant: TenantDep) -> Any:
    _, body = await asyncio.to_thread(services.store.get_response, response_id, tenant)
    return json.loads(body)["response"]


@router.delete("/{response_id}", response_model=ResponseDeleted, responses=ERRORS, summary="Delete a stored response")
async def delete_response(response_id: str, services: ServicesDep, tenant: TenantDep) -> ResponseDeleted:
    await asyncio.to_thread(services.store.delete_response, response_id, tenant)
    return ResponseDeleted(id=response_id)


# ---- the request ----------------------------------------------------------------------------------------------


def _tool(body: ResponseCreate) -> FileSearchTool | None:
    """The request's file_search tool (at most one; any other tool refused by name), None without one or with
    ``tool_choice: none``; unsupported options refused."""
    if body.include and any(i not in INCLUDABLE for i in body.include):
        bad = next(i for i in body.include if i not in INCLUDABLE)
        raise InvalidRequest(f"include: ragspec can include {', '.join(INCLUDABLE)} (got {bad!r})")
    if body.text is not None and body.text.get("format", {"type": "text"}) != {"type": "text"}:
        raise InvalidRequest("text.format: ragspec answers plain text ({\"type\": \"text\"})")
    tools = []
    for i, raw in enumerate(body.tools):
        if raw.get("type") != "file_search":
            raise InvalidRequest(f"tools[{i}].type: ragspec runs the file_search tool only (got {raw.get('type')!r})")
        try:
            tools.append(FileSearchTool.model_validate(raw))
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err.get("loc", ()))
            raise InvalidRequest(f"tools[{i}].{where}: {err.get('msg', 'invalid')}") from None
        if tools[-1].filters is not None:  # checked here to name its place (the pipeline parses it again)
            parse_filter(tools[-1].filters, f"tools[{i}].filters")
    if len(tools) > 1:
        raise InvalidRequest("tools: at most one file_search tool (name every vector store in it)")
    if body.tool_choice == "required" and not tools:
        raise InvalidRequest("tool_choice: 'required' needs a file_search tool")
    return tools[0] if tools and body.tool_choice != "none" else None


def _text(message: InputMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for i, part in enumerate(message.content):
        if part.get("type") not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"input: content part {i} of a {message.role} message: only text parts are supported "
                                 f"(got {part.get('type')!r})")
        parts.append(part["text"])
    return "".join(parts)


def _conversation(services: Services, tenant: str, body: ResponseCreate
                  ) -> tuple[list[tuple[str, str]], str, str]:
    """(history, question, system): the previous responses' questions and answers, then the input's own earlier
    messages; its last user message is the question."""
    history = _chain(services, tenant, body.previous_response_id)
    messages = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    systems = [_text(m) for m in messages if m.role in ("system", "developer")]
    earlier, question = split_turns([(m.role, _text(m)) for m in messages if m.role in ("user", "assistant")],
                                    "input")
    system = "\n\n".join([t for t in [body.instructions, *systems] if t]) or SYSTEM_PROMPT
    return history + earlier, question, system


def _chain(services: Services, tenant: str, response_id: str | None) -> list[tuple[str, str]]:
    """The (question, answer) pairs of ``response_id`` and the responses before it, oldest first."""
    pairs: list[tuple[str, str]] = []
    seen = 0
    while response_id is not None and seen < MAX_CHAIN:
        previous, raw = services.store.get_response(response_id, tenant)  # unknown: 404
        stored = json.loads(raw)
        pairs.append((stored["question"], _output_text(stored["response"])))
        response_id, seen = previous, seen + 1
    return pairs[::-1]


def _output_text(response: dict[str, Any]) -> str:
    return "".join(part.get("text", "") for item in response.get("output", []) if item.get("type") == "message"
                   for part in item.get("content", []) if part.get("type") == "output_text")


def _active(services: Services, tenant: str, store_ids: list[str]) -> None:
    """The vector stores are the tenant's (else 404) and not expired (else 400); now is their last activity."""
    for store_id in store_ids:
        file_search.check_active(services.store.get_collection(store_id, tenant))
    services.store.touch_collections(store_ids)


# ---- the response ---------------------------------------------------------------------------------------------


@dataclass
class _Shape:
    """One response's objects: its ids, its file_search_call and message items, the finished response (stored
    when asked)."""

    services: Services
    tenant: str
    body: ResponseCreate
    tool: FileSearchTool | None
    question: str
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    call_id: str = field(default_factory=lambda: "fs_" + uuid.uuid4().hex)
    message_id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)
    created_at: int = field(default_factory=lambda: int(time.time()))
    filenames: dict[str, str] = field(default_factory=dict)

    def response(self, status: str, output: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.services.target.name, "output": output, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "metadata": body.metadata or {}, "previous_response_id": body.previous_response_id, "store": body.store,
            "tools": body.tools, "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
            "text": {"format": {"type": "text"}}, "truncation": body.truncation or "disabled",
            "error": None, "incomplete_details": None, "usage": None, "user": body.user, **extra,
        }

    def call(self, status: str, sources: tuple[Source, ...] | None = None) -> dict[str, Any]:
        item: dict[str, Any] = {"id": self.call_id, "type": "file_search_call", "status": status,
                                "queries": [self.question], "results": None}
        if sources is not None and "file_search_call.results" in self.body.include:
            item["results"] = [{"file_id": s.document_id, "filename": self.filename(s.document_id), "score": s.score,
                                "text": s.text, "attributes": s.attributes} for s in self.results(sources)]
        return item

    def results(self, sources: tuple[Source, ...]) -> list[Source]:
        assert self.tool is not None
        floor = self.tool.ranking_options.score_threshold if self.tool.ranking_options else None
        kept = [s for s in sources if floor is None or s.score >= floor]
        return kept[: self.tool.max_num_results] if self.tool.max_num_results else kept

    def message(self, status: str, text: str = "", annotations: list[dict[str, Any]] | None = None
                ) -> dict[str, Any]:
        content = [] if status == "in_progress" and annotations is None else [self.text_part(text, annotations)]
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status, "content": content}

    @staticmethod
    def text_part(text: str, annotations: list[dict[str, Any]] | None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": annotations or [], "logprobs": []}

    def filename(self, doc_id: str) -> str:
        if doc_id not in self.filenames:
            try:
                record = self.services.store.get(doc_id)
                self.filenames[doc_id] = record.filename or record.title
            except Exception:  # deleted since: named by its id
                self.filenames[doc_id] = doc_id
        return self.filenames[doc_id]

    def annotations(self, done: Finished) -> list[dict[str, Any]]:
        """A file_citation at the end of each sentence ragspec's citations attribute to a source (a tool's only)."""
        if self.tool is None:
            return []
        out = []
        for c in sorted(done.citations.citations, key=lambda c: (c.end, c.source)):
            doc_id = done.sources[c.source].document_id
            out.append({"type": "file_citation", "file_id": doc_id, "filename": self.filename(doc_id),
                        "index": c.end})
        return out

    def output(self, done: Finished) -> list[dict[str, Any]]:
        status = "incomplete" if done.finish_reason == "length" else "completed"
        items = [self.call("completed", done.sources)] if self.tool is not None else []
        return [*items, self.message(status, done.text, self.annotations(done))]

    def finished(self, done: Finished) -> dict[str, Any]:
        """The finished response (stored when asked: the question kept beside it for follow-ups)."""
        incomplete = done.finish_reason == "length"
        usage = done.usage
        body = self.response(
            "incomplete" if incomplete else "completed", self.output(done),
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage={"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                   "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                   "input_tokens_details": {"cached_tokens": done.stats.prefix_reused_tokens or 0},
                   "output_tokens_details": {"reasoning_tokens": 0}},
            stats=done.stats.model_dump(), sources=[s.model_dump() for s in done.sources])
        if self.body.store:
            self.services.store.save_response(self.id, self.tenant, self.body.previous_response_id,
                                              json.dumps({"response": body, "question": self.question}))
        return body


async def _stream(events: AsyncGenerator[AnswerEvent, None], shape: _Shape) -> AsyncIterator[ServerSentEvent]:
    """OpenAI's event sequence, numbered: created, in_progress, the file_search_call's (added, in_progress,
    searching, completed, done), the message's (added, content part, text deltas, annotations, text done, part
    done, item done), completed. Waiting and prefill progress go as SSE comments (clients skip them)."""
    seq = 0

    def event(kind: str, **fields: Any) -> ServerSentEvent:
        nonlocal seq
        seq += 1
        return frame({"type": kind, "sequence_number": seq - 1, **fields}, kind)

    yield event("response.created", response=shape.response("in_progress", []))
    yield event("response.in_progress", response=shape.response("in_progress", []))
    message_index = 0
    if shape.tool is not None:
        call = {"item_id": shape.call_id, "output_index": 0}
        yield event("response.output_item.added", output_index=0, item=shape.call("in_progress"))
        yield event("response.file_search_call.in_progress", **call)
        yield event("response.file_search_call.searching", **call)
        message_index = 1
    at = {"item_id": shape.message_id, "output_index": message_index, "content_index": 0}
    async for ev in answering.in_band(events):
        if isinstance(ev, Sources):
            if shape.tool is not None:
                yield event("response.file_search_call.completed", item_id=shape.call_id, output_index=0)
                yield event("response.output_item.done", output_index=0,
                            item=await asyncio.to_thread(shape.call, "completed", ev.sources))
            yield event("response.output_item.added", output_index=message_index, item=shape.message("in_progress"))
            yield event("response.content_part.added", **at, part=shape.text_part("", []))
        elif isinstance(ev, Waiting | Prefill):
            yield comment(json.dumps(ev.payload(), separators=(",", ":")))
        elif isinstance(ev, Token):
            yield event("response.output_text.delta", **at, delta=ev.text, logprobs=[])
        elif isinstance(ev, Finished):
            final = await asyncio.to_thread(shape.finished, ev)
            annotations = shape.annotations(ev)
            for i, annotation in enumerate(annotations):
                yield event("response.output_text.annotation.added", **at, annotation_index=i, annotation=annotation)
            yield event("response.output_text.done", **at, text=ev.text, logprobs=[])
            yield event("response.content_part.done", **at, part=shape.text_part(ev.text, annotations))
            yield event("response.output_item.done", output_index=message_index, item=final["output"][-1])
            yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                        response=final)
        elif isinstance(ev, Failed):  # after the stream began: OpenAI's error event, then a failed response
            yield event("error", code=ev.code, message=ev.message, param=None)
            yield event("response.failed", response=shape.response(
                "failed", [], error={"code": ev.code, "message": ev.message}))
