"""Cluster mode on Ray Serve (``ragspec serve --cluster``): an ingress deployment and an engine deployment.

- ``Engine``: one replica per box (or GPU), each the whole one-process app (models, KV prefix cache, scheduler)
  with a replica-local data dir for its KV, reading the shared documents dir and catalogue (PostgreSQL). Its
  settings reach it as data (the command's, ``app.cluster.checks.settings_data``), as requests do
  (``app.cluster.bridge``); its answers stream back item by item.
- ``Ingress``: the HTTP entry (Serve's proxy in front), given the service's frozen config. It names each request's
  route key, the tenant and document set whose KV prefix the request reads (``routing.routing_key``; a session
  follow-up's documents come from the session in Redis), and calls the engine with it.
- ``DocumentRouter``: Serve's request router for the engine. A keyed request goes to its owner on the ring
  (``routing.AffinityRouter``: consistent hashing with bounded loads), then to the next replicas along the ring
  when the owner is at its cap, full or gone; an unkeyed one (uploads, lists, health) to the least loaded. A
  request may name a replica (header ``X-Ragspec-Replica``, for diagnostics); every answer says which replica
  served it in the same header.

Ingestion needs nothing of Ray: the replicas claim the catalogue's ingestion jobs with leases
(``app.serving.indexing``), so a document is ingested once and one whose worker died is taken over. Ray itself is
imported here only.
"""

# no `from __future__ import annotations`: FastAPI reads the ingress route's annotations through Serve's wrapper
import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray.exceptions import ActorDiedError
from ray.serve.request_router import RequestRouter

from app.cluster.bridge import ABORTED, WireRequest, play, wire_request
from app.cluster.checks import check_cluster_settings, replica_settings, settings_data, settings_from_data
from app.cluster.routing import DEFAULT_VNODES, AffinityRouter, routing_key
from app.config import ServiceConfig
from app.errors import ServiceError, error_body
from app.serving.auth import KeyRing
from app.serving.sessions import last_scope
from app.settings import ClusterSettings, Settings

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-ragspec-replica"
APP_NAME = "ragspec"
ATTEMPTS = 5  # tries of a request whose replica died before answering (not an upload: it may have been stored)
# per engine replica: generations it runs or queues itself (its own scheduler answers 429 past its queue)
MAX_ONGOING = 256


def _bearer(headers: Sequence[tuple[str, str]]) -> str | None:
    for key, value in headers:
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _document_ids(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


async def route_key(request: WireRequest, keys: KeyRing, sessions: Any) -> str | None:
    """The key a request routes by, None when any replica serves it as well as another (or it will be refused:
    an unknown key, a malformed body: the replica says why)."""
    try:
        tenant = keys.tenant(_bearer(request["headers"]))
    except ServiceError:
        return None
    method, path = request["method"], request["path"].rstrip("/")
    if method == "DELETE" and path.startswith(("/v1/documents/", "/v1/files/")) and path.count("/") == 3:
        return routing_key([path.rsplit("/", 1)[1]], tenant)  # its KV is dropped where it most likely lives
    parts = path.split("/")
    if method == "POST" and len(parts) == 5 and parts[2] == "vector_stores" and parts[4] == "search":
        return routing_key([f"collection:{parts[3]}"], tenant)  # where the store's index is warm
    if method != "POST" or path not in ("/v1/ask", "/v1/chat/completions", "/v1/responses"):
        return None
    try:
        body = json.loads(request["body"] or b"{}")
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    ids = _document_ids(body.get("document_ids"))
    collections = _document_ids(body.get("collection_ids"))
    for tool in body.get("tools") or [] if path == "/v1/responses" else []:
        if isinstance(tool, dict) and tool.get("type") == "file_search":
            collections += _document_ids(tool.get("vector_store_ids"))
    session_id = body.get("session_id")
    if not ids and not collections and path == "/v1/ask" and isinstance(session_id, str) and sessions is not None:
        with contextlib.suppress(Exception):  # the replica answers a session it cannot find
            ids, collections, _ = last_scope(await sessions.history(tenant, session_id))
    return routing_key(ids + [f"collection:{c}" for c in collections], tenant)


def creates(method: str, path: str) -> bool:
    """A request that stores something (a document, a file, a collection or store, a membership, a batch)."""
    path = path.rstrip("/")
    if method != "POST":
        return False
    if path in ("/v1/documents", "/v1/collections", "/v1/files", "/v1/vector_stores"):
        return True
    parts = path.split("/")
    return len(parts) == 5 and parts[2] == "vector_stores" and parts[4] in ("files", "file_batches")


def _replica_logging(level: str) -> None:
    """Our loggers' lines, from ``level`` up, on the replica's stderr (Ray's worker log, shown by the driver): Ray
    sets up its own loggers only."""
    level = level.upper()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("app", "retrieval", "decoding"):  # ragspec's packages (app.cli.main's OWN_LOGGERS)
        own = logging.getLogger(name)
        if not own.handlers:
            own.addHandler(handler)
            own.setLevel(level)
            own.propagate = False


# ---- Ray Serve -----------------------------------------------------------------------------------------------


class EngineReplica:
    """An engine replica: the one-process app, loaded with the command's settings, handed over as data
    (``replica_settings``: its own data dir under the shared one)."""

    async def __init__(self, settings: dict[str, Any]) -> None:  # type: ignore[misc]  # Serve awaits it
        from ray import serve

        from app.main import create_app

        base = settings_from_data(settings)
        _replica_logging(base.log_level)
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        rank = context.rank.rank if context.rank else 0
        self._lock, own = _own_dir(base.data_dir / "replicas", str(rank), self.name)
        self.app = create_app(replica_settings(base, own))
        self._stack = contextlib.AsyncExitStack()
        await self._stack.enter_async_context(self.app.router.lifespan_context(self.app))
        logger.info("engine replica %s ready", self.name)

    async def forward(self, request: WireRequest, route: str | None = None,
                      pin: str | None = None) -> AsyncIterator[Any]:
        """Answer one request; ``route`` and ``pin`` are read by ``DocumentRouter`` before it gets here."""
        async for item in play(self.app, request, self.name):
            yield item

    def check_health(self) -> None:
        services = self.app.state.services
        if services is None or not services.indexing.alive:
            raise RuntimeError("the replica's services are not running")

    async def __del__(self) -> None:
        await self._stack.aclose()
        self._lock.close()


def _own_dir(root: Path, rank: str, name: str) -> tuple[Any, str]:
    """The replica's data dir under ``root``: its rank's, held by a lock while it lives (Serve may give a live
    replica's rank to a new one), else one named after the replica. The open lock file and the dir's name."""
    import fcntl

    for dirname in (rank, name):
        (root / dirname).mkdir(parents=True, exist_ok=True)
        handle = (root / dirname / ".replica.lock").open("a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle, dirname
        except BlockingIOError:
            handle.close()
    raise RuntimeError(f"replica {name}: its data dir under {root} is held by another process")


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> StreamingResponse:
    body = json.dumps(error_body(code, message)).encode()
    return StreamingResponse(iter([body]), status_code=status, media_type="application/json", headers=headers)


# Serve pickles the ingress's FastAPI app when the class below is decorated: what its route calls is defined above
http = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)


def _ingress(cls: type) -> type:
    from ray import serve

    return serve.ingress(http)(cls)  # type: ignore[no-any-return]


@_ingress
class Ingress:
    """The HTTP entry: every request is forwarded to an engine replica, chosen by its route key. ``config`` is the
    service's (the command built it from its settings), ``redis_url`` where the sessions are."""

    def __init__(self, engine: Any, config: ServiceConfig, redis_url: str | None) -> None:
        from app.serving.redis_link import RedisLink
        from app.serving.sessions import SessionStore

        self.engine = engine.options(stream=True)
        self.keys = KeyRing(config.access.api_keys)
        # a body past what any route takes is refused here, before it is held in memory and sent on (a multipart
        # upload of several files included: here one request carries at most one file's limit in all)
        self.max_body = max(config.limits.max_upload_bytes, config.limits.max_json_bytes) + 64 * 1024
        self.redis = RedisLink(redis_url)
        self.sessions = SessionStore(self.redis, config.sessions.session_ttl_s, config.sessions.max_turns)

    @http.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"],
                    include_in_schema=False)
    async def proxy(self, request: Request, path: str) -> StreamingResponse:
        if request.method in ("POST", "PUT", "PATCH"):  # no body is read for a caller the replica would refuse
            try:
                self.keys.tenant(_bearer([(k.lower(), v) for k, v in request.headers.items()]))
            except ServiceError as exc:
                return _error(exc.status, exc.code, exc.message, getattr(exc, "headers", None))
            if int(request.headers.get("content-length") or 0) > self.max_body:
                return _error(413, "payload_too_large", f"the request body is larger than {self.max_body} bytes")
        client = (request.client.host, request.client.port) if request.client else None
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body:
                return _error(413, "payload_too_large", f"the request body is larger than {self.max_body} bytes")
        wire = wire_request(request.method, request.url.path, request.url.query, list(request.headers.items()),
                            bytes(raw), client)
        route = await route_key(wire, self.keys, self.sessions)
        # a request that creates something is never sent twice: its first replica may have made it before dying
        retry = not creates(wire["method"], wire["path"])
        for attempt in range(1, ATTEMPTS + 1):  # a replica that died before answering: the next one answers
            stream = self.engine.forward.remote(wire, route=route, pin=request.headers.get(REPLICA_HEADER))
            try:
                head = await stream.__anext__()
                break
            except ActorDiedError as exc:  # died: it will not answer (an unreachable one might still be running)
                logger.warning("engine replica unavailable (attempt %d): %s", attempt, exc)
                if not retry or attempt == ATTEMPTS:
                    return _error(503, "replica_unavailable", "the engine replica serving this request stopped; "
                                  "try again")
                await asyncio.sleep(0.5 * attempt)
            except BaseException:  # the caller went away before the answer began: the replica stops too
                stream.cancel()
                raise

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    if chunk == ABORTED:
                        raise RuntimeError("the replica failed in the middle of its answer")
                    yield chunk
            finally:
                stream.cancel()

        response = StreamingResponse(body(), status_code=head["status"])
        response.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in head["headers"]
                                if k != "content-length"] + [(REPLICA_HEADER.encode(), head["replica"].encode())]
        return response


def build_app(settings: Settings) -> Any:
    """The Serve application: ``Ingress`` (given the service's config) bound to ``EngineReplica``
    (``cluster_replicas`` replicas, given the settings as data). The libraries underneath read variables of their
    own (Hugging Face, OpenMP, transformers): both deployments get the command's, which a joined cluster's
    processes would not have."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    env = {k: v for k, v in os.environ.items() if k.startswith(("HF_", "OMP_", "TRANSFORMERS_"))}
    engine = serve.deployment(
        name="Engine",
        num_replicas=settings.cluster_replicas,
        max_ongoing_requests=MAX_ONGOING,
        ray_actor_options={"num_cpus": 1, "runtime_env": {"env_vars": env}},
        request_router_config=RequestRouterConfig(
            request_router_class=DocumentRouter,  # type: ignore[arg-type]  # a class or its import path
            request_router_kwargs={"load_factor": settings.cluster_load_factor, "slots": settings.max_batch},
        ),
        health_check_period_s=5,
        graceful_shutdown_timeout_s=5,
    )(EngineReplica)
    ingress = serve.deployment(name="Ingress", max_ongoing_requests=4 * MAX_ONGOING,
                               ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": env}})(Ingress)
    return ingress.bind(engine.bind(settings_data(settings)), ServiceConfig.from_settings(settings),
                        settings.redis_url)


def builder_settings(args: dict[str, Any] | None) -> Settings:
    """The settings of a Serve config file's application: the environment's, with ``args`` (by setting name) over
    them, each taken as its variable's text would be (validated the same; an empty one is unset, as an empty
    variable is)."""
    overrides: dict[str, Any] = {name.lower(): str(value) for name, value in (args or {}).items() if str(value)}
    return Settings(**overrides)


def app_builder(args: dict[str, Any]) -> Any:
    """The application for a Serve config file (``import_path: app.cluster.serve:app_builder``, as in
    deploy/kuberay/rayservice.yaml): ``builder_settings``, checked, the catalogue migrated."""
    settings = builder_settings(args)
    check_cluster_settings(settings)
    _migrate(settings)
    return build_app(settings)


def _migrate(settings: Settings) -> None:
    """The catalogue reached and migrated once, here, before the replicas start (not by all of them at once)."""
    from retrieval.catalogue import Catalogue

    Catalogue(str(settings.database_url)).close()


class DocumentRouter(RequestRouter):  # type: ignore[misc]
    """Serve's request router for the engine: the owner of the request's route key first (within its load cap),
    then the other replicas in ring order; Serve then takes the first of a rank that accepts the request."""

    def initialize_state(self, load_factor: float = 1.5, vnodes: int = DEFAULT_VNODES, slots: int = 0,
                         **_: Any) -> None:
        """``slots``: generations a replica runs at once (its batch); up to that many it keeps a document's requests
        whatever the others hold."""
        self._ring: AffinityRouter | None = None  # made with the first replicas
        self._load_factor, self._vnodes, self._slots = load_factor, vnodes, slots

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        if not by_name:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        pin, key = kwargs.get("pin"), kwargs.get("route")
        if pin in by_name:
            return [[by_name[pin]]]
        loads = {name: self.replica_queue_len_cache.get(r.replica_id) or 0 for name, r in by_name.items()}
        if key is None:  # the least loaded first; among equals, any (shuffled, then a stable sort)
            shuffled = random.sample(list(by_name.values()), len(by_name))
            return [sorted(shuffled, key=lambda r: loads[r.replica_id.unique_id])]
        names = sorted(by_name)
        if self._ring is None:
            self._ring = AffinityRouter(names, load_factor=self._load_factor, vnodes=self._vnodes, floor=self._slots)
        elif sorted(self._ring.replicas) != names:
            self._ring.set_replicas(names)
        first = self._ring.route(key, loads)
        rest = [name for name in self._ring.owners(key) if name != first]
        return [[by_name[first]], [by_name[name] for name in rest]]


# ---- the command ---------------------------------------------------------------------------------------------


def ray_init_options(settings: ClusterSettings) -> dict[str, Any]:
    """A local Ray on a small box: loopback only, no dashboard, a small object store, logical CPUs for every
    replica (each replica takes one); its files under ``ray_temp_dir`` when that is set."""
    options: dict[str, Any] = {
        "num_cpus": max(os.cpu_count() or 1, settings.cluster_replicas),
        "include_dashboard": False,
        "object_store_memory": 128 * 1024 * 1024,
        "_node_ip_address": "127.0.0.1",
        "configure_logging": False,
        "log_to_driver": True,
    }
    if settings.ray_temp_dir is not None:
        options["_temp_dir"] = str(settings.ray_temp_dir)
    return options


def run_cluster(settings: Settings, host: str, port: int) -> int:
    """Start (or join) Ray, deploy the application on ``host:port`` and serve until SIGINT / SIGTERM."""
    check_cluster_settings(settings)
    import ray
    from ray import serve

    if settings.ray_address:
        context = ray.init(address=settings.ray_address, configure_logging=False)
    else:
        context = ray.init(**ray_init_options(settings))
    logger.info("Ray cluster at %s", context.address_info.get("gcs_address"))  # type: ignore[attr-defined]
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(settings), name=APP_NAME, route_prefix="/")
        logger.info("serving on http://%s:%d (%d engine replicas, data dir %s)", host, port,
                    settings.cluster_replicas, settings.data_dir)
        stop.wait()
    finally:
        with contextlib.suppress(Exception):
            if settings.ray_address:  # a cluster others may use: only our application goes
                serve.delete(APP_NAME)
            else:
                serve.shutdown()
        ray.shutdown()
    return 0

