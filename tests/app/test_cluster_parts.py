"""The cluster's parts without a cluster: a request carried as data and played into an ASGI app (head, streamed
chunks, errors, a caller that stops reading), the route key the ingress names for each kind of request, and the
Serve request router's ranking (owner first, the ring after it, a pinned replica, the least loaded when unkeyed)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.cluster.bridge import ABORTED, play, wire_request
from app.cluster.checks import (
    ClusterConfigError,
    check_cluster_settings,
    replica_settings,
    settings_data,
    settings_from_data,
)
from app.cluster.routing import AffinityRouter, routing_key
from app.cluster.serve import DocumentRouter, _own_dir, builder_settings, ray_init_options, route_key
from app.serving.auth import KeyRing, tenant_of_key
from app.serving.sessions import Turn


def _app(seen: dict[str, Any]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"body": (await request.body()).decode(), "query": request.url.query,
                             "auth": request.headers.get("authorization"), "client": request.client.host
                             if request.client else None}, headers={"x-echo": "1"})

    @app.get("/stream")
    async def stream(request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n".encode()
                    await asyncio.sleep(0.01)
            finally:
                seen["disconnected"] = await request.is_disconnected()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/half")
    async def half() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"data: 0\n\n"
            raise RuntimeError("mid-answer")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("boom")

    return app


async def _collect(app: FastAPI, method: str, path: str, body: bytes = b"", limit: int | None = None) -> list[Any]:
    request = wire_request(method, path, "a=1", {"Authorization": "Bearer k", "Connection": "keep-alive"}, body,
                           ("10.0.0.7", 5000))
    items = []
    gen = play(app, request, "r1")
    async for item in gen:
        items.append(item)
        if limit is not None and len(items) >= limit:
            break
    await gen.aclose()
    return items


def test_a_request_played_into_the_app_comes_back_head_then_body() -> None:
    items = asyncio.run(_collect(_app({}), "post", "/echo", b'{"q": 1}'))
    head, *body = items
    assert head["status"] == 200 and head["replica"] == "r1" and ("x-echo", "1") in head["headers"]
    answer = json.loads(b"".join(body))
    assert answer == {"body": '{"q": 1}', "query": "a=1", "auth": "Bearer k", "client": "10.0.0.7"}
    assert ("connection", "keep-alive") not in wire_request("GET", "/", "", {"Connection": "keep-alive"}, b"",
                                                            None)["headers"]


def test_a_stream_arrives_chunk_by_chunk_and_a_caller_that_stops_disconnects_the_app() -> None:
    seen: dict[str, Any] = {}
    items = asyncio.run(_collect(_app(seen), "GET", "/stream", limit=4))
    assert items[1:] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]  # one SSE frame an item
    assert seen["disconnected"] is True


def test_an_answer_cut_by_an_error_ends_aborted_not_clean() -> None:
    items = asyncio.run(_collect(_app({}), "GET", "/half"))
    assert items[0]["status"] == 200 and items[1:] == [b"data: 0\n\n", ABORTED]


def test_the_wire_request_carries_its_body_s_real_length() -> None:
    chunked = wire_request("POST", "/v1/ask", "", {"Transfer-Encoding": "chunked", "Content-Length": "3"}, b"{}",
                           None)
    assert ("content-length", "2") in chunked["headers"] and all(k != "transfer-encoding" for k, _ in
                                                                   chunked["headers"])


def test_an_app_error_is_a_500_from_the_replica() -> None:
    head = asyncio.run(_collect(_app({}), "GET", "/boom"))[0]
    assert head["status"] == 500 and head["replica"] == "r1"


@dataclass
class FakeSessions:
    turns: list[Turn]
    tenant: str

    async def history(self, tenant: str, session_id: str) -> list[Turn]:
        assert (tenant, session_id) == (self.tenant, "s1")  # the key's tenant: another's session is not read
        return self.turns


def _key(method: str, path: str, body: Any = None, token: str | None = "key-a", sessions: Any = None) -> str | None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    raw = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
    return asyncio.run(route_key(wire_request(method, path, "", headers, raw, None), KeyRing(("key-a",)), sessions))


def test_the_route_key_names_tenant_and_documents_of_each_request_kind() -> None:
    tenant = tenant_of_key("key-a")
    doc = routing_key(["d2", "d1"], tenant)
    assert _key("POST", "/v1/ask", {"question": "q", "document_ids": ["d1", "d2"]}) == doc
    assert _key("POST", "/v1/chat/completions", {"messages": [], "document_ids": ["d2", "d1", "d1"]}) == doc
    assert _key("DELETE", "/v1/documents/d9") == routing_key(["d9"], tenant)
    for method, path in (("GET", "/v1/documents"), ("POST", "/v1/documents"), ("GET", "/healthz")):
        assert _key(method, path) is None  # any replica
    assert _key("POST", "/v1/ask", b"{not json") is None  # the replica answers 400
    assert _key("POST", "/v1/ask", {"question": "q", "document_ids": ["d1"]}, token="wrong") is None  # 401 there
    assert _key("POST", "/v1/ask", {"question": "q"}) == routing_key([], tenant)


def test_a_follow_up_routes_by_its_session_s_last_documents() -> None:
    turns = [Turn(question="a", answer="b", documents=("d1",)), Turn(question="c", answer="d", documents=("d3",)),
             Turn(question="e", answer="f", documents=())]
    tenant = tenant_of_key("key-a")
    sessions = FakeSessions(turns, tenant)
    assert _key("POST", "/v1/ask", {"question": "q", "session_id": "s1"}, sessions=sessions) == routing_key(
        ["d3"], tenant)


def test_a_collection_question_and_its_follow_up_route_by_the_collection() -> None:
    tenant = tenant_of_key("key-a")
    key = routing_key(["collection:c1"], tenant)
    assert _key("POST", "/v1/ask", {"question": "q", "collection_ids": ["c1"]}) == key
    assert _key("POST", "/v1/chat/completions", {"messages": [], "collection_ids": ["c1"]}) == key
    assert _key("POST", "/v1/ask", {"question": "q", "collection_ids": ["c1"], "document_ids": ["d1"]}) == routing_key(
        ["d1", "collection:c1"], tenant)
    sessions = FakeSessions([Turn(question="a", answer="b", collections=("c1",))], tenant)
    assert _key("POST", "/v1/ask", {"question": "q", "session_id": "s1"}, sessions=sessions) == key


@dataclass(frozen=True)
class FakeId:
    unique_id: str


@dataclass(frozen=True)
class FakeReplica:
    replica_id: FakeId


class FakeLoads:
    def __init__(self, loads: dict[str, int]) -> None:
        self.loads = loads

    def get(self, replica_id: FakeId) -> int | None:
        return self.loads.get(replica_id.unique_id)


@dataclass
class FakeRequest:
    kwargs: dict[str, Any]


def _router(loads: dict[str, int], slots: int = 0) -> DocumentRouter:
    router = DocumentRouter.__new__(DocumentRouter)  # Serve builds it with its own state; the policy is ours
    router.initialize_state(load_factor=1.5, slots=slots)
    router._replica_queue_len_cache = FakeLoads(loads)
    return router


def _choose(router: DocumentRouter, replicas: list[FakeReplica], **kwargs: Any) -> list[list[str]]:
    ranks = asyncio.run(router.choose_replicas(replicas, FakeRequest(kwargs)))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_the_router_ranks_the_owner_first_then_the_ring() -> None:
    names = ["r1", "r2", "r3"]
    replicas = [FakeReplica(FakeId(n)) for n in names]
    ring = AffinityRouter(names, load_factor=1.5)
    key = routing_key(["d1"], "t")
    ranks = _choose(_router({}), replicas, route=key)
    assert ranks == [[ring.owner(key)], [n for n in ring.owners(key) if n != ring.owner(key)]]
    busy = _choose(_router({ring.owner(key): 9}), replicas, route=key)  # the owner is over its cap
    assert busy[0] == [ring.owners(key)[1]]
    batching = _choose(_router({ring.owner(key): 7}, slots=8), replicas, route=key)  # a free slot of its batch
    assert batching[0] == [ring.owner(key)]
    assert _choose(_router({ring.owner(key): 8}, slots=8), replicas, route=key)[0] == [ring.owners(key)[1]]
    assert _choose(_router({}), replicas, route=key, pin="r2") == [["r2"]]
    assert _choose(_router({}), replicas, route=key, pin="gone")[0] == [ring.owner(key)]  # routed as usual
    assert _choose(_router({"r1": 3, "r2": 0, "r3": 1}), replicas, route=None) == [["r2", "r3", "r1"]]
    without = _choose(_router({}), [r for r in replicas if r.replica_id.unique_id != ring.owner(key)], route=key)
    assert without[0] == [ring.owners(key)[1]]  # the owner gone: the next along the ring
    assert asyncio.run(_router({}).choose_replicas([], FakeRequest({}))) == []


def test_a_replica_reads_the_shared_documents_and_keeps_its_own_data_dir(tmp_path: Path) -> None:
    from app.settings import Settings

    base = Settings(data_dir=tmp_path, database_url="postgresql://x@h/db", redis_url="redis://h")  # type: ignore[call-arg]
    one, two = replica_settings(base, "0"), replica_settings(base, "1")
    assert one.documents_dir == two.documents_dir == tmp_path / "documents"
    assert one.models_dir == two.models_dir == tmp_path / "models"
    assert one.data_dir != two.data_dir and one.data_dir.parent == tmp_path / "replicas"
    assert one.shared_store and not base.shared_store
    check_cluster_settings(base)
    with pytest.raises(ClusterConfigError, match="RAGSPEC_REDIS_URL"):
        check_cluster_settings(base.model_copy(update={"redis_url": None}))


def test_replicas_get_the_command_s_settings_as_data_never_their_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a replica is given: JSON data of the command's settings (its directories absolute), read back as those
    settings however the replica's own RAGSPEC_* environment differs."""
    from app.settings import Settings

    monkeypatch.chdir(tmp_path)
    command = Settings(data_dir="data", api_keys="k1,k2", rope_scaling={"rope_type": "linear", "factor": 2.0},  # type: ignore[call-arg, arg-type]
                       kv_pool_bytes=1 << 30, max_batch=3, calibrate=False, log_level="DEBUG")
    data = settings_data(command)
    assert json.loads(json.dumps(data)) == data  # what Ray carries: plain data
    for name, value in (("RAGSPEC_MAX_BATCH", "7"), ("RAGSPEC_LOG_LEVEL", "ERROR"), ("RAGSPEC_API_KEYS", "other"),
                        ("RAGSPEC_DATA_DIR", "/elsewhere")):
        monkeypatch.setenv(name, value)
    replica = settings_from_data(data)
    absolute = {"data_dir": tmp_path / "data", "documents_dir": tmp_path / "data" / "documents",
                "models_dir": tmp_path / "data" / "models"}
    assert replica == command.model_copy(update=absolute)
    assert (replica.max_batch, replica.log_level, replica.api_keys) == (3, "DEBUG", ["k1", "k2"])
    bad = {**data, "max_batch": 0}  # validated again: data that is not settings is refused
    with pytest.raises(ValueError, match="max_batch"):
        settings_from_data(bad)


def test_a_serve_config_s_args_are_settings_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``app_builder``'s settings: the environment's, the config's args (by name, in any case, as text) over them,
    validated as a variable is, an empty one unset; the environment itself is not written."""
    from pydantic import ValidationError

    monkeypatch.setenv("RAGSPEC_CLUSTER_REPLICAS", "4")
    monkeypatch.setenv("RAGSPEC_DATA_DIR", str(tmp_path))
    settings = builder_settings({"Cluster_Replicas": 2, "api_keys": "a,b", "max_batch": "", "calibrate": False})
    assert (settings.cluster_replicas, settings.api_keys, settings.max_batch) == (2, ["a", "b"], 8)
    assert not settings.calibrate and settings.documents_dir == tmp_path / "documents"
    assert builder_settings(None).cluster_replicas == 4
    assert os.environ["RAGSPEC_CLUSTER_REPLICAS"] == "4" and "RAGSPEC_API_KEYS" not in os.environ
    with pytest.raises(ValidationError, match="cluster_replicas"):
        builder_settings({"cluster_replicas": "0"})


def test_a_local_ray_keeps_its_files_where_the_settings_say(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.settings import Settings

    assert "_temp_dir" not in ray_init_options(Settings())  # type: ignore[call-arg]
    monkeypatch.setenv("RAGSPEC_RAY_TEMP_DIR", str(tmp_path / "ray"))
    options = ray_init_options(Settings(cluster_replicas=64))  # type: ignore[call-arg]
    assert options["_temp_dir"] == str(tmp_path / "ray") and options["num_cpus"] >= 64


def test_a_replica_takes_its_rank_s_dir_unless_a_live_one_holds_it(tmp_path: Path) -> None:
    first, name = _own_dir(tmp_path, "0", "abc")
    assert name == "0"
    second, other = _own_dir(tmp_path, "0", "def")  # rank 0 reassigned while the first still lives
    assert other == "def"
    first.close()
    third, again = _own_dir(tmp_path, "0", "ghi")  # the first is gone: its dir (and KV) is reused
    assert again == "0"
    second.close()
    third.close()


def test_openai_file_search_requests_route_by_their_store_and_creations_are_never_sent_twice() -> None:
    from app.cluster.serve import creates

    tenant = tenant_of_key("key-a")
    store = routing_key(["collection:vs1"], tenant)
    tools = [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs1"]}]
    assert _key("POST", "/v1/responses", {"input": "q", "tools": tools}) == store
    assert _key("POST", "/v1/responses", {"input": "q"}) == routing_key([], tenant)
    assert _key("POST", "/v1/vector_stores/vs1/search", {"query": "q"}) == store
    assert _key("DELETE", "/v1/files/f1") == routing_key(["f1"], tenant)
    assert _key("DELETE", "/v1/vector_stores/vs1/files/f1") is None and _key("GET", "/v1/vector_stores/vs1") is None
    made = [("POST", "/v1/files"), ("POST", "/v1/vector_stores"), ("POST", "/v1/vector_stores/vs1/files"),
            ("POST", "/v1/vector_stores/vs1/file_batches/"), ("POST", "/v1/documents"), ("POST", "/v1/collections")]
    assert all(creates(m, p) for m, p in made)
    kept = [("POST", "/v1/responses"), ("POST", "/v1/vector_stores/vs1/search"), ("POST", "/v1/vector_stores/vs1"),
            ("GET", "/v1/files"), ("POST", "/v1/ask"), ("POST", "/v1/vector_stores/vs1/file_batches/b1/cancel")]
    assert not any(creates(m, p) for m, p in kept)
