"""The OpenAPI documentation the routes share: the error responses every route may give."""

from __future__ import annotations

from typing import Any

from app.schemas import ErrorResponse

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (401, 404, 409, 413, 415, 422, 429)
}
