"""Asking collections over real HTTP: a collection that fits the target's window is read whole, one that does not by
its best chunks across the collection (titled); either way every mode's greedy answer equals autoregressive decoding;
attribute filters, deletion and removal are immediate; sessions keep the collection for follow-ups; the OpenAI client
asks a collection with ``extra_body``; bad input gets its 4xx. One server with a 1,024-token window.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse
from openai import OpenAI

from decoding.drafters.registry import MODES
from tests.app.live import LANDMARKS, LIGHTHOUSE, ThreadServer, ask, wait_for, wait_indexed
from tests.app.slow_indexing import slow_indexing

pytestmark = pytest.mark.real_model

WINDOW = 1024
TOPICS = ["bread baking", "river fishing", "chess openings", "tax forms", "bicycle repair", "opera singing",
          "glacier melting", "coffee roasting", "railway signals", "knitting patterns"]


def notes(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return (f"Notes on {topic}, part {i}.\n\n" + " ".join(
        f"Paragraph {p} explains a practical detail of {topic} that beginners ask about, with an example from "
        f"the workshop held in year {1990 + p + i}." for p in range(12)))


KEY, OTHER_KEY = "key-of-a-team", "key-of-another-team"


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"max_context": WINDOW, "long_document_budget": 0, "default_max_tokens": 12, "max_collection_ids": 2,
            "api_keys": f"{KEY},{OTHER_KEY}"}


@pytest.fixture(scope="module")
def client(server: ThreadServer) -> Any:
    with server.client(KEY) as c:
        yield c


def upload(client: httpx.Client, text: str, title: str, collection: str, **attributes: Any) -> str:
    response = client.post("/v1/documents", json={"text": text, "title": title, "collection_id": collection,
                                                  "attributes": attributes})
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def create(client: httpx.Client, name: str) -> str:
    response = client.post("/v1/collections", json={"name": name})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


@pytest.fixture(scope="module")
def small(client: httpx.Client) -> dict[str, str]:
    """Two short documents: together they fit the window."""
    col = create(client, "small")
    ids = {"col": col, "landmarks": upload(client, LANDMARKS, "Landmarks", col, kind="guide", year=2024),
           "lighthouse": upload(client, LIGHTHOUSE, "Lighthouse", col, kind="history", year=1999)}
    for doc in ("landmarks", "lighthouse"):
        assert wait_indexed(client, ids[doc])["status"] == "ready"
    return ids


@pytest.fixture(scope="module")
def large(client: httpx.Client) -> dict[str, Any]:
    """The two documents and eight longer notes: far more than the window."""
    col = create(client, "large")
    ids: dict[str, Any] = {
        "col": col, "landmarks": upload(client, LANDMARKS, "Landmarks", col, kind="guide", year=2024),
        "lighthouse": upload(client, LIGHTHOUSE, "Lighthouse", col, kind="history", year=1999)}
    ids["notes"] = [upload(client, notes(i), f"Notes {i}", col, kind="notes", year=2000 + i) for i in range(8)]
    for doc in [ids["landmarks"], ids["lighthouse"], *ids["notes"]]:
        assert wait_indexed(client, doc)["status"] == "ready"
    return ids


def test_a_collection_that_fits_is_read_whole_and_every_mode_answers_alike(client: httpx.Client,
                                                                           small: dict[str, str]) -> None:
    answers = {}
    for mode in MODES:
        response = ask(client, question="When was the Eiffel Tower completed?", collection_ids=[small["col"]],
                       mode=mode, max_tokens=16)
        assert response.status_code == 200, response.text
        body = response.json()
        answers[mode] = body["answer"]
        assert body["stats"]["context"] == "documents" and body["stats"]["documents"] == 2
        assert body["stats"]["documents_pending"] == 0
    assert len(set(answers.values())) == 1, answers
    best = body["sources"][0]
    assert best["document_id"] == small["landmarks"] and best["title"] == "Landmarks"
    assert best["attributes"] == {"kind": "guide", "year": 2024}


def test_a_collection_past_the_window_reads_its_best_chunks_and_every_mode_answers_alike(
        client: httpx.Client, large: dict[str, Any]) -> None:
    answers = {}
    for mode in MODES:
        response = ask(client, question="Who built the lighthouse of Varnholm?", collection_ids=[large["col"]],
                       mode=mode, max_tokens=16)
        assert response.status_code == 200, response.text
        body = response.json()
        answers[mode] = body["answer"]
        assert body["stats"]["context"] == "chunks" and body["stats"]["documents"] == 10
    assert len(set(answers.values())) == 1, answers
    assert body["sources"][0]["document_id"] == large["lighthouse"]
    assert body["sources"][0]["title"] == "Lighthouse"


def test_filters_choose_the_documents(client: httpx.Client, large: dict[str, Any]) -> None:
    only_notes = {"type": "eq", "key": "kind", "value": "notes"}
    body = ask(client, question="Who built the lighthouse of Varnholm?", collection_ids=[large["col"]],
               filter=only_notes).json()
    assert body["sources"] == [] or {s["document_id"] for s in body["sources"]} <= set(large["notes"])
    assert body["stats"]["documents"] == 8
    recent = {"type": "and", "filters": [{"type": "gte", "key": "year", "value": 2005},
                                         {"type": "in", "key": "kind", "value": ["notes", "guide"]}]}
    body = ask(client, question="Which workshop year is mentioned for coffee roasting?",
               collection_ids=[large["col"]], filter=recent).json()
    assert body["stats"]["documents"] == 4  # notes 5, 6, 7 and the landmarks guide (2024)
    allowed = {large["landmarks"], *large["notes"][5:]}
    assert body["sources"] and {s["document_id"] for s in body["sources"]} <= allowed


def test_a_stream_over_a_collection_and_a_follow_up_in_its_session(client: httpx.Client,
                                                                   small: dict[str, str]) -> None:
    body = {"question": "When was the lighthouse built?", "collection_ids": [small["col"]], "stream": True,
            "session_id": "col-s1", "max_tokens": 12}
    with connect_sse(client, "POST", "/v1/ask", json=body) as source:
        events = list(source.iter_sse())
    kinds = [e.event for e in events]
    assert kinds[0] == "sources" and kinds[-1] == "done" and "stats" in kinds
    sources = json.loads(events[0].data)
    assert sources[0]["title"] == "Lighthouse" and sources[0]["attributes"]["kind"] == "history"
    follow = ask(client, question="And when was it automated?", session_id="col-s1").json()
    assert follow["stats"]["documents"] == 2
    assert follow["sources"][0]["document_id"] == small["lighthouse"]


def test_the_openai_client_asks_a_collection(server: ThreadServer, small: dict[str, str]) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key=KEY)
    r = client.chat.completions.create(model="ragspec", max_tokens=12,
                                       messages=[{"role": "user", "content": "When was the Eiffel Tower completed?"}],
                                       extra_body={"collection_ids": [small["col"]],
                                                   "filter": {"type": "eq", "key": "kind", "value": "guide"}})
    extra = r.model_extra or {}
    assert r.choices[0].message.content
    assert {s["document_id"] for s in extra["sources"]} == {small["landmarks"]}
    assert extra["stats"]["documents"] == 1


def test_removal_and_deletion_are_immediate(client: httpx.Client) -> None:
    col = create(client, "changing")
    a = upload(client, LIGHTHOUSE, "Lighthouse", col)
    b = upload(client, notes(3), "Notes 3", col)
    for doc in (a, b):
        assert wait_indexed(client, doc)["status"] == "ready"
    question = {"question": "Who built the lighthouse of Varnholm?", "collection_ids": [col]}
    assert ask(client, **question).json()["sources"][0]["document_id"] == a
    assert client.delete(f"/v1/collections/{col}/documents/{a}").status_code == 204
    body = ask(client, **question).json()
    assert a not in {s["document_id"] for s in body["sources"]} and body["stats"]["documents"] == 1
    assert client.get(f"/v1/documents/{a}").json()["status"] == "ready"  # still in the store
    assert client.post(f"/v1/collections/{col}/documents", json={"document_ids": [a]}).status_code in (200, 201)
    assert ask(client, **question).json()["sources"][0]["document_id"] == a
    assert client.delete(f"/v1/documents/{b}").status_code == 204
    body = ask(client, **question).json()
    assert b not in {s["document_id"] for s in body["sources"]} and body["stats"]["documents"] == 1


def test_a_collection_still_indexing(server: ThreadServer, client: httpx.Client) -> None:
    col = create(client, "empty")
    response = ask(client, question="Anything?", collection_ids=[col])
    assert response.status_code == 409 and response.json()["error"]["code"] == "collection_not_ready"
    assert "none is queued or indexing" in response.json()["error"]["message"]
    with slow_indexing(server, pause_s=6.0):  # the first embedding batch, then a pause: held while we ask
        doc = upload(client, notes(1), "Notes 1", col)
        wait_for(lambda: client.get(f"/v1/documents/{doc}").json()["status"] == "indexing", "indexing to start")
        response = ask(client, question="Anything?", collection_ids=[col], stream=True)  # refused before any token
        assert response.status_code == 409
        assert "1 still queued or indexing" in response.json()["error"]["message"]
        ready = upload(client, LIGHTHOUSE, "Lighthouse", col)  # waits behind the slow one: queued
        body = {"question": "Who built the lighthouse?", "collection_ids": [col], "document_ids": []}
        assert ask(client, **body).status_code == 409
    assert wait_indexed(client, doc)["status"] == "ready" and wait_indexed(client, ready)["status"] == "ready"
    assert ask(client, **body).json()["stats"]["documents"] == 2


def test_a_question_answers_from_the_ready_documents_and_counts_the_pending(server: ThreadServer,
                                                                            client: httpx.Client) -> None:
    col = create(client, "half-ready")
    ready = upload(client, LIGHTHOUSE, "Lighthouse", col)
    assert wait_indexed(client, ready)["status"] == "ready"
    with slow_indexing(server, pause_s=6.0):
        pending = upload(client, notes(2), "Notes 2", col)
        wait_for(lambda: client.get(f"/v1/documents/{pending}").json()["status"] == "indexing", "indexing to start")
        body = ask(client, question="Who built the lighthouse of Varnholm?", collection_ids=[col]).json()
        assert body["stats"]["documents"] == 1 and body["stats"]["documents_pending"] == 1
        assert {s["document_id"] for s in body["sources"]} == {ready}
    wait_indexed(client, pending)


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"collection_ids": ["colnope"]}, 404, "collection_not_found"),
    ({"collection_ids": ["SMALL"], "filter": {"type": "like", "key": "k", "value": 1}}, 422, "invalid_filter"),
    ({"collection_ids": ["SMALL"], "filter": {"type": "eq", "key": "k", "value": [1]}}, 422, "invalid_filter"),
    ({"collection_ids": ["SMALL"], "filter": {"type": "in", "key": "k", "value": "a"}}, 422, "invalid_filter"),
    ({"collection_ids": ["SMALL"], "filter": {"type": "and", "filters": {}}}, 422, "invalid_filter"),
    ({"collection_ids": ["SMALL"], "filter": {"type": "or", "filters": [{"type": "eq"}]}}, 422, "invalid_filter"),
    ({"document_ids": ["DOC"], "filter": {"type": "eq", "key": "k", "value": 1}}, 422, "invalid_request"),
    ({"collection_ids": ["SMALL", "SMALL", "SMALL"]}, 422, "invalid_request"),
])
def test_bad_collection_questions(client: httpx.Client, small: dict[str, str], body: dict[str, Any], status: int,
                                  code: str) -> None:
    raw = json.loads(json.dumps(body).replace("SMALL", small["col"]).replace("DOC", small["landmarks"]))
    response = ask(client, question="When?", **raw)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


def test_a_filter_key_no_document_has_matches_nothing(client: httpx.Client, small: dict[str, str]) -> None:
    response = ask(client, question="When?", collection_ids=[small["col"]],
                   filter={"type": "eq", "key": "nobody-has-this", "value": 1})
    assert response.status_code == 409 and "matching the filter" in response.json()["error"]["message"]


def test_another_tenants_collection_is_not_found(server: ThreadServer, small: dict[str, str]) -> None:
    with server.client(OTHER_KEY) as other:
        response = ask(other, question="When was the Eiffel Tower completed?", collection_ids=[small["col"]])
        assert response.status_code == 404 and response.json()["error"]["code"] == "collection_not_found"
        assert "Eiffel" not in response.text and small["landmarks"] not in response.text
        assert other.get(f"/v1/collections/{small['col']}").status_code == 404


def test_a_batch_of_uploads_warms_the_collection_once(server: ThreadServer, client: httpx.Client,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from app.answering.prompts import SYSTEM_PROMPT

    services = server.services
    keys: list[str | None] = []
    submit = services.scheduler.submit_background
    monkeypatch.setattr(services.scheduler, "submit_background",
                        lambda run, key=None: (keys.append(key), submit(run, key=key))[1])
    col = create(client, "batch")
    files = [("file", (f"part{i}.txt", f"Part {i} of the batch: the harbour crane {i} lifts {i * 7} tonnes.",
                       "text/plain")) for i in range(6)]
    response = client.post("/v1/documents", files=files, data={"collection_id": col})
    assert response.status_code == 202, response.text
    ids = [d["id"] for d in response.json()["documents"]]
    for doc in ids:
        assert wait_indexed(client, doc)["status"] == "ready"
    whole = services.prompts.key_for(SYSTEM_PROMPT, ids)  # the collection read whole, upload order
    wait_for(lambda: whole in keys, "the collection's warm-up")
    services.background.submit(lambda: None).result()  # every change handled
    assert keys.count(whole) == 1, keys
    assert not {services.prompts.key_for(SYSTEM_PROMPT, [doc]) for doc in ids} & set(keys)  # none alone
    body = ask(client, question="How much does crane 3 lift?", collection_ids=[col]).json()
    assert body["stats"]["context"] == "documents" and body["stats"]["documents"] == 6
