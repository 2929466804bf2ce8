"""The answer pipeline itself (``app.answering.pipeline.answer``), called on a running server's services as the
routes and the CLI call it: its events' order, its checks raised by the call before any event (retrieval waits
for the first read), its accounting done before ``Finished`` is seen and nothing recorded for a consumer that
stops early, and a client gone while its generation waits (``disconnected``) cancelling it before it runs.
Bundled SmolLM2 on one thread, one generation at a time."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from app.answering import pipeline as answering
from app.answering.events import AnswerEvent, Finished, Prefill, Sources, Token
from app.answering.pipeline import NeverRan, Question
from app.answering.sampling import sampling_params
from app.errors import InvalidRequest
from app.schemas import LogitControls
from app.services import Services
from decoding.errors import ContextTooLong
from decoding.speculative.generation import SamplingParams
from retrieval.errors import DocumentNotFound
from retrieval.store import DEFAULT_TENANT
from tests.app.live import ThreadServer, engine_held, metric, wait_for
from tests.conftest import CountingEmbedder

pytestmark = pytest.mark.real_model

# Greedy SmolLM2 without a penalty counts on and on: a generation still running when its consumer stops
COUNTING = "Write the numbers from 1 to 200, one per line."


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"max_batch": 1}  # one generation at a time: a held engine makes a question wait


def a_question(services: Services, doc: str, text: str = "Where is the Colosseum?", **fields: Any) -> Question:
    """Greedy with the server's default penalties, as an API request that sets none."""
    sampling = sampling_params(LogitControls.model_validate({}), services.config.penalties, services.vocab_size,
                               temperature=0.0, top_p=1.0, seed=None)
    return Question(**{"question": text, "document_ids": [doc], "max_tokens": 8, "sampling": sampling, **fields})


async def read_all(events: AsyncIterator[AnswerEvent]) -> list[AnswerEvent]:
    return [e async for e in events]


def test_an_answer_is_its_sources_prefill_tokens_then_finished_as_the_json_answer(
    server: ThreadServer, client: httpx.Client, doc: str
) -> None:
    services = server.services
    question = a_question(services, doc)
    events = asyncio.run(read_all(answering.answer(services, DEFAULT_TENANT, question)))
    kinds = [type(e) for e in events]
    first_token = kinds.index(Token)
    assert kinds[0] is Sources and kinds[-1] is Finished
    assert set(kinds[1:first_token]) == {Prefill}  # nothing waits: the prompt is read, then the text comes
    assert set(kinds[first_token:-1]) == {Token}
    sources, finished = events[0], events[-1]
    assert isinstance(sources, Sources) and isinstance(finished, Finished)
    assert "".join(e.text for e in events if isinstance(e, Token)) == finished.text
    prefill = [e for e in events if isinstance(e, Prefill)]
    assert all(p.total == finished.usage.prompt_tokens for p in prefill)
    assert finished.finish_reason == finished.stats.finish_reason in ("stop", "length")
    assert finished.logprobs is None and finished.trailing_logprobs == ()  # none asked
    assert all(e.logprobs is None for e in events if isinstance(e, Token))

    body = client.post("/v1/ask", json={"question": question.question, "document_ids": [doc], "max_tokens": 8})
    assert body.status_code == 200, body.text
    plain = body.json()  # the route is a framing of the same events
    assert finished.text == plain["answer"] and finished.citations.cited_answer == plain["cited_answer"]
    assert [c.model_dump(mode="json") for c in finished.citations.citations] == plain["citations"]
    assert [s.model_dump(mode="json") for s in finished.sources] == plain["sources"]  # with their highlights
    assert [s.model_dump(mode="json") for s in sources.sources] == [{**s, "highlights": []} for s in plain["sources"]]
    assert finished.usage.model_dump() == plain["usage"]


def test_the_checks_raise_from_the_call_and_retrieval_waits_for_the_first_read(
    server: ThreadServer, doc: str
) -> None:
    services = server.services
    question = a_question(services, doc, "Which of the landmarks stands in Paris?")
    with pytest.raises(InvalidRequest, match="must not be blank"):
        answering.answer(services, DEFAULT_TENANT, replace(question, question="   "))
    with pytest.raises(DocumentNotFound):
        answering.answer(services, DEFAULT_TENANT, replace(question, document_ids=["no-such-document"]))
    with pytest.raises(ContextTooLong):  # over the test server's 1024-token window, within the character limit
        answering.answer(services, DEFAULT_TENANT, replace(question, question="9 " * 1900))

    counting = CountingEmbedder(services.retriever.embedder)
    services.retriever.embedder = counting
    completed = services.scheduler.completed

    async def main() -> tuple[list[list[str]], AnswerEvent, list[list[str]]]:
        events = answering.answer(services, DEFAULT_TENANT, question)  # its checks pass
        before = list(counting.calls)
        first = await events.__anext__()
        after = list(counting.calls)
        await events.aclose()  # gone at its sources: nothing was queued
        return before, first, after

    try:
        before, first, after = asyncio.run(main())
    finally:
        services.retriever.embedder = counting.inner
    assert before == []  # answer() itself did not retrieve
    assert isinstance(first, Sources) and after == [[question.question]]  # the first read did, once
    assert services.scheduler.completed == completed and services.scheduler.waiting == 0


def test_the_accounting_is_done_before_finished_is_seen(server: ThreadServer, doc: str) -> None:
    """A consumer that stops at ``Finished`` (never reading past it) finds the session's history written."""
    services = server.services
    question = a_question(services, doc, session_id="pipeline-finished")

    async def main() -> tuple[Finished, list[Any]]:
        events = answering.answer(services, DEFAULT_TENANT, question)
        async for event in events:
            if isinstance(event, Finished):
                turns = await services.sessions.history(DEFAULT_TENANT, "pipeline-finished")
                await events.aclose()
                return event, turns
        raise AssertionError("the answer never finished")

    finished, turns = asyncio.run(main())
    (turn,) = turns
    assert (turn.question, turn.answer, turn.documents) == (question.question, finished.text, (doc,))
    assert list(turn.sources) == [s.model_dump() for s in finished.sources]
    assert turn.citations == finished.citations.model_dump()


def test_a_consumer_that_stops_early_cancels_the_generation_and_records_nothing(
    server: ThreadServer, client: httpx.Client, doc: str
) -> None:
    services = server.services
    question = a_question(services, doc, COUNTING, max_tokens=64, mode="autoregressive", sampling=SamplingParams(),
                          session_id="pipeline-early")
    labels = {"mode": "autoregressive", "finish_reason": "cancelled"}
    cancelled = metric(client, "ragspec_generations_total", **labels)

    async def main() -> Token:
        events = answering.answer(services, DEFAULT_TENANT, question)
        async for event in events:
            if isinstance(event, Token):
                await events.aclose()  # as a client that goes away after the first token
                return event
        raise AssertionError("no token came")

    assert asyncio.run(main()).text

    def freed() -> bool:
        gone = metric(client, "ragspec_generations_total", **labels) == cancelled + 1
        return gone and not services.scheduler.running

    wait_for(freed, "the generation to be cancelled")
    assert asyncio.run(services.sessions.history(DEFAULT_TENANT, "pipeline-early")) == []  # no turn of it


def test_a_client_gone_while_its_generation_waits_cancels_it_before_it_runs(server: ThreadServer, doc: str) -> None:
    """``disconnected`` (a JSON request's own check) is polled while the generation waits: once true the
    generation leaves the queue without running, and reading the answer raises ``NeverRan``."""
    services = server.services
    question = a_question(services, doc, session_id="pipeline-gone")
    asked = threading.Event()

    async def gone() -> bool:
        asked.set()
        return True

    async def main() -> None:
        await answering.complete(answering.answer(services, DEFAULT_TENANT, question, disconnected=gone))

    with engine_held(services):
        with pytest.raises(NeverRan, match="the request was cancelled"):
            asyncio.run(main())
        assert services.scheduler.waiting == 0  # it left the queue while the engine was still held
    assert asked.is_set()
    assert asyncio.run(services.sessions.history(DEFAULT_TENANT, "pipeline-gone")) == []
