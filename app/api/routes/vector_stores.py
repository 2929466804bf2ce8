"""OpenAI's Vector Stores API over ragspec's collections: stores (create with files, list, get, modify, delete),
their files (add with attributes, list with a status filter, get, update attributes, remove, content), file batches
(create, get, cancel, list files) and search. A vector store is a collection (ragspec's ``/v1/collections`` sees
the same one), a file a document. Errors in OpenAI's shape (``app.errors``); the work is
``app.serving.file_search``'s. A change of a store's files brings its index in step in the background, as
ragspec's collection routes do."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, Query

from app.api.deps import ServicesDep, TenantDep
from app.api.openapi import ERRORS
from app.openai_schemas import (
    LIST_LIMIT_MAX,
    FileBatchCreate,
    FileBatchObject,
    FileContentPage,
    ListPage,
    SearchResultsPage,
    VectorStoreCreate,
    VectorStoreDeleted,
    VectorStoreFileCreate,
    VectorStoreFileDeleted,
    VectorStoreFileObject,
    VectorStoreFileUpdate,
    VectorStoreObject,
    VectorStoreSearch,
    VectorStoreUpdate,
)
from app.serving import file_search

router = APIRouter(prefix="/v1/vector_stores", tags=["openai file search"])

Limit = Annotated[int, Query(ge=1, le=LIST_LIMIT_MAX, description="Page size")]
Order = Annotated[Literal["asc", "desc"], Query(description="By creation time")]
After = Annotated[str | None, Query(max_length=128, description="The last id of the previous page")]
Before = Annotated[str | None, Query(max_length=128, description="Refused: ragspec pages forward only")]
Status = Annotated[Literal["in_progress", "completed", "failed", "cancelled"] | None, Query(alias="filter")]


@router.post("", response_model=VectorStoreObject, responses=ERRORS, summary="Create a vector store")
async def create_vector_store(body: VectorStoreCreate, services: ServicesDep, tenant: TenantDep) -> VectorStoreObject:
    out = await asyncio.to_thread(file_search.create_vector_store, services.file_search, tenant, body.name,
                                  body.description, body.file_ids, body.metadata, body.chunking_strategy,
                                  body.expires_after)
    if body.file_ids:
        services.collection_changed_soon(out.id)
    return out


@router.get("", response_model=ListPage, responses=ERRORS, summary="Your vector stores (a page)")
async def list_vector_stores(services: ServicesDep, tenant: TenantDep, limit: Limit = 20, order: Order = "desc",
                             after: After = None, before: Before = None) -> ListPage:
    file_search.check_before(before)
    return await asyncio.to_thread(file_search.vector_store_page, services.store, tenant, limit, order, after)


@router.get("/{vector_store_id}", response_model=VectorStoreObject, responses=ERRORS, summary="A vector store")
async def get_vector_store(vector_store_id: str, services: ServicesDep, tenant: TenantDep) -> VectorStoreObject:
    record = await asyncio.to_thread(services.store.get_collection, vector_store_id, tenant)
    return await asyncio.to_thread(file_search.vector_store_object, services.store, record)


@router.post("/{vector_store_id}", response_model=VectorStoreObject, responses=ERRORS,
             summary="Modify a vector store's name, metadata or expiry")
async def update_vector_store(vector_store_id: str, body: VectorStoreUpdate, services: ServicesDep,
                              tenant: TenantDep) -> VectorStoreObject:
    return await asyncio.to_thread(file_search.update_vector_store, services.store, tenant, vector_store_id,
                                   body.model_dump(exclude_unset=True))


@router.delete("/{vector_store_id}", response_model=VectorStoreDeleted, responses=ERRORS,
               summary="Delete a vector store (its files stay)")
async def delete_vector_store(vector_store_id: str, services: ServicesDep, tenant: TenantDep) -> VectorStoreDeleted:
    await asyncio.to_thread(services.store.delete_collection, vector_store_id, tenant)
    await asyncio.to_thread(services.forget_collection, vector_store_id)
    return VectorStoreDeleted(id=vector_store_id)


# ---- files ----------------------------------------------------------------------------------------------------


@router.post("/{vector_store_id}/files", response_model=VectorStoreFileObject, responses=ERRORS,
             summary="Add a file (with attributes)")
async def add_file(vector_store_id: str, body: VectorStoreFileCreate, services: ServicesDep,
                   tenant: TenantDep) -> VectorStoreFileObject:
    out = await asyncio.to_thread(file_search.add_file, services.file_search, tenant, vector_store_id, body.file_id,
                                  body.attributes, body.chunking_strategy)
    services.collection_changed_soon(vector_store_id)
    return out


@router.get("/{vector_store_id}/files", response_model=ListPage, responses=ERRORS,
            summary="A vector store's files (a page, by status with filter)")
async def list_files(vector_store_id: str, services: ServicesDep, tenant: TenantDep, limit: Limit = 20,
                     order: Order = "desc", after: After = None, status: Status = None,
                     before: Before = None) -> ListPage:
    file_search.check_before(before)
    return await asyncio.to_thread(file_search.vector_store_file_page, services.file_search, tenant, vector_store_id,
                                   limit, order, after, status)


@router.get("/{vector_store_id}/files/{file_id}", response_model=VectorStoreFileObject, responses=ERRORS,
            summary="A file of a vector store, with its status and last error")
async def get_file(vector_store_id: str, file_id: str, services: ServicesDep,
                   tenant: TenantDep) -> VectorStoreFileObject:
    return await asyncio.to_thread(file_search.vector_store_file, services.file_search, tenant, vector_store_id,
                                   file_id)


@router.post("/{vector_store_id}/files/{file_id}", response_model=VectorStoreFileObject, responses=ERRORS,
             summary="Replace a file's attributes (the document's: every store it is in sees them)")
async def update_file(vector_store_id: str, file_id: str, body: VectorStoreFileUpdate, services: ServicesDep,
                      tenant: TenantDep) -> VectorStoreFileObject:
    return await asyncio.to_thread(file_search.update_file_attributes, services.file_search, tenant, vector_store_id,
                                   file_id, body.attributes)


@router.delete("/{vector_store_id}/files/{file_id}", response_model=VectorStoreFileDeleted, responses=ERRORS,
               summary="Take a file out of a vector store (the file stays)")
async def remove_file(vector_store_id: str, file_id: str, services: ServicesDep,
                      tenant: TenantDep) -> VectorStoreFileDeleted:
    await asyncio.to_thread(services.store.remove_from_collection, vector_store_id, file_id, tenant)
    services.collection_changed_soon(vector_store_id)
    return VectorStoreFileDeleted(id=file_id)


@router.get("/{vector_store_id}/files/{file_id}/content", response_model=FileContentPage, responses=ERRORS,
            summary="A file's text, as parsed")
async def file_content(vector_store_id: str, file_id: str, services: ServicesDep,
                       tenant: TenantDep) -> FileContentPage:
    return FileContentPage(data=await asyncio.to_thread(file_search.file_content, services.file_search, tenant,
                                                        vector_store_id, file_id))


# ---- file batches ---------------------------------------------------------------------------------------------


@router.post("/{vector_store_id}/file_batches", response_model=FileBatchObject, responses=ERRORS,
             summary="Add files together (with attributes)")
async def create_batch(vector_store_id: str, body: FileBatchCreate, services: ServicesDep,
                       tenant: TenantDep) -> FileBatchObject:
    out = await asyncio.to_thread(file_search.create_batch, services.file_search, tenant, vector_store_id,
                                  body.file_ids, body.attributes, body.chunking_strategy)
    services.collection_changed_soon(vector_store_id)
    return out


@router.get("/{vector_store_id}/file_batches/{batch_id}", response_model=FileBatchObject, responses=ERRORS,
            summary="A file batch with its files' counts by status")
async def get_batch(vector_store_id: str, batch_id: str, services: ServicesDep, tenant: TenantDep) -> FileBatchObject:
    batch = await asyncio.to_thread(services.store.get_batch, batch_id, vector_store_id, tenant)
    return await asyncio.to_thread(file_search.batch_object, services.store, batch)


@router.post("/{vector_store_id}/file_batches/{batch_id}/cancel", response_model=FileBatchObject, responses=ERRORS,
             summary="Cancel a file batch: its files not indexed yet leave the store (they stay files)")
async def cancel_batch(vector_store_id: str, batch_id: str, services: ServicesDep,
                       tenant: TenantDep) -> FileBatchObject:
    batch = await asyncio.to_thread(services.store.cancel_batch, batch_id, vector_store_id, tenant)
    services.collection_changed_soon(vector_store_id)
    return await asyncio.to_thread(file_search.batch_object, services.store, batch)


@router.get("/{vector_store_id}/file_batches/{batch_id}/files", response_model=ListPage, responses=ERRORS,
            summary="A file batch's files (a page, by status with filter)")
async def list_batch_files(vector_store_id: str, batch_id: str, services: ServicesDep, tenant: TenantDep,
                           limit: Limit = 20, order: Order = "desc", after: After = None,
                           status: Status = None, before: Before = None) -> ListPage:
    file_search.check_before(before)
    batch = await asyncio.to_thread(services.store.get_batch, batch_id, vector_store_id, tenant)
    return await asyncio.to_thread(file_search.vector_store_file_page, services.file_search, tenant, vector_store_id,
                                   limit, order, after, status, batch)


# ---- search ---------------------------------------------------------------------------------------------------


@router.post("/{vector_store_id}/search", response_model=SearchResultsPage, responses=ERRORS,
             summary="The vector store's chunks best matching a query, filtered by attributes")
async def search(vector_store_id: str, body: VectorStoreSearch, services: ServicesDep,
                 tenant: TenantDep) -> SearchResultsPage:
    return await asyncio.to_thread(file_search.search, services.file_search, tenant, vector_store_id, body)
