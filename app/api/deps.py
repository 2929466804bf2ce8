"""Dependency aliases for the routes: the loaded services and the caller's tenant."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.api.middleware import ARRIVED
from app.errors import ServiceUnavailable
from app.services import Services

bearer = HTTPBearer(auto_error=False, description="API key (required when RAGSPEC_API_KEYS is set)")


def get_services(request: Request) -> Services:
    services: Services | None = getattr(request.app.state, "services", None)
    if services is None:
        raise ServiceUnavailable("the service is starting or stopping")
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


def get_tenant(
    services: ServicesDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> str:
    return services.keys.tenant(credentials.credentials if credentials is not None else None)


TenantDep = Annotated[str, Depends(get_tenant)]


def arrival(request: Request) -> float:
    """``time.perf_counter()`` when the request reached the app (stamped by the outermost middleware), else
    now."""
    stamp = request.scope.get(ARRIVED)
    return stamp if isinstance(stamp, float) else time.perf_counter()
