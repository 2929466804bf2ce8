"""Collections: a tenant's named sets of documents. Create, list (cursor pages), read with counts, rename / describe,
delete (its documents kept unless asked); add existing documents, remove one, list its documents with their status
and attributes. Uploading into a collection is ``POST /v1/documents`` with ``collection_id``.

Another tenant's collection is not found (404), never shown. The work is ``app.serving.catalogue``'s; a delete or a
removal also drops what the service holds for the collection (``services.forget_collection``) and, for documents
deleted with it, for each document (``services.forget_document``); a change of its members brings its search index
in step in the background (``services.collection_changed_soon``)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query, Response

from app.api.deps import ServicesDep, TenantDep
from app.api.openapi import ERRORS
from app.schemas import (
    PAGE_SIZE_DEFAULT,
    PAGE_SIZE_MAX,
    CollectionDocumentPage,
    CollectionDocumentsIn,
    CollectionIn,
    CollectionOut,
    CollectionPage,
    CollectionPatch,
)
from app.serving import catalogue

router = APIRouter(prefix="/v1/collections", tags=["collections"])

Limit = Annotated[int, Query(ge=1, le=PAGE_SIZE_MAX, description="Page size")]
After = Annotated[str | None, Query(max_length=128, description="The last_id of the previous page")]


@router.post("", status_code=201, response_model=CollectionOut, responses=ERRORS, summary="Create a collection")
async def create_collection(body: CollectionIn, services: ServicesDep, tenant: TenantDep) -> CollectionOut:
    return await asyncio.to_thread(catalogue.create_collection, services.store, tenant, body.name, body.description,
                                   body.metadata)


@router.get("", response_model=CollectionPage, responses=ERRORS, summary="Your collections, oldest first")
async def list_collections(services: ServicesDep, tenant: TenantDep, limit: Limit = PAGE_SIZE_DEFAULT,
                           after: After = None) -> CollectionPage:
    return await asyncio.to_thread(catalogue.collection_page, services.store, tenant, limit, after)


@router.get("/{collection_id}", response_model=CollectionOut, responses=ERRORS,
            summary="A collection with its documents' counts by status")
async def get_collection(collection_id: str, services: ServicesDep, tenant: TenantDep) -> CollectionOut:
    return await asyncio.to_thread(catalogue.collection, services.store, tenant, collection_id)


@router.patch("/{collection_id}", response_model=CollectionOut, responses=ERRORS,
              summary="Rename a collection, or set its description or metadata")
async def update_collection(collection_id: str, body: CollectionPatch, services: ServicesDep,
                            tenant: TenantDep) -> CollectionOut:
    fields = body.model_dump(exclude_unset=True)
    return await asyncio.to_thread(catalogue.update_collection, services.store, tenant, collection_id, **fields)


@router.delete("/{collection_id}", status_code=204, responses=ERRORS,
               summary="Delete a collection (its documents stay unless delete_documents)")
async def delete_collection(
    collection_id: str, services: ServicesDep, tenant: TenantDep,
    delete_documents: Annotated[bool, Query(description="Also delete the collection's documents (those in other "
                                            "collections too)")] = False,
) -> Response:
    deleted = await asyncio.to_thread(catalogue.delete_collection, services.store, tenant, collection_id,
                                      delete_documents=delete_documents)
    for doc_id in deleted:
        services.forget_document(doc_id)
    await asyncio.to_thread(services.forget_collection, collection_id)
    return Response(status_code=204)


@router.post("/{collection_id}/documents", response_model=CollectionOut, responses=ERRORS,
             summary="Add existing documents (an unknown one: 404, none added)")
async def add_documents(collection_id: str, body: CollectionDocumentsIn, services: ServicesDep,
                        tenant: TenantDep) -> CollectionOut:
    out = await asyncio.to_thread(catalogue.add_documents, services.store, tenant, collection_id, body.document_ids)
    services.collection_changed_soon(collection_id)
    return out


@router.get("/{collection_id}/documents", response_model=CollectionDocumentPage, responses=ERRORS,
            summary="A collection's documents, oldest first, with their status, progress and attributes")
async def list_documents(collection_id: str, services: ServicesDep, tenant: TenantDep,
                         limit: Limit = PAGE_SIZE_DEFAULT, after: After = None) -> CollectionDocumentPage:
    return await asyncio.to_thread(catalogue.document_page, services.store, tenant, collection_id, limit, after)


@router.delete("/{collection_id}/documents/{document_id}", status_code=204, responses=ERRORS,
               summary="Take a document out of a collection (the document stays)")
async def remove_document(collection_id: str, document_id: str, services: ServicesDep,
                          tenant: TenantDep) -> Response:
    await asyncio.to_thread(catalogue.remove_document, services.store, tenant, collection_id, document_id)
    services.collection_changed_soon(collection_id)
    return Response(status_code=204)
