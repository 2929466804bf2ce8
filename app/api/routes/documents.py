"""Documents: upload (multipart files or JSON text) -> 202 and background indexing; list, read, set attributes,
delete.

A multipart upload may hold many files (``file`` repeated, at most ``MAX_FILES_PER_UPLOAD``): each is parsed and
stored before any is submitted for indexing, and a bad one refuses the whole request with nothing stored. One file
answers as before (one ``DocumentAccepted``), more than one ``{"documents": [...]}`` in the order of the files."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException

from app.api.deps import ServicesDep, TenantDep
from app.api.openapi import ERRORS
from app.api.uploads import MULTIPART_FIELDS, MULTIPART_SLACK, read_limited, read_limited_parts
from app.errors import InvalidRequest, PayloadTooLarge, ServiceError, translate
from app.schemas import (
    ATTRIBUTES_DOC,
    MAX_FILES_PER_UPLOAD,
    MAX_TITLE_CHARS,
    DocumentAccepted,
    DocumentList,
    DocumentOut,
    DocumentPatch,
    DocumentsAccepted,
    DocumentTextIn,
    DocumentUploadFields,
)
from app.services import Services
from app.serving import catalogue
from retrieval.errors import UnsupportedDocumentType
from retrieval.filters import Attributes

router = APIRouter(prefix="/v1/documents", tags=["documents"])
M = TypeVar("M", bound=BaseModel)

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
                        "file": {
                            "type": "array",
                            "items": {"type": "string", "format": "binary"},
                            "maxItems": MAX_FILES_PER_UPLOAD,
                            "description": "txt, md, html or pdf; repeat the field for several files (one request, "
                            "all stored or none)",
                        },
                        "title": {"type": "string", "maxLength": MAX_TITLE_CHARS,
                                  "description": "The title of every file (default: from each file)"},
                        "collection_id": {"type": "string", "description": "Put the documents in this collection"},
                        "attributes": {"type": "string", "description": ATTRIBUTES_DOC + ", as a JSON string: one "
                                       "object for every file, or a list of one object per file in their order"},
                    },
                }
            },
            "application/json": {"schema": DocumentTextIn.model_json_schema()},
        },
    }
}


@dataclass
class Upload:
    """One file of an upload (its bytes read when it is stored), or the JSON upload's text."""

    filename: str | None
    content_type: str | None
    file: UploadFile | None = None
    data: bytes | None = None
    title: str | None = None
    attributes: Attributes | None = None  # its own (a multipart list of one object per file), else the upload's


def _one_field(form: FormData, name: str) -> str | None:
    values = form.getlist(name)
    if len(values) > 1:
        raise InvalidRequest(f"{name}: give it once (got {len(values)})")
    if not values:
        return None
    if not isinstance(values[0], str):
        raise InvalidRequest(f"{name}: must be a form field, not a file")
    return values[0]


def _attributes_field(raw: str | None) -> Any:
    """The multipart ``attributes`` field: a JSON object as a string (every file's), or a JSON list of one object
    per file."""
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        raise InvalidRequest("attributes: must be a JSON object as a string, e.g. "
                             '{"year": 2024, "team": "search"}, or a list of one object per file') from None


async def _from_multipart(request: Request, limit: int) -> tuple[list[Upload], DocumentUploadFields, FormData]:
    """The files (not read yet: each is read when it is stored), the fields, and the form to close."""
    limited = await read_limited_parts(request, limit + MULTIPART_SLACK, MAX_FILES_PER_UPLOAD + MULTIPART_FIELDS)
    try:
        form = await limited.form(max_files=MAX_FILES_PER_UPLOAD, max_fields=MULTIPART_FIELDS,
                                  max_part_size=MULTIPART_SLACK)
    except HTTPException as exc:  # malformed multipart body, too many files or fields
        raise InvalidRequest(f"malformed multipart body: {exc.detail}") from None
    try:
        files = form.getlist("file")
        if not files or not all(isinstance(f, UploadFile) for f in files):
            raise InvalidRequest("multipart upload needs a 'file' field holding the document (repeat it for "
                                 "several documents)")
        attributes = _attributes_field(_one_field(form, "attributes"))
        per_file = attributes if isinstance(attributes, list) else None
        fields = _validated(DocumentUploadFields, {
            "title": _one_field(form, "title"),
            "collection_id": _one_field(form, "collection_id"),
            "attributes": None if per_file is not None else attributes,
        })
        own = catalogue.per_file_attributes(per_file, len(files)) if per_file is not None else [None] * len(files)
        uploads = [Upload(f.filename, f.content_type, file=f, title=fields.title, attributes=a)
                   for f, a in zip(files, own, strict=True) if isinstance(f, UploadFile)]
    except BaseException:
        await form.close()
        raise
    return uploads, fields, form


async def _from_json(request: Request, limit: int) -> tuple[list[Upload], DocumentUploadFields]:
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
    return [Upload(None, "text/plain; charset=utf-8", data=data, title=title)], doc


async def _store(services: Services, tenant: str, uploads: list[Upload], fields: DocumentUploadFields,
                 limit: int) -> list[DocumentAccepted]:
    """Store every upload (one file's bytes held at a time), then submit them all for indexing; the first bad one
    deletes those stored before it and is the request's error (naming the file when there are several)."""
    collection_ids = [fields.collection_id] if fields.collection_id is not None else []
    batch = await asyncio.to_thread(catalogue.UploadBatch, services.store, tenant, attributes=fields.attributes,
                                    collection_ids=collection_ids)
    try:
        for n, upload in enumerate(uploads, start=1):
            try:
                data = upload.data
                if upload.file is not None:
                    data = await upload.file.read(limit + 1)
                    if len(data) > limit:
                        raise PayloadTooLarge(f"the file exceeds the limit of {limit} bytes")
                assert data is not None
                await asyncio.to_thread(batch.add, data, upload.filename, upload.content_type, upload.title,
                                        upload.attributes)
            except Exception as exc:
                named = _naming(exc, n, upload.filename) if len(uploads) > 1 else None
                if named is None:
                    raise
                raise named from exc
    except BaseException:
        batch.discard()  # here, not in a thread: a cancelled request must not leave half of it stored
        raise
    accepted = await asyncio.to_thread(batch.accepted)
    for record in batch.records:
        services.indexing.submit(record.id)
    return accepted


def _naming(exc: Exception, n: int, filename: str | None) -> ServiceError | None:
    """A file's error, its message prefixed with the file it is about; None for a bug (raised as it is)."""
    err = translate(exc)
    if err is None:
        return None
    named = ServiceError(f"file {n} ({filename or 'unnamed'}): {err.message}", headers=err.headers)
    named.status, named.code = err.status, err.code
    return named


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
    response_model=DocumentAccepted | DocumentsAccepted,
    openapi_extra=UPLOAD_BODY,
    responses=ERRORS,
    summary="Upload documents (multipart 'file', repeatable; or JSON {text, title}), optionally into a collection "
    "with attributes; indexing runs in the background",
)
async def upload_document(
    request: Request, services: ServicesDep, tenant: TenantDep
) -> DocumentAccepted | DocumentsAccepted:
    limit = services.config.limits.max_upload_bytes
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media == "multipart/form-data":
        uploads, fields, form = await _from_multipart(request, limit)
        try:
            accepted = await _store(services, tenant, uploads, fields, limit)
        finally:
            await form.close()
        return accepted[0] if len(accepted) == 1 else DocumentsAccepted(documents=accepted)
    if media in ("application/json", ""):
        uploads, fields = await _from_json(request, limit)
        return (await _store(services, tenant, uploads, fields, limit))[0]
    raise UnsupportedDocumentType(None, media)


@router.get("", response_model=DocumentList, responses=ERRORS)
async def list_documents(services: ServicesDep, tenant: TenantDep) -> DocumentList:
    def listed() -> list[DocumentOut]:
        return catalogue.documents_out(services.store, services.store.list(tenant))

    return DocumentList(documents=await asyncio.to_thread(listed))


@router.get("/{document_id}", response_model=DocumentOut, responses=ERRORS)
async def get_document(document_id: str, services: ServicesDep, tenant: TenantDep) -> DocumentOut:
    return await asyncio.to_thread(catalogue.document, services.store, tenant, document_id)


@router.patch("/{document_id}", response_model=DocumentOut, responses=ERRORS,
              summary="Set a document's attributes (replaced whole)")
async def patch_document(document_id: str, body: DocumentPatch, services: ServicesDep,
                         tenant: TenantDep) -> DocumentOut:
    return await asyncio.to_thread(catalogue.set_attributes, services.store, tenant, document_id, body.attributes)


@router.delete("/{document_id}", status_code=204, responses=ERRORS)
async def delete_document(document_id: str, services: ServicesDep, tenant: TenantDep) -> Response:
    await asyncio.to_thread(services.store.delete, document_id, tenant)
    services.forget_document(document_id)
    return Response(status_code=204)
