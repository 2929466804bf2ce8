"""Liveness (no auth), readiness per dependency, Prometheus metrics."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from app.deps import ServicesDep, TenantDep
from app.schemas import Health, Readiness
from app.services import Services

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is up (no auth, no dependency checks)."""
    return Health(status="ok")


def _writable(directory: Path) -> str:
    try:
        fd, path = tempfile.mkstemp(prefix=".readyz-", dir=directory)
        os.close(fd)
        os.unlink(path)
    except OSError as exc:
        return f"error: {exc.strerror or exc}"
    return "ok"


async def readiness(request: Request) -> tuple[int, Readiness]:
    services: Services | None = getattr(request.app.state, "services", None)
    if services is None:
        return 503, Readiness(status="unavailable", checks={"models": "not loaded"})
    checks = {
        "models": "ok",
        "store": await asyncio.to_thread(_writable, services.store.root),
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
async def readyz(request: Request, tenant: TenantDep) -> JSONResponse:
    """200 when models are loaded and the store is writable (``degraded`` while Redis is down), else 503."""
    code, body = await readiness(request)
    return JSONResponse(body.model_dump(), status_code=code)


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics(services: ServicesDep, tenant: TenantDep) -> Response:
    data = await asyncio.to_thread(services.metrics.render)
    return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")
