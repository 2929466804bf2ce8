"""OpenAI's Responses API driven by the official ``openai`` client against the real server: a question over a vector
store with the ``file_search`` tool (its call and results, the answer's ``file_citation`` annotations pointing at the
right file), the same answer streamed (OpenAI's events in order, numbered, deltas joined equal to the final text),
equal to ``/v1/ask``'s greedy answer over the same collection, follow-ups by ``previous_response_id``, stored
responses read and deleted, a plain question without tools, a file removed from the store gone from the next answer;
refusals in OpenAI's error shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.app.live import LANDMARKS, LIGHTHOUSE, ThreadServer, ask, engine_held, wait_for
from tests.app.live import openai_refused as refused

pytestmark = pytest.mark.real_model

KEY, OTHER_KEY = "key-of-the-responses-team", "key-of-a-stranger"
QUESTION = "Who built the lighthouse of Varnholm, and when?"
TOKENS = 24


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"api_keys": f"{KEY},{OTHER_KEY}", "default_max_tokens": TOKENS, "max_batch": 1}


@pytest.fixture(scope="module")
def oa(server: ThreadServer) -> Iterator[OpenAI]:
    with OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def library(oa: OpenAI) -> dict[str, str]:
    files = {name: oa.files.create(file=(f"{name}.txt", text.encode(), "text/plain"), purpose="assistants").id
             for name, text in (("lighthouse", LIGHTHOUSE), ("landmarks", LANDMARKS))}
    store = oa.vector_stores.create(name="answers", file_ids=list(files.values()))
    wait_for(lambda: oa.vector_stores.retrieve(store.id).file_counts.completed == 2, "the store indexed")
    return {"store": store.id, **files}


def tool(store: str, **options: Any) -> list[dict[str, Any]]:
    return [{"type": "file_search", "vector_store_ids": [store], **options}]


def test_file_search_answer_with_citations_equal_to_ask(oa: OpenAI, server: ThreadServer,
                                                         library: dict[str, str]) -> None:
    r = oa.responses.create(model="ragspec", input=QUESTION, tools=tool(library["store"]),  # type: ignore[arg-type]
                            include=["file_search_call.results"], max_output_tokens=TOKENS)
    assert (r.object, r.status) == ("response", "completed") and r.id.startswith("resp_")
    call, message = r.output
    assert call.type == "file_search_call" and call.status == "completed" and call.queries == [QUESTION]
    assert call.results and call.results[0].file_id == library["lighthouse"]
    assert call.results[0].filename == "lighthouse.txt" and "Ada Kessling" in (call.results[0].text or "")
    assert message.type == "message" and message.role == "assistant"
    text = r.output_text
    assert text and message.content[0].type == "output_text"
    annotations = message.content[0].annotations
    assert annotations, "the answer cites the file it read"
    assert {a.file_id for a in annotations} == {library["lighthouse"]}
    assert all(a.type == "file_citation" and a.filename == "lighthouse.txt" and 0 < a.index <= len(text)
               for a in annotations)
    assert r.usage is not None and r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    extra = r.model_extra or {}
    assert extra["stats"]["documents"] == 2 and extra["sources"][0]["document_id"] == library["lighthouse"]
    # the same pipeline: the greedy answer equals /v1/ask's over the same collection
    with server.client(KEY) as http:
        asked = ask(http, question=QUESTION, collection_ids=[library["store"]], max_tokens=TOKENS).json()
    assert asked["answer"] == text


def test_the_same_answer_streamed_in_openais_order(oa: OpenAI, library: dict[str, str]) -> None:
    plain = oa.responses.create(model="ragspec", input=QUESTION, tools=tool(library["store"]),  # type: ignore[arg-type]
                                max_output_tokens=TOKENS, store=False)
    events = list(oa.responses.create(model="ragspec", input=QUESTION, tools=tool(library["store"]),  # type: ignore[arg-type]
                                      max_output_tokens=TOKENS, stream=True))
    kinds = [e.type for e in events]
    deltas = [i for i, k in enumerate(kinds) if k == "response.output_text.delta"]
    head = ["response.created", "response.in_progress", "response.output_item.added",
            "response.file_search_call.in_progress", "response.file_search_call.searching",
            "response.file_search_call.completed", "response.output_item.done", "response.output_item.added",
            "response.content_part.added"]
    assert kinds[: len(head)] == head and deltas and deltas[0] == len(head)
    tail = [k for k in kinds[deltas[-1] + 1:] if k != "response.output_text.annotation.added"]
    assert tail == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                    "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    joined = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert joined == final.output_text == plain.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == joined  # type: ignore[union-attr]
    added = [e.annotation for e in events if e.type == "response.output_text.annotation.added"]  # type: ignore[union-attr]
    assert added and [dict(a) for a in added] == [  # type: ignore[call-overload]
        a.model_dump(exclude_none=True) for a in final.output[-1].content[0].annotations]  # type: ignore[union-attr]


def test_follow_ups_stored_responses_and_a_plain_question(oa: OpenAI, library: dict[str, str]) -> None:
    first = oa.responses.create(model="ragspec", input=QUESTION, tools=tool(library["store"]),  # type: ignore[arg-type]
                                max_output_tokens=TOKENS, metadata={"ticket": "42"})
    again = oa.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text and again.metadata == {"ticket": "42"}
    follow = oa.responses.create(model="ragspec", input="And when was its lamp converted to paraffin?",
                                 previous_response_id=first.id, tools=tool(library["store"]),  # type: ignore[arg-type]
                                 max_output_tokens=TOKENS)
    assert follow.previous_response_id == first.id and follow.output_text
    assert (follow.usage.input_tokens if follow.usage else 0) > (first.usage.input_tokens if first.usage else 0)
    plain = oa.responses.create(model="ragspec", input=[{"role": "user", "content": "Say hello."}],
                                instructions="Answer briefly.", max_output_tokens=8)
    assert [item.type for item in plain.output] == ["message"] and plain.output_text
    with OpenAI(base_url=oa.base_url, api_key=OTHER_KEY, max_retries=0) as other:
        refused(lambda: other.responses.retrieve(first.id), 404)  # another tenant's response: not found
        refused(lambda: other.responses.create(model="ragspec", input="More?", previous_response_id=first.id), 404)
    deleted = oa.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    refused(lambda: oa.responses.retrieve(first.id), 404)
    refused(lambda: oa.responses.create(model="ragspec", input="More?", previous_response_id=first.id), 404)
    unstored = oa.responses.create(model="ragspec", input="Say hi.", max_output_tokens=4, store=False)
    refused(lambda: oa.responses.retrieve(unstored.id), 404)


def test_a_file_taken_out_of_the_store_leaves_the_next_answer(oa: OpenAI, library: dict[str, str]) -> None:
    store = oa.vector_stores.create(name="shrinking", file_ids=[library["lighthouse"], library["landmarks"]])
    wait_for(lambda: oa.vector_stores.retrieve(store.id).file_counts.completed == 2, "indexed")

    def files_used() -> set[str]:
        r = oa.responses.create(model="ragspec", input=QUESTION, tools=tool(store.id),  # type: ignore[arg-type]
                                include=["file_search_call.results"], max_output_tokens=4, store=False)
        return {res.file_id for res in (r.output[0].results or [])}  # type: ignore[union-attr]

    assert library["lighthouse"] in files_used()
    oa.vector_stores.files.delete(library["lighthouse"], vector_store_id=store.id)
    assert library["lighthouse"] not in files_used()
    limited = oa.responses.create(model="ragspec", input=QUESTION, max_output_tokens=4, store=False,
                                  tools=tool(library["store"], max_num_results=1),  # type: ignore[arg-type]
                                  include=["file_search_call.results"])
    assert len(limited.output[0].results or []) == 1  # type: ignore[union-attr]
    filtered = oa.responses.create(model="ragspec", input=QUESTION, max_output_tokens=4, store=False,
                                   tools=tool(library["store"], filters={"type": "eq", "key": "kind",  # type: ignore[arg-type]
                                                                         "value": "none"}),
                                   include=["file_search_call.results"])
    assert filtered.status == "incomplete" and filtered.output[0].results == []  # type: ignore[union-attr]
    assert filtered.incomplete_details is not None and filtered.incomplete_details.reason == "max_output_tokens"
    assert (filtered.model_extra or {})["stats"]["documents"] == 0  # answered without files, as OpenAI does


def test_refusals(oa: OpenAI, server: ThreadServer, library: dict[str, str]) -> None:
    ask_ = {"model": "ragspec", "input": "Hello?", "max_output_tokens": 4}
    refused(lambda: oa.responses.create(**ask_, tools=[{"type": "web_search"}]), 400, "tools[0].type")  # type: ignore[arg-type, list-item]
    refused(lambda: oa.responses.create(**ask_, tools=[{"type": "function", "name": "f", "parameters": {},  # type: ignore[arg-type, list-item]
                                                        "strict": True}]), 400, "tools[0].type")
    refused(lambda: oa.responses.create(**ask_, tools=[{"type": "code_interpreter", "container": {"type": "auto"}}]),  # type: ignore[arg-type, list-item]
            400, "tools[0].type")
    refused(lambda: oa.responses.create(**ask_, tools=tool("col" + "0" * 32)), 404)  # type: ignore[arg-type]
    refused(lambda: oa.responses.create(**ask_, tools=tool(library["store"], max_num_results=99)), 400,  # type: ignore[arg-type]
            "tools[0].max_num_results")
    refused(lambda: oa.responses.create(**ask_, tools=tool(library["store"], filters={"type": "and",  # type: ignore[arg-type]
                                                                              "filters": []})),
            400, "tools[0].filters.filters")
    refused(lambda: oa.responses.create(model="ragspec", input="Hi", max_output_tokens=10**6), 400,
            "max_output_tokens")
    refused(lambda: oa.responses.create(**ask_, include=["reasoning.encrypted_content"]), 400, "include")  # type: ignore[arg-type, list-item]
    refused(lambda: oa.responses.create(**ask_, reasoning={"effort": "high"}), 400, "reasoning")  # type: ignore[arg-type]
    refused(lambda: oa.responses.create(**ask_, previous_response_id="resp_unknown"), 404)  # type: ignore[arg-type]
    refused(lambda: oa.responses.retrieve("resp_unknown"), 404)
    with OpenAI(base_url=server.url + "/v1", api_key=OTHER_KEY, max_retries=0) as other:
        refused(lambda: other.responses.create(**ask_, tools=tool(library["store"])), 404)  # type: ignore[arg-type]
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as c:
        bad = c.post("/v1/responses", json={"input": [{"role": "assistant", "content": "hi"}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


def test_a_stream_whose_client_leaves_while_queued_leaves_the_queue(server: ThreadServer,
                                                                   library: dict[str, str]) -> None:
    scheduler = server.services.scheduler
    body = {"model": "ragspec", "input": QUESTION, "tools": tool(library["store"]), "stream": True,
            "max_output_tokens": TOKENS}
    seen = []
    with engine_held(server.services):
        with server.client(KEY) as client, client.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                seen.append(line)
                if line.startswith(":") and '"queued"' in line:
                    break  # the client stops reading and closes the connection
        assert wait_for(lambda: scheduler.waiting == 0, "the abandoned response to leave the queue")
        assert scheduler.running  # the holder still runs: the response left without ever running
    assert any("response.file_search_call.completed" in line for line in seen)
