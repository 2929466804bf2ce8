"""Sessions and the cross-session draft cache in a real redis-server; Redis killed mid-stream: the answer
completes, readiness says degraded, conversations go on in process, and all recovers when Redis is back."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest
import redis
from httpx_sse import connect_sse

from app.serving.redis_link import RedisLink
from tests.app.live import wait_for
from tests.conftest import RedisServer

pytestmark = [pytest.mark.real_model, pytest.mark.redis]

LONG_QUESTION = "Write the numbers from 1 to 200, one per line."


@pytest.fixture(scope="module")
def server_settings(module_redis_server: RedisServer) -> dict[str, Any]:
    return {"redis_url": module_redis_server.url}


def ask(client: httpx.Client, doc: str, question: str, session: str | None = None) -> dict[str, object]:
    body: dict[str, object] = {"question": question, "document_ids": [doc], "max_tokens": 8}
    if session:
        body["session_id"] = session
    response = client.post("/v1/ask", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def session_turns(redis_server: RedisServer, session: str) -> int:
    with redis.Redis.from_url(redis_server.url) as r:
        return int(r.llen(f"ragspec:session:default:{session}"))


def test_sessions_and_draft_cache_live_in_redis(
    client: httpx.Client, doc: str, module_redis_server: RedisServer
) -> None:
    assert client.get("/readyz").json()["checks"]["redis"] == "ok"
    ask(client, doc, "Where is the Eiffel Tower?", session="s-1")
    ask(client, doc, "How tall is it?", session="s-1")
    assert session_turns(module_redis_server, "s-1") == 2
    with redis.Redis.from_url(module_redis_server.url) as r:
        assert r.ttl("ragspec:session:default:s-1") > 0
        # the answers' n-grams reach the tenant's cross-session tier (written in the background)
        wait_for(lambda: any(True for _ in r.scan_iter("ragspec:dc:*")), "draft cache keys in Redis")


def test_redis_killed_mid_stream(client: httpx.Client, doc: str, module_redis_server: RedisServer) -> None:
    body = {"question": LONG_QUESTION, "document_ids": [doc], "max_tokens": 48, "stream": True, "session_id": "outage",
            "frequency_penalty": 0}  # the raw model counts on (a penalty lets it stop early)
    with connect_sse(client, "POST", "/v1/ask", json=body) as source:
        events = source.iter_sse()
        assert next(events).event == "sources"
        assert next(e for e in events if e.event != "progress").event == "token"
        module_redis_server.stop()  # Redis dies while the answer is being generated
        rest = list(events)
    names = [e.event for e in rest]
    assert "error" not in names and names[-2:] == ["stats", "done"]
    assert json.loads(rest[-1].data)["finish_reason"] in ("stop", "length")

    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["status"] == "degraded" and ready.json()["checks"]["redis"].startswith("down")

    # the conversation goes on from the in-process copy while Redis is away
    follow = ask(client, doc, "Where is the Colosseum?", session="outage")
    fresh = ask(client, doc, "Where is the Colosseum?")
    assert follow["usage"]["prompt_tokens"] > fresh["usage"]["prompt_tokens"]  # type: ignore[index]

    module_redis_server.start()
    wait_for(lambda: client.get("/readyz").json()["status"] == "ready", "readiness after Redis is back")
    ask(client, doc, "Where is the Great Wall?", session="after")
    assert session_turns(module_redis_server, "after") == 1  # written to Redis again


def test_the_redis_password_never_reaches_the_log(caplog: pytest.LogCaptureFixture) -> None:
    link = RedisLink("redis://ragspec:s3cret-pw@127.0.0.1:1/0")

    async def answered(client: object) -> int:
        return 1

    with caplog.at_level(logging.INFO):
        assert asyncio.run(link.run(answered)) == 1
    assert "reachable" in caplog.text and "s3cret-pw" not in caplog.text and "//***@127.0.0.1" in caplog.text
