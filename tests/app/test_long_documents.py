"""Documents longer than the target's window, over real HTTP: the lead's KV computed at upload, chunk KV reused
by later questions, prefill progress on the stream, and a client that leaves during a long prefill freeing the
engine at once (bundled SmolLM2 on one thread, a 4K window read whole)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from app.answering.pipeline import Question, admit, plan
from decoding.speculative.generation import SamplingParams
from retrieval.store import DEFAULT_TENANT
from tests.app.live import ThreadServer, metric, upload_text, wait_for, wait_indexed
from tests.conftest import CountingEmbedder

pytestmark = [pytest.mark.real_model, pytest.mark.heavy]

LEAD = 512  # tokens of the document's beginning every prompt starts with
WINDOW = 8192  # the bundled model's own: a prefill of it lasts long enough to tell a cancel from its end


def chronicle() -> str:
    """~12K tokens of distinct facts (a city chronicle), so that the window cannot hold it."""
    trades = ["weavers", "smiths", "bakers", "masons", "dyers", "coopers", "tanners", "glaziers"]
    lines = ["The Chronicle of Ostmark\n\nThis chronicle records the guilds and the harbour of Ostmark."]
    for year in range(1400, 1820):
        trade = trades[year % len(trades)]
        lines.append(f"In {year} the {trade} of Ostmark elected master number {year - 1399}, who paid "
                     f"{(year * 7) % 97} silver marks for the hall on street {year % 13}.")
    lines.append("The harbour master of Ostmark keeps the key to the tide gate, painted red.")
    return "\n\n".join(lines)


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"max_context": WINDOW, "long_document_budget": 0, "long_document_lead": LEAD, "default_max_tokens": 8}


@pytest.fixture(scope="module")
def doc(client: httpx.Client) -> str:
    """The chronicle (instead of the conftest's short document), indexed, its lead's KV computed."""
    doc_id = upload_text(client, chronicle(), title="chronicle")
    record = wait_indexed(client, doc_id)
    assert record["status"] == "ready" and record["tokens"] > WINDOW
    wait_for(lambda: metric(client, "ragspec_kv_cache_bytes") > 0, "the lead's KV computed after the upload")
    return doc_id


def test_the_first_question_reuses_the_lead_computed_at_upload(client: httpx.Client, doc: str) -> None:
    body = {"question": "Who keeps the key to the tide gate?", "document_ids": [doc], "max_tokens": 4}
    first = client.post("/v1/ask", json=body).json()
    assert first["stats"]["context_truncated"] is True
    assert LEAD // 2 < first["stats"]["prefix_reused_tokens"] < first["usage"]["prompt_tokens"] // 2
    again = client.post("/v1/ask", json=body).json()
    assert again["stats"]["prefix_reused_tokens"] > first["usage"]["prompt_tokens"] - 40
    assert again["answer"] == first["answer"]  # greedy: the same answer from cached KV


def test_a_client_leaving_during_a_long_prefill_frees_the_engine(client: httpx.Client, doc: str) -> None:
    body = {"question": "What did the dyers pay in 1525?", "document_ids": [doc], "max_tokens": 4, "stream": True}
    seen = []
    with connect_sse(client, "POST", "/v1/ask", json=body) as source:
        t0 = time.monotonic()
        for event in source.iter_sse():
            if event.event == "progress":
                seen.append(json.loads(event.data))
                if len(seen) >= 3:
                    break  # two chunks read since the first event: the prefill runs
        elapsed = time.monotonic() - t0
    left = time.monotonic()  # leaving the block closed the connection
    first, last = seen[0], seen[-1]
    assert first["stage"] == "prefill" and first["reused"] > 0 and last["done"] > first["done"]
    rate = (last["done"] - first["done"]) / elapsed
    remaining_s = (last["total"] - last["done"]) / rate
    assert remaining_s > 4, f"the prefill is too short to tell a cancel from its end ({remaining_s:.1f} s)"
    wait_for(lambda: metric(client, "ragspec_generation_running") == 0, "the engine to stop", deadline_s=5)
    freed_s = time.monotonic() - left
    print(f"engine freed {freed_s:.2f} s after the disconnect ({remaining_s:.1f} s of prefill were left)")
    assert freed_s < remaining_s / 2
    # the next question runs at once, after the chunks the cancelled one finished (they stay cached)
    quick = client.post("/v1/ask", json={**body, "stream": False}).json()
    assert quick["stats"]["prefix_reused_tokens"] >= last["done"]


def test_a_question_is_embedded_once_and_its_ranking_feeds_window_and_sources(
    server: ThreadServer, client: httpx.Client, doc: str
) -> None:
    """One embedder call per question on the long-document path: its sources, the window the target reads and,
    in a session, the follow-up query all come from one ranking; a follow-up's window holds its sources."""
    services = server.app.state.services
    counting = CountingEmbedder(services.retriever.embedder)
    services.retriever.embedder = counting
    question, follow_up = "Who keeps the key to the tide gate?", "And what colour is it painted?"
    try:  # the first test's question: its window's KV is cached, so this costs no prefill
        first = client.post("/v1/ask", json={"question": question, "document_ids": [doc], "max_tokens": 2}).json()
        assert counting.calls == [[question]]
        asked = Question(follow_up, [doc], 2, SamplingParams(), mode="rapid", history=[(question, first["answer"])])
        planned = plan(services, admit(services, DEFAULT_TENANT, asked))  # everything up to the generation
        assert counting.calls[1:] == [[follow_up, f"{question} {follow_up}"]]
    finally:
        services.retriever.embedder = counting.inner
    assert first["stats"]["context_truncated"] is True and planned.prompt.context_truncated
    (source,) = [s for s in planned.sources if "tide gate, painted red" in s.text]
    decode = services.target.tokenizer.decode
    assert source.text in decode(planned.prompt.prefix_ids)  # the window is cut from the sources' ranking
    assert planned.prompt.draft_ids is not None and source.text in decode(planned.prompt.draft_ids)  # RAPID's too
