"""Bearer keys: every route but /healthz, /readyz (and the web page's files) needs one; each key is a
tenant that cannot see, ask over or delete another tenant's documents, and never shares its draft cache."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.app.live import LANDMARKS, ThreadServer, upload_text, wait_indexed

pytestmark = pytest.mark.real_model

KEY_A, KEY_B = "key-alpha-123", "key-bravo-456"

OPEN = [
    "/healthz",
    "/readyz",  # for orchestrators' probes
    "/",  # the page loads; its API calls carry the key
    "/static/app.js",
]
PROTECTED = [
    ("GET", "/v1/documents"),
    ("POST", "/v1/documents"),
    ("GET", "/v1/documents/abc"),
    ("DELETE", "/v1/documents/abc"),
    ("POST", "/v1/ask"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
]


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"api_keys": f"{KEY_A},{KEY_B}"}


@pytest.mark.parametrize("path", OPEN)
@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_open_routes_answer_whatever_the_key(server: ThreadServer, path: str, key: str | None) -> None:
    with server.client(key) as client:
        assert client.get(path).status_code == 200


@pytest.mark.parametrize(("method", "path"), PROTECTED)
@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_protected_routes_need_a_valid_key(server: ThreadServer, method: str, path: str, key: str | None) -> None:
    with server.client(key) as client:
        response = client.request(method, path, json={})
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == "unauthorized"


def test_non_bearer_scheme_is_refused(server: ThreadServer) -> None:
    response = httpx.get(server.url + "/v1/documents", headers={"Authorization": f"Basic {KEY_A}"})
    assert response.status_code == 401


def test_tenants_are_isolated(server: ThreadServer) -> None:
    with server.client(KEY_A) as a, server.client(KEY_B) as b:
        doc = upload_text(a, LANDMARKS, title="alpha's")
        assert wait_indexed(a, doc)["status"] == "ready"
        assert [d["id"] for d in a.get("/v1/documents").json()["documents"]] == [doc]
        assert b.get("/v1/documents").json()["documents"] == []
        assert b.get(f"/v1/documents/{doc}").status_code == 404
        question = {"question": "Where is the Colosseum?", "document_ids": [doc], "max_tokens": 4}
        assert b.post("/v1/ask", json=question).status_code == 404
        chat = {"messages": [{"role": "user", "content": "Where?"}], "document_ids": [doc], "max_tokens": 4}
        assert b.post("/v1/chat/completions", json=chat).status_code == 404
        assert b.delete(f"/v1/documents/{doc}").status_code == 404
        # a sees and uses its document as before
        assert a.get(f"/v1/documents/{doc}").status_code == 200
        assert a.post("/v1/ask", json=question).status_code == 200
        # readiness and metrics with a valid key
        assert a.get("/readyz").status_code == 200 and b.get("/metrics").status_code == 200


def test_draft_cache_is_per_tenant(server: ThreadServer) -> None:
    """Tenant A's answers feed A's cross-session drafts; B asking the same over its own copy gets none."""
    question = "How tall is the Eiffel Tower and when was it completed?"

    def ask(client: httpx.Client, doc: str) -> dict[str, int]:
        body = {"question": question, "document_ids": [doc], "max_tokens": 24, "mode": "racer"}
        response = client.post("/v1/ask", json=body)
        assert response.status_code == 200, response.text
        return dict(response.json()["stats"]["drafted_by_source"])

    with server.client(KEY_A) as a, server.client(KEY_B) as b:
        doc_a = upload_text(a, LANDMARKS + "\n\nCopy A.")
        doc_b = upload_text(b, LANDMARKS + "\n\nCopy B.")
        assert wait_indexed(a, doc_a)["status"] == wait_indexed(b, doc_b)["status"] == "ready"
        ask(a, doc_a)  # A's first answer teaches A's tier
        assert ask(a, doc_a).get("racer.cross_session", 0) > 0  # A's repeat is drafted from it
        assert ask(b, doc_b).get("racer.cross_session", 0) == 0  # B has learnt nothing yet


def test_openai_client_with_key(server: ThreadServer) -> None:
    with server.client(KEY_A) as a:
        doc = upload_text(a, LANDMARKS)
        assert wait_indexed(a, doc)["status"] == "ready"
    good = OpenAI(base_url=server.url + "/v1", api_key=KEY_A, max_retries=0)
    completion = good.chat.completions.create(
        model="ragspec",
        messages=[{"role": "user", "content": "Where is the Colosseum?"}],
        max_tokens=4,
        extra_body={"document_ids": [doc]},
    )
    assert completion.choices[0].message.content
    other = OpenAI(base_url=server.url + "/v1", api_key=KEY_B, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.chat.completions.create(
            model="ragspec",
            messages=[{"role": "user", "content": "Where?"}],
            max_tokens=4,
            extra_body={"document_ids": [doc]},
        )
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_the_gate_and_the_routes_read_one_key_ring_and_one_config(server: ThreadServer) -> None:
    """The one-process app builds its key ring and config once: the request gate (middleware) and the loaded
    services (the routes' ``services.keys``) hold the same objects."""
    from app.api.middleware import GatePolicy, RequestGate

    (gate,) = [m for m in server.app.user_middleware if m.cls is RequestGate]
    policy, services = gate.kwargs["policy"], server.app.state.services
    assert isinstance(policy, GatePolicy)
    assert policy.keys is services.keys and services.keys.enabled
    assert policy.max_body_bytes == services.config.limits.max_json_bytes
    assert services.config.access.api_keys == (KEY_A, KEY_B)
