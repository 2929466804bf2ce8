"""Liveness and readiness (no auth: probes carry no key, and the answers hold only check names and their
status), Prometheus metrics (a tenant's key sees its own series, the metrics token every series)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from app.api.deps import ServicesDep
from app.api.middleware import METRICS_VIEW, TENANT
from app.errors import Unauthorized
from app.schemas import Health, Readiness
from app.services import Services

PROBE_BYTES = 64 * 1024  # written (and flushed) by the store check: a full disk fails it
MIB = 1024 * 1024

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is up (no auth, no dependency checks)."""
    return Health(status="ok")


def _writable(directory: Path, min_free_bytes: int) -> str:
    """"ok" when the disk holding ``directory`` has ``min_free_bytes`` free and takes a real write."""
    try:
        free = shutil.disk_usage(directory).free
        if free < min_free_bytes:
            return (f"error: {free // MIB} MiB free on the data disk, below the minimum of "
                    f"{min_free_bytes // MIB} MiB (RAGSPEC_MIN_FREE_DISK_MB)")
        fd, path = tempfile.mkstemp(prefix=".readyz-", dir=directory)
        try:
            os.write(fd, os.urandom(PROBE_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(path)
    except OSError as exc:
        return f"error: {exc.strerror or type(exc).__name__}"
    return "ok"


async def readiness(request: Request) -> tuple[int, Readiness]:
    services: Services | None = getattr(request.app.state, "services", None)
    if services is None:
        return 503, Readiness(status="unavailable", checks={"models": "not loaded"})
    checks = {
        "models": "ok",
        "store": await asyncio.to_thread(
            _writable, services.store.root, services.config.health.min_free_disk_bytes
        ),
        "generation_worker": "ok" if services.scheduler.alive else "error: stopped",
        "indexing_worker": "ok" if services.indexing.alive else "error: stopped",
    }
    tier = services.drafters.shared_tier.status()
    if services.redis.state != "disabled":
        up = await services.redis.ping()
        checks["redis"] = "ok" if up else "down (sessions and draft cache in process)"
        checks["draft_cache"] = "ok" if tier.get("available") else "reconnecting (drafts from the local mirror)"
    else:
        checks["draft_cache"] = "ok (in process)"
    failed = any(v.startswith("error") for v in checks.values())
    degraded = checks.get("redis", "ok") != "ok"  # the draft cache follows Redis on its own schedule
    if failed:
        return 503, Readiness(status="unavailable", checks=checks)
    return 200, Readiness(status="degraded" if degraded else "ready", checks=checks)


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(request: Request) -> JSONResponse:
    """200 when models are loaded and the store's disk has room and takes a write (``degraded`` while Redis
    is down), else 503. No key needed."""
    code, body = await readiness(request)
    return JSONResponse(body.model_dump(), status_code=code)


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics(request: Request, services: ServicesDep) -> Response:
    """Prometheus text. With API keys: a key's own tenant's series only; the metrics token: everything."""
    view = request.scope.get(METRICS_VIEW)
    if view is None:  # only the gate decides who sees what
        raise Unauthorized()
    tenant = request.scope.get(TENANT)
    data = await asyncio.to_thread(services.metrics.render, view, tenant)
    return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")
