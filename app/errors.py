"""Domain errors -> HTTP: the one place deciding status codes. Body: ``{"error": {"code", "message"}}``; on OpenAI's
file search surface (``OPENAI_PATHS``) OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with its
statuses (a bad request is a 400 there, not a 422)."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import decoding.errors as decoding_errors
import retrieval.errors as retrieval_errors

logger = logging.getLogger(__name__)


class ServiceError(Exception):
    """An error the service reports to the client as is. Subclasses fix ``status`` and ``code``."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class Unauthorized(ServiceError):  # noqa: N818 (the API's error names)
    status, code = 401, "unauthorized"

    def __init__(self, message: str = "a valid Bearer API key is required") -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class PayloadTooLarge(ServiceError):  # noqa: N818 (the API's error names)
    status, code = 413, "payload_too_large"


class InvalidRequest(ServiceError):  # noqa: N818 (the API's error names)
    status, code = 422, "invalid_request"


class NotAvailableYet(ServiceError):  # noqa: N818 (the API's error names)
    """A decoding mode whose drafter is not part of this build yet (never answered by a stand-in)."""

    status, code = 400, "not_available_yet"


class Overloaded(ServiceError):  # noqa: N818 (the API's error names)
    status, code = 429, "overloaded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, retry_after_s))})
        self.retry_after_s = max(1, retry_after_s)


class ServiceUnavailable(ServiceError):  # noqa: N818 (the API's error names)
    status, code = 503, "unavailable"


# Library domain errors -> (status, code). The message is the library's own (written for the user).
LIBRARY_ERRORS: dict[type[Exception], tuple[int, str]] = {
    retrieval_errors.DocumentNotFound: (404, "document_not_found"),
    retrieval_errors.DocumentNotReady: (409, "document_not_ready"),
    retrieval_errors.CollectionNotFound: (404, "collection_not_found"),
    retrieval_errors.CollectionNotReady: (409, "collection_not_ready"),
    retrieval_errors.BatchNotFound: (404, "file_batch_not_found"),
    retrieval_errors.ResponseNotFound: (404, "response_not_found"),
    retrieval_errors.InvalidFilter: (422, "invalid_filter"),
    retrieval_errors.InvalidAttributes: (422, "invalid_attributes"),
    retrieval_errors.UnsupportedDocumentType: (415, "unsupported_document_type"),
    retrieval_errors.EmptyDocument: (422, "empty_document"),
    retrieval_errors.UnreadableDocument: (422, "unreadable_document"),
    retrieval_errors.EmbedderMismatch: (409, "embedder_mismatch"),
    retrieval_errors.IndexDamaged: (409, "index_damaged"),
    retrieval_errors.TooManyPages: (413, "too_many_pages"),
    retrieval_errors.EmbedderUnavailable: (503, "embedder_unavailable"),
    decoding_errors.ContextTooLong: (400, "context_too_long"),
    # bases last: a broken index file or model setup is the server's fault, reported with its reason
    retrieval_errors.RetrievalError: (500, "retrieval_error"),
    decoding_errors.DecodingError: (500, "decoding_error"),
}


def translate(exc: BaseException) -> ServiceError | None:
    """The service error for a domain exception, or None when it is not one (a bug)."""
    if isinstance(exc, ServiceError):
        return exc
    for library_error, (status, code) in LIBRARY_ERRORS.items():
        if isinstance(exc, library_error):
            err = ServiceError(str(exc) or code.replace("_", " "))
            err.status, err.code = status, code
            return err
    return None


def error_body(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """The error body; with ``param`` (the request field at fault) also OpenAI's ``type`` and ``param``."""
    if param is None:
        return {"error": {"code": code, "message": message}}
    return {"error": {"code": code, "message": message, "type": "invalid_request_error", "param": param}}


OPENAI_PATHS = ("/v1/files", "/v1/vector_stores", "/v1/responses")
_PARAM = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")  # a message naming its field first: "filters.type: ..."


def _json(status: int, code: str, message: str, headers: dict[str, str] | None = None,
          request: Request | None = None, param: str | None = None) -> JSONResponse:
    if request is not None and request.url.path.startswith(OPENAI_PATHS):
        return _openai_json(status, code, message, headers, param)
    return JSONResponse(error_body(code, message), status_code=status, headers=headers)


def _openai_json(status: int, code: str, message: str, headers: dict[str, str] | None,
                 param: str | None) -> JSONResponse:
    """OpenAI's error: a request ragspec refuses is a 400 (422 is not one of OpenAI's), ``param`` the field the
    message names first, ``type`` by who is at fault."""
    status = 400 if status == 422 else status
    if param is None and (named := _PARAM.match(message)):
        param = named.group(1)
    kind = ("server_error" if status >= 500 else "authentication_error" if status == 401
            else "rate_limit_error" if status == 429 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def _unknown_fields(exc: RequestValidationError) -> list[str]:
    return [".".join(str(p) for p in err.get("loc", ()) if p != "body")
            for err in exc.errors() if err.get("type") == "extra_forbidden"]


def install_error_handlers(app: FastAPI) -> None:
    async def service_error(request: Request, exc: Exception) -> JSONResponse:
        err = translate(exc)
        if err is None:  # not a domain error: a bug, reported as such
            logger.exception("unhandled error", exc_info=exc)
            return _json(500, "internal_error", "internal error", request=request)
        return _json(err.status, err.code, err.message, err.headers, request=request)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        unknown = _unknown_fields(exc)
        if unknown:  # a parameter we do not implement: refused by name, never ignored (as OpenAI does)
            message = (f"unsupported parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} "
                       "(docs/api.md lists what ragspec supports)")
            if request.url.path.startswith(OPENAI_PATHS):
                return _openai_json(400, "unsupported_parameter", message, None, unknown[0])
            return JSONResponse(error_body("unsupported_parameter", message, unknown[0]), status_code=400)
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")) or None
        return _json(422, "invalid_request", _validation_message(exc), request=request, param=param)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _json(exc.status_code, code, str(exc.detail), dict(exc.headers or {}), request=request)

    app.add_exception_handler(ServiceError, service_error)
    for library_error in LIBRARY_ERRORS:
        app.add_exception_handler(library_error, service_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, service_error)
