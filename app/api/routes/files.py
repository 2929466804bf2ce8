"""OpenAI's Files API over ragspec's documents: ``POST /v1/files`` (multipart ``file`` and ``purpose``), list
(cursor pages, newest first by default), get, content (the bytes as uploaded), delete. A file is a document: it is
indexed when uploaded (so adding it to a vector store later is immediate) and usable by ragspec's own API by its id.
Errors in OpenAI's shape (``app.errors``). The work is ``app.serving.file_search``'s."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from starlette.datastructures import UploadFile

from app.api.deps import ServicesDep, TenantDep
from app.api.openapi import ERRORS
from app.api.uploads import MULTIPART_FIELDS, MULTIPART_SLACK, read_limited_parts
from app.errors import InvalidRequest, PayloadTooLarge
from app.openai_schemas import FILES_LIMIT_MAX, FileDeleted, FileObject, ListPage
from app.serving import catalogue, file_search

router = APIRouter(prefix="/v1/files", tags=["openai file search"])

FILE_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary", "description": "txt, md, html or pdf"},
                   "purpose": {"type": "string", "enum": ["assistants", "user_data"]}}}}}}}


@router.post("", response_model=FileObject, openapi_extra=FILE_BODY, responses=ERRORS, summary="Upload a file")
async def upload_file(request: Request, services: ServicesDep, tenant: TenantDep) -> FileObject:
    limit = services.config.limits.max_upload_bytes
    if request.headers.get("content-type", "").split(";", 1)[0].strip().lower() != "multipart/form-data":
        raise InvalidRequest("file: upload a file as multipart/form-data with 'file' and 'purpose'")
    limited = await read_limited_parts(request, limit + MULTIPART_SLACK, 1 + MULTIPART_FIELDS)
    try:
        form = await limited.form(max_files=1, max_fields=MULTIPART_FIELDS, max_part_size=MULTIPART_SLACK)
    except Exception as exc:  # malformed body, more than one file
        raise InvalidRequest(f"file: malformed multipart body: {getattr(exc, 'detail', exc)}") from None
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("file: the multipart body needs a 'file' part holding the document")
        purpose = form.get("purpose")
        file_search.check_purpose(purpose if isinstance(purpose, str) else None)
        data = await upload.read(limit + 1)
        if len(data) > limit:
            raise PayloadTooLarge(f"file: the file exceeds the limit of {limit} bytes")
        batch = catalogue.UploadBatch(services.store, tenant, purpose=str(purpose))
        record = await asyncio.to_thread(batch.add, data, upload.filename, upload.content_type, None)
    finally:
        await form.close()
    services.indexing.submit(record.id)
    return file_search.file_object(record)


@router.get("", response_model=ListPage, responses=ERRORS, summary="Your files (a page)")
async def list_files(
    services: ServicesDep, tenant: TenantDep,
    limit: Annotated[int, Query(ge=1, le=FILES_LIMIT_MAX)] = FILES_LIMIT_MAX,
    order: Literal["asc", "desc"] = "desc",
    after: Annotated[str | None, Query(max_length=128)] = None,
    purpose: Annotated[str | None, Query(max_length=32)] = None,
) -> ListPage:
    return await asyncio.to_thread(file_search.file_page, services.store, tenant, limit, order, after, purpose)


@router.get("/{file_id}", response_model=FileObject, responses=ERRORS, summary="A file")
async def get_file(file_id: str, services: ServicesDep, tenant: TenantDep) -> FileObject:
    return file_search.file_object(await asyncio.to_thread(services.store.get, file_id, tenant))


@router.get("/{file_id}/content", responses=ERRORS, summary="A file's bytes, as uploaded")
async def file_content(file_id: str, services: ServicesDep, tenant: TenantDep) -> Response:
    record = await asyncio.to_thread(services.store.get, file_id, tenant)
    data = await asyncio.to_thread(services.store.load_original, file_id)
    return Response(content=data, media_type=record.content_type or "application/octet-stream")


@router.delete("/{file_id}", response_model=FileDeleted, responses=ERRORS, summary="Delete a file")
async def delete_file(file_id: str, services: ServicesDep, tenant: TenantDep) -> FileDeleted:
    await asyncio.to_thread(services.store.delete, file_id, tenant)  # its stores' versions move: they follow
    services.forget_document(file_id)
    return FileDeleted(id=file_id)
