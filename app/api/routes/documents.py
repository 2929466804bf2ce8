"""Documents: upload (multipart file or JSON text) -> 202 and background indexing; list, read, delete."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.types import Message

from app.api.deps import ServicesDep, TenantDep
from app.api.openapi import ERRORS
from app.errors import InvalidRequest, PayloadTooLarge
from app.schemas import (
    MAX_TITLE_CHARS,
    DocumentAccepted,
    DocumentList,
    DocumentOut,
    DocumentTextIn,
    DocumentTitleIn,
)
from retrieval.errors import UnsupportedDocumentType
from retrieval.store import DocumentRecord

router = APIRouter(prefix="/v1/documents", tags=["documents"])
M = TypeVar("M", bound=BaseModel)

MULTIPART_SLACK = 64 * 1024  # headers and boundaries around the file part
JSON_SLACK = 64 * 1024  # the title and the JSON around a text of the upload limit
UPLOAD_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary", "description": "txt, md, html or pdf"},
                        "title": {"type": "string", "maxLength": MAX_TITLE_CHARS},
                    },
                }
            },
            "application/json": {"schema": DocumentTextIn.model_json_schema()},
        },
    }
}


def document_out(record: DocumentRecord) -> DocumentOut:
    return DocumentOut(
        id=record.id,
        title=record.title,
        status=record.status,
        progress=record.progress,
        message=record.message,
        media_type=record.content_type,
        size_bytes=record.size,
        chunks=record.n_chunks or None,
        tokens=record.n_tokens or None,
        created_at=record.created_at,
    )


async def read_limited(request: Request, limit: int) -> Request:
    """A view of ``request`` whose body raises ``PayloadTooLarge`` once more than ``limit`` bytes arrive
    (checked while reading: an oversized upload is never buffered whole)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the upload is {int(declared)} bytes; the limit is {limit} bytes")
    seen = 0

    async def receive() -> Message:
        nonlocal seen
        message = await request.receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise PayloadTooLarge(f"the upload exceeds the limit of {limit} bytes")
        return message

    return Request(request.scope, receive)


async def _from_multipart(request: Request, limit: int) -> tuple[bytes, str | None, str | None, str | None]:
    limited = await read_limited(request, limit + MULTIPART_SLACK)
    try:
        form = await limited.form(max_files=1, max_fields=4, max_part_size=64 * 1024)
    except HTTPException as exc:  # malformed multipart body
        raise InvalidRequest(f"malformed multipart body: {exc.detail}") from None
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("multipart upload needs a 'file' field holding the document")
        title = form.get("title")
        title = _validated(DocumentTitleIn, {"title": title}).title if isinstance(title, str) else None
        data = await upload.read(limit + 1)
        if len(data) > limit:
            raise PayloadTooLarge(f"the file exceeds the limit of {limit} bytes")
        return data, upload.filename, upload.content_type, title
    finally:
        await form.close()


async def _from_json(request: Request, limit: int) -> tuple[bytes, str | None, str | None, str | None]:
    """The body is read up to the upload limit (plus room for the title): a text whose JSON form is larger
    is refused with 413 before more of it is held."""
    body_limit = limit + JSON_SLACK
    limited = await read_limited(request, body_limit)
    try:
        body = await limited.body()
    except PayloadTooLarge:
        raise PayloadTooLarge(f"the JSON upload exceeds the limit of {body_limit} bytes") from None
    doc = _validated(DocumentTextIn, body)
    data = doc.text.encode("utf-8")
    if len(data) > limit:
        raise PayloadTooLarge(f"the text is {len(data)} bytes; the limit is {limit} bytes")
    title = doc.title or _first_line(doc.text)
    return data, None, "text/plain; charset=utf-8", title


def _validated(model: type[M], value: bytes | dict[str, Any]) -> M:
    """``value`` (JSON bytes or fields) as ``model``; the first validation error as a 422."""
    try:
        return model.model_validate_json(value) if isinstance(value, bytes) else model.model_validate(value)
    except ValidationError as exc:
        errors = exc.errors()
        if not errors:
            raise InvalidRequest("invalid JSON document") from None
        loc = ".".join(str(p) for p in errors[0]["loc"]) or "body"
        raise InvalidRequest(f"{loc}: {errors[0]['msg']}") from None


def _first_line(text: str, width: int = 80) -> str | None:
    for line in text.splitlines():
        line = line.strip().lstrip("#").strip()
        if line:
            return line if len(line) <= width else line[: width - 1] + "…"
    return None


@router.post(
    "",
    status_code=202,
    response_model=DocumentAccepted,
    openapi_extra=UPLOAD_BODY,
    responses=ERRORS,
    summary="Upload a document (multipart 'file', or JSON {text, title}); indexing runs in the background",
)
async def upload_document(request: Request, services: ServicesDep, tenant: TenantDep) -> DocumentAccepted:
    limit = services.config.limits.max_upload_bytes
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media == "multipart/form-data":
        data, filename, content_type, title = await _from_multipart(request, limit)
    elif media in ("application/json", ""):
        data, filename, content_type, title = await _from_json(request, limit)
    else:
        raise UnsupportedDocumentType(None, media)
    record = await asyncio.to_thread(services.store.create, tenant, title, filename, content_type, data)
    services.indexing.submit(record.id)
    return DocumentAccepted(id=record.id, title=record.title, status=record.status, progress=record.progress)


@router.get("", response_model=DocumentList, responses=ERRORS)
async def list_documents(services: ServicesDep, tenant: TenantDep) -> DocumentList:
    records = await asyncio.to_thread(services.store.list, tenant)
    return DocumentList(documents=[document_out(r) for r in records])


@router.get("/{document_id}", response_model=DocumentOut, responses=ERRORS)
async def get_document(document_id: str, services: ServicesDep, tenant: TenantDep) -> DocumentOut:
    return document_out(services.store.get(document_id, tenant))


@router.delete("/{document_id}", status_code=204, responses=ERRORS)
async def delete_document(document_id: str, services: ServicesDep, tenant: TenantDep) -> Response:
    await asyncio.to_thread(services.store.delete, document_id, tenant)
    services.forget_document(document_id)
    return Response(status_code=204)
