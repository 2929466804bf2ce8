"""Conversation history over HTTP (``/v1/sessions``): listed, read and deleted per API key, with the
in-process store and with a real redis-server. Another key's session answers 404; a deleted one is gone
(asking again under its id starts a new conversation)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import redis

from app.serving.auth import tenant_of_key
from tests.app.live import LANDMARKS, ThreadServer, upload_text, wait_indexed

pytestmark = pytest.mark.real_model

KEY_A, KEY_B = "key-sessions-a", "key-sessions-b"


@pytest.fixture(scope="module", params=["in_process", "redis"])
def server_settings(request: pytest.FixtureRequest) -> dict[str, Any]:
    settings: dict[str, Any] = {"api_keys": f"{KEY_A},{KEY_B}", "default_max_tokens": 6}
    if request.param == "redis":
        settings["redis_url"] = request.getfixturevalue("module_redis_server").url
    return settings


@pytest.fixture(scope="module")
def clients(server: ThreadServer) -> Any:
    with server.client(KEY_A) as a, server.client(KEY_B) as b:
        yield a, b


@pytest.fixture(scope="module")
def doc_a(clients: tuple[httpx.Client, httpx.Client]) -> str:
    doc_id = upload_text(clients[0], LANDMARKS, title="Landmarks")
    assert wait_indexed(clients[0], doc_id)["status"] == "ready"
    return doc_id


def ask(client: httpx.Client, doc: str, question: str, session: str) -> dict[str, Any]:
    response = client.post("/v1/ask", json={"question": question, "document_ids": [doc], "session_id": session})
    assert response.status_code == 200, response.text
    return dict(response.json())


def listed(client: httpx.Client) -> list[dict[str, Any]]:
    response = client.get("/v1/sessions")
    assert response.status_code == 200, response.text
    return list(response.json()["sessions"])


def test_sessions_are_listed_read_and_deleted_per_key(
    clients: tuple[httpx.Client, httpx.Client], doc_a: str, server_settings: dict[str, Any]
) -> None:
    a, b = clients
    first = ask(a, doc_a, "Where is the Eiffel Tower?", "trip")
    second = ask(a, doc_a, "How tall is it?", "trip")
    ask(a, doc_a, "When did the Colosseum's construction begin?", "rome")

    sessions = listed(a)
    assert [s["id"] for s in sessions] == ["rome", "trip"]  # last written first
    trip = sessions[1]
    assert trip["title"] == "Where is the Eiffel Tower?" and trip["turns"] == 2
    assert trip["created"] <= trip["updated"] <= sessions[0]["updated"]

    detail = a.get("/v1/sessions/trip").json()
    assert detail["asked"] == 2 and detail["title"] == trip["title"]
    turns = detail["turns"]
    assert [t["question"] for t in turns] == ["Where is the Eiffel Tower?", "How tall is it?"]
    assert [t["answer"] for t in turns] == [first["answer"], second["answer"]]
    assert all(t["documents"] == [doc_a] for t in turns)
    assert turns[0]["sources"] == first["sources"] and turns[0]["sources"]
    cited = turns[1]["citations"]  # as the answer gave them: [n] markers and source highlights
    assert cited["cited_answer"] == second["cited_answer"] and cited["citations"] == second["citations"]

    # another key sees nothing of it, and cannot delete it
    assert listed(b) == []
    for method in ("GET", "DELETE"):
        refused = b.request(method, "/v1/sessions/trip")
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "session_not_found"
    assert a.get("/v1/sessions/trip").status_code == 200

    if "redis_url" in server_settings:  # the conversation is in Redis, under the tenant's index
        with redis.Redis.from_url(server_settings["redis_url"], decode_responses=True) as r:
            index = f"ragspec:sessions:{tenant_of_key(KEY_A)}"
            assert set(r.zrange(index, 0, -1)) == {"trip", "rome"}
            assert r.llen(f"ragspec:session:{tenant_of_key(KEY_A)}:trip") == 2

    deleted = a.delete("/v1/sessions/trip")
    assert deleted.status_code == 204 and not deleted.content
    assert a.get("/v1/sessions/trip").status_code == 404
    assert a.delete("/v1/sessions/trip").status_code == 404
    assert [s["id"] for s in listed(a)] == ["rome"]
    if "redis_url" in server_settings:
        with redis.Redis.from_url(server_settings["redis_url"], decode_responses=True) as r:
            assert r.zrange(f"ragspec:sessions:{tenant_of_key(KEY_A)}", 0, -1) == ["rome"]
            assert not r.exists(f"ragspec:session:{tenant_of_key(KEY_A)}:trip")

    # the id asked again is a new conversation: the deleted turns are not its history
    ask(a, doc_a, "How long is the Great Wall?", "trip")
    again = a.get("/v1/sessions/trip").json()
    assert again["asked"] == 1 and [t["question"] for t in again["turns"]] == ["How long is the Great Wall?"]
    assert again["title"] == "How long is the Great Wall?"


def test_bad_session_requests_are_4xx(clients: tuple[httpx.Client, httpx.Client]) -> None:
    a, _ = clients
    for path in ("/v1/sessions/bad%20id", "/v1/sessions/" + "x" * 200):
        response = a.get(path)
        assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_request", path
    assert a.get("/v1/sessions", params={"limit": 0}).status_code == 422
    assert a.get("/v1/sessions/never-asked").status_code == 404
    with httpx.Client(base_url=str(a.base_url)) as anonymous:
        assert anonymous.get("/v1/sessions").status_code == 401


def test_capabilities_match_what_ask_answers(
    server: ThreadServer, clients: tuple[httpx.Client, httpx.Client], doc_a: str
) -> None:
    """Every mode is offered as available here; one whose drafter the process lacks is reported unavailable,
    with the reason /v1/ask then gives in its 400."""
    a, _ = clients
    caps = a.get("/v1/capabilities").json()
    target = server.app.state.services.target
    assert caps["model"] == {"name": target.name, "runtime": target.runtime, "context_window": target.max_context,
                             "weight_mb": round(target.weight_bytes / 1e6, 1)}
    assert caps["model"]["runtime"].startswith("cpu-quantized:gguf:Q4_1+Q8_0/")  # the bundled GGUF's formats
    assert caps["model"]["weight_mb"] > 50
    assert caps["max_new_tokens"] == server.settings.max_new_tokens
    assert caps["default_max_tokens"] == 6
    assert {m["name"]: m["available"] for m in caps["modes"]} == dict.fromkeys(
        ["auto", "autoregressive", "racer", "rapid", "rapid_kv", "combined", "suffix", "prompt_lookup"], True
    )
    drafters = server.app.state.services.drafters
    config = drafters.config
    drafters.config = type(config)(**{**config.__dict__, "draft_model": None})  # as a process without RAPID's LM
    try:
        modes = {m["name"]: m for m in a.get("/v1/capabilities").json()["modes"]}
        assert not modes["rapid"]["available"] and modes["auto"]["available"]
        refused = a.post("/v1/ask", json={"question": "Where?", "document_ids": [doc_a], "mode": "rapid"})
        assert refused.status_code == 400
        assert refused.json()["error"] == {"code": "not_available_yet", "message": modes["rapid"]["reason"]}
    finally:
        drafters.config = config
