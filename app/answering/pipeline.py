"""One answer, the same for ``/v1/ask``, ``/v1/chat/completions`` and the CLI's ``ask``: the request's checks,
then, as its events are read, the documents' chunks ranked once (sources, the target's window, RAPID's context),
the target's prompt, the queued generation, and its accounting (citations, session history, cross-session draft
cache; the generation's metrics are observed where it runs, whoever reads it).

``answer`` runs the checks when it is called, so that their 4xx errors are raised before any response starts,
and returns the answer's events (``app.answering.events``) without doing more: a stream sends its first bytes,
then reads the events, and only then does retrieval begin. The APIs differ only in how they frame the events;
a JSON answer reads them to the end (``complete``), a stream reports a late error in band (``in_band``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from app.answering.citations import cite
from app.answering.drafters import needs_draft_prompt, needs_draft_rows
from app.answering.events import AnswerEvent, Failed, Finished, Prefill, Reasoning, Sources, Token, Waiting
from app.answering.followup import retrieval_queries
from app.answering.prompts import SYSTEM_PROMPT, document_texts
from app.errors import InvalidRequest, Overloaded, translate
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
from retrieval.catalogue import DocumentRecord, MemberCounts
from retrieval.errors import CollectionNotReady, DocumentNotFound, DocumentNotReady
from retrieval.filters import Attributes, Filter, parse_filter
from retrieval.retriever import DEFAULT_CANDIDATES, Hit, Ranking, join_hits, pack_hits

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25
WHOLE_SLACK = 256  # prompt tokens kept for the template, the question and the titles when a collection is read whole
T = TypeVar("T")
Disconnected = Callable[[], Awaitable[bool]]  # whether the client has gone away (a JSON request's own check)


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
    collection_ids: Sequence[str] = ()  # collections asked, beside or instead of documents
    filter: Mapping[str, Any] | None = None  # an attribute filter over the collections' documents (its JSON form)


@dataclass(frozen=True)
class Scope:
    """A question over collections: which, the parsed filter, what the catalogue said of their matching documents,
    and whether the ready ones fit the target's window together (``whole``: read whole, as named documents are;
    else the best chunks across the collections, from their indexes)."""

    collection_ids: tuple[str, ...]
    where: Filter | None
    counts: MemberCounts
    versions: dict[str, int]
    whole: bool

    @property
    def pending(self) -> int:
        return self.counts.by_status.get("queued", 0) + self.counts.by_status.get("indexing", 0)

    @property
    def ready(self) -> int:
        return self.counts.by_status.get("ready", 0)


@dataclass(frozen=True)
class Admission:
    """A question whose checks passed: its effective ``max_tokens``, its drafters, its documents (ready, in upload
    order) and when it arrived (``time.perf_counter()``, where ``ttft_ms`` counts from)."""

    tenant: str
    question: Question
    max_tokens: int
    drafters: tuple[Drafter, ...]
    records: tuple[DocumentRecord, ...]
    arrived: float
    scope: Scope | None = None


@dataclass(frozen=True)
class Plan:
    """Everything the generation needs: the prompt (and RAPID's context in it), its config, its drafters and the
    sources shown with the answer (best first)."""

    tenant: str
    question: Question
    prompt: Prompt
    config: GenerationConfig
    drafters: tuple[Drafter, ...]
    sources: tuple[Source, ...]
    arrived: float  # perf_counter() at the request's arrival
    documents: int = 0  # documents the question was asked over (named, and the collections' ready matches)
    documents_pending: int = 0  # the collections' matching documents still queued or indexing


class NeverRan(InvalidRequest):
    """The generation was cancelled before it ran (its client went away while it waited, or the service is
    stopping): nobody is waiting for this answer any more."""

    def __init__(self) -> None:
        super().__init__("the request was cancelled")


def check_limits(
    services: Services, question: str, document_ids: Sequence[str], max_tokens: int | None,
    collection_ids: Sequence[str] = (),
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
    if len(collection_ids) > limits.max_collection_ids:
        raise InvalidRequest(
            f"collection_ids: {len(collection_ids)} given, at most {limits.max_collection_ids} allowed"
        )
    if max_tokens is not None and max_tokens > limits.max_new_tokens:
        raise InvalidRequest(f"max_tokens: {max_tokens} is above the limit of {limits.max_new_tokens}")
    return max_tokens or limits.default_max_tokens


def source_of(hit: Hit, title: str | None = None, attributes: Attributes | None = None) -> Source:
    return Source(
        document_id=hit.document_id,
        title=title,
        attributes=attributes or {},
        chunk_id=str(hit.chunk_id),
        text=hit.text,
        score=hit.score,
        similarity=hit.similarity if hit.similarity is not None else hit.score,
        start=hit.start,
        end=hit.end,
        page=hit.page,
        page_end=hit.page_end,
    )


# ---- the answer ------------------------------------------------------------------------------------


def answer(
    services: Services, tenant: str, q: Question, *, arrived: float | None = None,
    disconnected: Disconnected | None = None,
) -> AsyncGenerator[AnswerEvent, None]:
    """The request's checks, now: their 4xx errors are raised by this call, before any response starts. Returns
    the answer's events, which do nothing until read: ``Sources`` (retrieval and the prompt run then, off the
    event loop), ``Waiting`` / ``Prefill`` while the generation waits and reads its prompt, ``Token``s, then
    ``Finished`` once the accounting has run. ``arrived`` (``time.perf_counter()`` at the request's arrival,
    default now) is where ``ttft_ms`` counts from; ``disconnected`` (polled while the generation is queued or
    runs) cancels it when it turns true, as a consumer that stops reading does."""
    return _answer(services, admit(services, tenant, q, arrived), disconnected)


def admit(services: Services, tenant: str, q: Question, arrived: float | None = None) -> Admission:
    """The request's checks, which raise its 4xx errors: limits, a question too long for the window, the mode,
    a full queue, a cache too big for the working pool, unknown or unready documents."""
    arrived = time.perf_counter() if arrived is None else arrived
    max_tokens = check_limits(services, q.question, q.document_ids, q.max_tokens, q.collection_ids)
    if q.filter is not None and not q.collection_ids:
        raise InvalidRequest("filter: applies to the documents of collections; name collection_ids")
    where = parse_filter(q.filter) if q.filter is not None else None  # InvalidFilter: 422
    # a question (with its history) too long for the window is the request's fault: a 400 before any stream
    # starts, found by tokenizing it alone (the documents are fitted after retrieval)
    services.prompts.fit([], q.question, q.history, max_tokens, None, system=q.system)
    drafters = services.drafters.for_mode(q.mode, tenant, q.sampling)
    _counted(services, services.scheduler.ensure_room)  # a full queue refuses before any work
    # a cache for the answer alone must fit the working pool (the prompt's rows are counted once it is built)
    services.scheduler.check_fits(services.engine.kv_bytes(max_tokens))
    records = [services.store.get(doc_id, tenant) for doc_id in dict.fromkeys(q.document_ids)]  # unknown: 404
    scope = None
    if q.collection_ids:
        scope = _scope(services, tenant, q.collection_ids, where, max_tokens)
        if scope.ready == 0 and not records:
            raise CollectionNotReady(list(scope.collection_ids), scope.pending,
                                     scope.counts.by_status.get("failed", 0), where is not None)
        if scope.whole:  # read whole, as named documents are
            named = {r.id for r in records}
            records += [r for r in services.store.members(scope.collection_ids, where=where, statuses=["ready"])
                        if r.id not in named]
    # one order for a set of documents, whatever order they are named in (upload order): the same prompt, so
    # the same cached prefix KV, and no second copy of it on disk for every permutation
    records.sort(key=lambda r: (r.created_at, r.id))
    not_ready = [r for r in records if r.status != "ready"]
    if not_ready:
        first = not_ready[0]
        if len(not_ready) > 1:
            states = ", ".join(f"{r.id}: {r.status}" for r in not_ready)
            raise DocumentNotReady(first.id, first.status, f"documents not ready ({states})")
        raise DocumentNotReady(first.id, first.status, first.message)
    return Admission(tenant, q, max_tokens, tuple(drafters), tuple(records), arrived, scope)


def _scope(services: Services, tenant: str, collection_ids: Sequence[str], where: Filter | None,
           max_tokens: int) -> Scope:
    """The collections (the tenant's: unknown ones 404) and what they hold that matches ``where``."""
    cids = tuple(dict.fromkeys(collection_ids))
    for cid in cids:
        services.store.get_collection(cid, tenant)
    counts = services.store.member_counts(cids, where=where)
    versions = services.store.collection_versions(cids)
    room = services.prompts.max_context - max_tokens - WHOLE_SLACK
    whole = counts.by_status.get("ready", 0) > 0 and counts.ready_tokens <= room
    return Scope(cids, where, counts, versions, whole)


def plan(services: Services, admission: Admission) -> Plan:
    """Retrieval and the prompt (blocking: the answer runs it in a worker thread). Retrieval is scored once: the
    sources, the target's window (documents longer than it) and RAPID's context all come from one ranking."""
    q, tenant, records, scope = admission.question, admission.tenant, admission.records, admission.scope
    doc_ids = [r.id for r in records]
    queries = retrieval_queries(q.question, q.history)
    ranking, hits = None, []
    if doc_ids:
        ranking = services.retriever.rank(queries, doc_ids, tenant=tenant)
    library = scope is not None and not scope.whole and scope.ready > 0
    if scope is not None and library:
        ranking = _rank_library(services, admission, queries, ranking)
    if ranking is not None:
        hits = ranking.relevant().hits
    titles = {r.id: r.title for r in records}
    if library and ranking is not None:
        titles.update(_titles(services, {h.document_id for h in ranking.hits} - set(titles)))
    attributes = services.store.attributes({h.document_id for h in hits}) if hits else {}
    sources = tuple(source_of(h, titles.get(h.document_id), attributes.get(h.document_id))
                    for h in sorted(hits, key=lambda h: -h.score))  # best first
    if library and ranking is not None:  # past the window: the best chunks across the collections, titled
        prompt = services.prompts.fit_chunks(ranking, _library_key(scope, doc_ids), q.question, q.history,
                                             admission.max_tokens, titles, system=q.system)
        docs = []
    else:
        docs = document_texts(services.store, records)
        prompt = services.prompts.fit(docs, q.question, q.history, admission.max_tokens, ranking, system=q.system)
    if prompt.prefix_key is not None and doc_ids:
        services.prefix_registry.add(prompt.prefix_key, doc_ids)
    # RAPID reads the best retrieved chunks within its own budget: as a prompt of its own, or as their rows of the
    # target's cache
    if needs_draft_prompt(q.mode) or needs_draft_rows(q.mode):
        budget = min(services.config.rapid.context_tokens, services.retriever.budget_cap)
        rag = pack_hits(hits, budget, ranking.doc_ids if ranking is not None else doc_ids)
    if needs_draft_prompt(q.mode):
        draft = services.prompts.draft_prompt(join_hits(rag), q.question, q.history, system=q.system)
        prompt = replace(prompt, draft_ids=draft)
    if needs_draft_rows(q.mode) and not prompt.context_truncated and docs:
        prompt = replace(prompt, draft_rows=services.prompts.draft_rows(prompt, docs, rag))
    config = GenerationConfig(max_new_tokens=admission.max_tokens, sampling=q.sampling,
                              stop=(*q.stop, *services.prompts.stops), logprobs=q.logprobs,
                              channels=services.prompts.channels)
    n_docs = len(records) + (scope.ready if library and scope is not None else 0)
    return Plan(tenant, q, prompt, config, admission.drafters, sources, admission.arrived,
                documents=n_docs, documents_pending=scope.pending if scope is not None else 0)


def _rank_library(services: Services, admission: Admission, queries: Sequence[str],
                  named: Ranking | None) -> Ranking:
    """The collections' candidates ranked (enough of them to fill the target's window), with the named documents'
    ranking when there is one: one ranking per question."""
    scope = admission.scope
    assert scope is not None
    allowed = None
    if scope.where is not None:  # the catalogue answers the filter; the indexes search only what it allows
        allowed = set(services.store.member_stamps(scope.collection_ids, where=scope.where))
    chunk_tokens = max(1, scope.counts.tokens // max(scope.counts.chunks, 1))
    candidates = max(DEFAULT_CANDIDATES, 2 * services.prompts.max_context // chunk_tokens)
    ranking = services.retriever.rank_library(
        queries, services.library, scope.collection_ids, total_tokens=scope.counts.ready_tokens, allowed=allowed,
        candidates=candidates, tenant=admission.tenant,
    )
    if named is None:
        return ranking
    seen = {(h.document_id, h.chunk_id) for h in named.hits}
    extra = tuple(h for h in ranking.hits if (h.document_id, h.chunk_id) not in seen)
    order = named.doc_ids + tuple(d for d in ranking.doc_ids if d not in set(named.doc_ids))
    return replace(named, doc_ids=order, hits=named.hits + extra,
                   budget_tokens=max(named.budget_tokens, ranking.budget_tokens))


def _titles(services: Services, doc_ids: set[str]) -> dict[str, str]:
    titles = {}
    for doc_id in doc_ids:
        with contextlib.suppress(DocumentNotFound):
            titles[doc_id] = services.store.get(doc_id).title
    return titles


def _library_key(scope: Scope | None, doc_ids: Sequence[str]) -> list[str]:
    """What names a collection question's prefix: the collections at their versions, the filter, the named
    documents (a chunk's cached KV is reused while none of these changes)."""
    assert scope is not None
    parts = [f"collection:{cid}@{scope.versions.get(cid, 0)}" for cid in scope.collection_ids]
    if scope.where is not None:
        parts.append(f"filter:{scope.where!r}")
    return parts + list(doc_ids)


async def _answer(
    services: Services, admission: Admission, disconnected: Disconnected | None
) -> AsyncGenerator[AnswerEvent, None]:
    planned = await asyncio.to_thread(plan, services, admission)
    async with contextlib.aclosing(answer_plan(services, planned, disconnected)) as events:
        async for event in events:
            yield event


async def answer_plan(
    services: Services, p: Plan, disconnected: Disconnected | None = None
) -> AsyncGenerator[AnswerEvent, None]:
    """A planned answer's events: its ``Sources``, the queued generation's progress and tokens, then
    ``Finished``. The accounting runs in ``finally``, so also when the consumer stops early or the generation
    fails, with what the generation got to (``_account``: one that never finished adds nothing). A consumer
    that stops reading, or ``disconnected()`` turning true, cancels the generation within one decode step or
    one prefill chunk; one cancelled before it ran raises ``NeverRan``."""
    yield Sources(p.sources)
    handle = _start(services, p)
    watcher = asyncio.create_task(_watch_disconnect(disconnected, handle)) if disconnected is not None else None
    asked = p.question.logprobs is not None
    done: DoneEvent | None = None
    shown = 0  # log-probabilities the Token events carried
    try:
        async for event in handle.events():
            if isinstance(event, DoneEvent):
                done = event
            elif isinstance(event, TokenEvent):
                if event.reasoning:  # a harmony model's analysis channel: never the answer
                    yield Reasoning(event.reasoning)
                if event.text:  # a token whose text is held back (a stop string may follow) shows nothing yet
                    shown += len(event.logprobs)
                    yield Token(event.text, tuple(services.logprob_text(event.logprobs)) if asked else None)
            elif isinstance(event, Queued):
                yield Waiting(event.position, event.eta_s)
            elif isinstance(event, PrefillEvent):
                yield Prefill(event.done, event.total, event.reused)
    finally:
        handle.cancel()
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        accounted = await _account(services, p, done)
    if done is None or accounted is None:  # cancelled before it ran
        raise NeverRan()
    sources, citations = accounted
    logprobs = None if done.logprobs is None else tuple(services.logprob_text(done.logprobs))
    yield Finished(
        text=done.text,
        finish_reason=done.finish_reason,
        sources=sources,
        citations=citations,
        stats=_ask_stats(done.stats, p.question.mode, p),
        usage=Usage(prompt_tokens=done.stats.prompt_tokens, completion_tokens=done.stats.completion_tokens),
        logprobs=logprobs,
        trailing_logprobs=logprobs[shown:] if logprobs else (),
        reasoning=done.reasoning,
    )


async def complete(events: AsyncIterator[AnswerEvent]) -> Finished:
    """Read an answer to its end (a JSON response): its ``Finished``; whatever it raised (``NeverRan`` when it
    was cancelled before it ran) propagates."""
    last: AnswerEvent | None = None
    async for event in events:
        last = event
    if not isinstance(last, Finished):  # an answer ends with Finished or raises
        raise RuntimeError(f"the answer ended with {type(last).__name__}, not Finished")
    return last


async def in_band(events: AsyncGenerator[AnswerEvent, None]) -> AsyncGenerator[AnswerEvent | Failed, None]:
    """A stream's answer events, an error raised after its response began (its status already sent) turned into
    a last ``Failed`` event: a domain error's code and message, a generation cancelled before it ran as
    ``cancelled``, anything else (a bug: logged) as ``internal_error``."""
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                yield event
        except NeverRan:
            yield Failed("cancelled", "the generation was cancelled")
        except Exception as exc:
            err = translate(exc)
            if err is None:
                logger.exception("generation failed mid-stream")
                yield Failed("internal_error", "generation failed")
            else:
                yield Failed(err.code, err.message)


# ---- the generation and its accounting ---------------------------------------------------------------


def _start(services: Services, p: Plan) -> JobHandle:
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
    return _counted(services, lambda: services.scheduler.submit(run, key=p.prompt.prefix_key, kv_bytes=kv_bytes))


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


async def _watch_disconnect(disconnected: Disconnected, handle: JobHandle) -> None:
    while not handle.cancel_event.is_set():
        if await disconnected():
            logger.info("client went away; cancelling its generation")
            handle.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _account(
    services: Services, p: Plan, done: DoneEvent | None
) -> tuple[tuple[Source, ...], Citations] | None:
    """After the last event: the answer's citations (app/answering/citations.py; they set the highlights of
    copies of the sources, the plan's stay as shown first), then, unless the generation was cancelled (nobody
    reads that answer), the tenant's cross-session draft cache and the session's history. Nothing for a
    generation that never finished here: cancelled before it ran, failed, or left by its consumer."""
    if done is None:
        return None
    sources = tuple(s.model_copy() for s in p.sources)
    citations = await asyncio.to_thread(cite, done.text, sources)
    if done.finish_reason == "cancelled":
        return sources, citations
    await asyncio.to_thread(services.drafters.learn, p.tenant, p.prompt.ids, done.token_ids, p.prompt.prefix_key,
                            "racer" not in MODES[p.question.mode])  # RACER's drafter counts its own answers
    if p.question.session_id is not None:
        await services.sessions.append(p.tenant, p.question.session_id, Turn(
            p.question.question, done.text, tuple(p.question.document_ids), tuple(s.model_dump() for s in sources),
            citations.model_dump(), collections=tuple(p.question.collection_ids),
            filter=dict(p.question.filter) if p.question.filter is not None else None,
        ))
    return sources, citations


def _ask_stats(stats: GenerationStats, mode: str, p: Plan) -> AskStats:
    return AskStats(
        documents=p.documents,
        documents_pending=p.documents_pending,
        context="chunks" if stats.context_truncated else "documents",
        ttft_ms=round(stats.ttft_s * 1000, 3),
        tokens_per_second=round(stats.tokens_per_second, 3),
        acceptance_length=round(stats.acceptance_length, 4),
        drafted=stats.drafted,
        drafted_by_source=dict(stats.drafted_by_source),
        accepted_by_source=dict(stats.accepted_by_source),
        drafting_ms={d: round(s * 1000, 3) for d, s in stats.draft_s_by_drafter.items()},
        prefix_cache_hit=stats.prefix_cache_hit,
        prefix_reused_tokens=stats.prefix_reused_tokens,
        context_truncated=stats.context_truncated,
        finish_reason=stats.finish_reason,
        mode=mode,
    )
