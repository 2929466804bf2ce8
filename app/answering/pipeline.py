"""One answer: check the request, rank the documents' chunks once (sources, the target's window, RAPID's
context), build the target's prompt, queue the generation, and
account for it afterwards (session history, cross-session draft cache, metrics).

Both APIs (``/v1/ask`` and ``/v1/chat/completions``) go through ``plan`` -> ``start`` -> events ->
``finish``; they differ only in how they frame the events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from starlette.requests import Request

from app.answering.citations import cite
from app.answering.drafters import needs_draft_prompt, needs_draft_rows
from app.answering.followup import retrieval_queries
from app.answering.prompts import SYSTEM_PROMPT, document_texts
from app.errors import InvalidRequest, Overloaded
from app.schemas import AskStats, Citations, Source, Usage
from app.services import Services
from app.serving.scheduler import JobHandle, Queued
from app.serving.sessions import Turn
from decoding.drafters.registry import MODES
from decoding.speculative.drafter import Drafter
from decoding.speculative.generation import (
    DoneEvent,
    GenerationConfig,
    GenerationEvent,
    PrefillEvent,
    Prompt,
    SamplingParams,
    TokenEvent,
)
from decoding.speculative.stats import GenerationStats
from retrieval.errors import DocumentNotReady
from retrieval.retriever import Hit, join_hits, pack_hits

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25
T = TypeVar("T")


@dataclass(frozen=True)
class Question:
    """What both APIs ask, after parsing."""

    question: str
    document_ids: Sequence[str]
    max_tokens: int | None
    sampling: SamplingParams
    mode: str = "auto"
    stop: tuple[str, ...] = ()
    history: Sequence[tuple[str, str]] = ()
    system: str = SYSTEM_PROMPT
    session_id: str | None = None
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k most likely tokens'


@dataclass
class Plan:
    tenant: str
    question: Question
    prompt: Prompt
    config: GenerationConfig
    drafters: list[Drafter]
    sources: list[Source]
    handle: JobHandle | None = None
    done: DoneEvent | None = None
    text: list[str] = field(default_factory=list)
    citations: Citations | None = None  # set by ``finish`` (it also sets the sources' highlights)
    arrived: float = field(default_factory=time.perf_counter)  # perf_counter() at the request's arrival


def check_limits(
    services: Services, question: str, document_ids: Sequence[str], max_tokens: int | None
) -> int:
    """Request limits that depend on settings (422); returns the effective max_tokens."""
    limits = services.config.limits
    if not question.strip():
        raise InvalidRequest("question: must not be blank")
    if len(question) > limits.max_question_chars:
        raise InvalidRequest(
            f"question: {len(question)} characters, at most {limits.max_question_chars} allowed"
        )
    if len(document_ids) > limits.max_document_ids:
        raise InvalidRequest(
            f"document_ids: {len(document_ids)} given, at most {limits.max_document_ids} allowed"
        )
    if max_tokens is not None and max_tokens > limits.max_new_tokens:
        raise InvalidRequest(f"max_tokens: {max_tokens} is above the limit of {limits.max_new_tokens}")
    return max_tokens or limits.default_max_tokens


def source_of(hit: Hit) -> Source:
    return Source(
        document_id=hit.document_id,
        chunk_id=str(hit.chunk_id),
        text=hit.text,
        score=hit.score,
        similarity=hit.similarity if hit.similarity is not None else hit.score,
        start=hit.start,
        end=hit.end,
        page=hit.page,
        page_end=hit.page_end,
    )


async def plan(services: Services, tenant: str, q: Question, arrived: float | None = None) -> Plan:
    """Everything up to the generation (``admit``, then retrieval and the prompt)."""
    return await admit(services, tenant, q, arrived)()


def admit(
    services: Services, tenant: str, q: Question, arrived: float | None = None
) -> Callable[[], Awaitable[Plan]]:
    """The request's checks, which raise its 4xx errors before any streaming starts; returns what builds the
    plan (retrieval and the prompt), which a stream awaits after its first bytes have left. ``arrived``
    (``time.perf_counter()`` at the request's arrival, default now) is where ``ttft_ms`` counts from."""
    arrived = time.perf_counter() if arrived is None else arrived
    max_tokens = check_limits(services, q.question, q.document_ids, q.max_tokens)
    # a question (with its history) too long for the window is the request's fault: a 400 before any stream
    # starts, found by tokenizing it alone (the documents are fitted after retrieval)
    services.prompts.fit([], q.question, q.history, max_tokens, None, system=q.system)
    drafters = services.drafters.for_mode(q.mode, tenant, q.sampling)
    _counted(services, services.scheduler.ensure_room)  # a full queue refuses before any work
    # a cache for the answer alone must fit the working pool (the prompt's rows are counted once it is built)
    services.scheduler.check_fits(services.engine.kv_bytes(max_tokens))
    records = [services.store.get(doc_id, tenant) for doc_id in dict.fromkeys(q.document_ids)]  # unknown: 404
    # one order for a set of documents, whatever order they are named in (upload order): the same prompt, so
    # the same cached prefix KV, and no second copy of it on disk for every permutation
    records.sort(key=lambda r: (r.created_at, r.id))
    doc_ids = [r.id for r in records]
    not_ready = [r for r in records if r.status != "ready"]
    if not_ready:
        first = not_ready[0]
        if len(not_ready) > 1:
            states = ", ".join(f"{r.id}: {r.status}" for r in not_ready)
            raise DocumentNotReady(first.id, first.status, f"documents not ready ({states})")
        raise DocumentNotReady(first.id, first.status, first.message)

    def build() -> tuple[Prompt, list[Source]]:
        # retrieval scored once: sources, the target's window (documents longer than it) and RAPID's context
        ranking, hits = None, []
        if doc_ids:
            ranking = services.retriever.rank(retrieval_queries(q.question, q.history), doc_ids, tenant=tenant)
            hits = ranking.relevant().hits
        sources = [source_of(h) for h in sorted(hits, key=lambda h: -h.score)]  # best first
        docs = document_texts(services.store, records)
        prompt = services.prompts.fit(docs, q.question, q.history, max_tokens, ranking, system=q.system)
        if prompt.prefix_key is not None and doc_ids:
            services.prefixes.add(prompt.prefix_key, doc_ids)
        # RAPID reads the best retrieved chunks within its own budget: as a prompt of its own, or as their rows
        # of the target's cache
        if needs_draft_prompt(q.mode) or needs_draft_rows(q.mode):
            budget = min(services.config.rapid.context_tokens, services.retriever.budget_cap)
            rag = pack_hits(hits, budget, doc_ids)
        if needs_draft_prompt(q.mode):
            draft = services.prompts.draft_prompt(join_hits(rag), q.question, q.history, system=q.system)
            prompt = replace(prompt, draft_ids=draft)
        if needs_draft_rows(q.mode) and not prompt.context_truncated:
            prompt = replace(prompt, draft_rows=services.prompts.draft_rows(prompt, docs, rag))
        return prompt, sources

    async def prepare() -> Plan:
        prompt, sources = await asyncio.to_thread(build)
        config = GenerationConfig(max_new_tokens=max_tokens, sampling=q.sampling, stop=q.stop, logprobs=q.logprobs)
        return Plan(
            tenant=tenant, question=q, prompt=prompt, config=config, drafters=drafters, sources=sources,
            arrived=arrived,
        )

    return prepare


def start(services: Services, p: Plan) -> JobHandle:
    """Queue the generation (raises ``Overloaded`` -> 429 when the queue is full)."""
    engine, metrics, mode = services.engine, services.metrics, p.question.mode

    def run(cancel: threading.Event) -> Iterator[GenerationEvent]:
        began = time.perf_counter()
        for event in engine.generate(p.prompt, p.config, p.drafters, cancel=cancel):
            if isinstance(event, DoneEvent):  # observed here: a cancelled stream has no reader left
                event = _ttft_from_arrival(event, began - p.arrived)
                metrics.observe_generation(mode, event.stats, p.tenant)
            yield event
        services.recalibrate_if_due()  # queued behind waiting questions: runs between requests

    kv_bytes = engine.kv_bytes(engine.cache_rows(len(p.prompt.ids), p.config))
    p.handle = _counted(services, lambda: services.scheduler.submit(run, key=p.prompt.prefix_key, kv_bytes=kv_bytes))
    return p.handle


def _ttft_from_arrival(done: DoneEvent, before_s: float) -> DoneEvent:
    """The engine times its first token from the generation's start; the client waited ``before_s`` more
    (retrieval, the prompt's build, the queue) since its request arrived."""
    if done.stats.completion_tokens == 0:  # no first token: nothing to time
        return done
    return replace(done, stats=replace(done.stats, ttft_s=done.stats.ttft_s + before_s))


def _counted(services: Services, admit: Callable[[], T]) -> T:
    try:
        return admit()
    except Overloaded:
        services.metrics.rejected.inc()
        raise


async def events(
    p: Plan, request: Request | None = None
) -> AsyncIterator[TokenEvent | PrefillEvent | Queued]:
    """The generation's text, queue and prefill-progress events; records the final ``DoneEvent`` on the plan. A
    client that goes away (``request`` disconnects) cancels the generation within one decode step or one
    prefill chunk."""
    assert p.handle is not None
    handle = p.handle
    watcher = asyncio.create_task(_watch_disconnect(request, handle)) if request is not None else None
    try:
        async for event in handle.events():
            if isinstance(event, DoneEvent):
                p.done = event
            elif isinstance(event, TokenEvent):
                p.text.append(event.text)
                yield event
            elif isinstance(event, PrefillEvent | Queued):
                yield event
    finally:
        handle.cancel()
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher


async def _watch_disconnect(request: Request, handle: JobHandle) -> None:
    while not handle.cancel_event.is_set():
        if await request.is_disconnected():
            logger.info("client went away; cancelling its generation")
            handle.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def complete(services: Services, p: Plan, request: Request) -> DoneEvent:
    """Run a non-streaming generation to its end (cancelled if the client goes away meanwhile)."""
    try:
        async for _ in events(p, request):
            pass
    finally:
        await finish(services, p)
    if p.done is None:  # cancelled before it ran: nobody is waiting for this answer any more
        raise InvalidRequest("the request was cancelled")
    return p.done


async def finish(services: Services, p: Plan) -> None:
    """After the last event: the answer's citations (app/answering/citations.py), the session's history and the
    tenant's cross-session draft cache."""
    done = p.done
    if done is None:
        return
    p.citations = await asyncio.to_thread(cite, done.text, p.sources)
    if done.finish_reason == "cancelled":
        return
    if "racer" not in MODES[p.question.mode]:  # RACER's drafter feeds the tier itself where it runs
        await asyncio.to_thread(services.drafters.learn, p.tenant, p.prompt.ids, done.token_ids)
    if p.question.session_id is not None:
        await services.sessions.append(p.tenant, p.question.session_id, Turn(
            p.question.question, done.text, tuple(p.question.document_ids), tuple(s.model_dump() for s in p.sources),
            p.citations.model_dump() if p.citations is not None else None,
        ))


def citations_of(p: Plan) -> Citations:
    """The plan's citations (none before ``finish`` has run, or for a generation that never ran)."""
    if p.citations is not None:
        return p.citations
    text = p.done.text if p.done is not None else ""
    return Citations(citations=[], cited_answer=text, highlights=[[] for _ in p.sources])


def progress_out(event: PrefillEvent | Queued) -> dict[str, object]:
    """The payload of a progress event: waiting for the engine (``position`` 1 runs next, ``eta_s`` the
    estimated seconds until it starts, null until a generation has been timed), or the prompt's prefill,
    ``done`` of ``total`` tokens (``reused`` of them from the KV prefix cache)."""
    if isinstance(event, Queued):
        return {"stage": "queued", "position": event.position, "eta_s": event.eta_s}
    return {"stage": "prefill", "done": event.done, "total": event.total, "reused": event.reused}


def stats_out(stats: GenerationStats, mode: str) -> AskStats:
    return AskStats(
        ttft_ms=round(stats.ttft_s * 1000, 3),
        tokens_per_second=round(stats.tokens_per_second, 3),
        acceptance_length=round(stats.acceptance_length, 4),
        drafted=stats.drafted,
        drafted_by_source=dict(stats.drafted_by_source),
        accepted_by_source=dict(stats.accepted_by_source),
        prefix_cache_hit=stats.prefix_cache_hit,
        prefix_reused_tokens=stats.prefix_reused_tokens,
        context_truncated=stats.context_truncated,
        finish_reason=stats.finish_reason,
        mode=mode,
    )


def usage_out(stats: GenerationStats) -> Usage:
    return Usage(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.completion_tokens)
