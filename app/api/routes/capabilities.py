"""``GET /v1/capabilities``: what this server answers, so a client offers only that. The page reads it to
hide the decoding modes this process cannot serve (they answer 400 ``not_available_yet``) and to bound its
inputs by the server's limits."""

from __future__ import annotations

from typing import get_args

from fastapi import APIRouter
from pydantic import BaseModel, Field

from app.api.deps import ServicesDep, TenantDep
from app.errors import NotAvailableYet
from app.openai_schemas import FILE_PURPOSES, INCLUDABLE, MAX_FILE_IDS, MAX_SEARCH_RESULTS
from app.schemas import (
    MAX_COLLECTION_DESCRIPTION_CHARS,
    MAX_COLLECTION_NAME_CHARS,
    MAX_DOCUMENTS_PER_ADD,
    MAX_FILES_PER_UPLOAD,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE_CHARS,
    PAGE_SIZE_DEFAULT,
    PAGE_SIZE_MAX,
    AskMode,
    CollectionLimits,
)
from retrieval import filters

router = APIRouter(tags=["ask"])


class ModeInfo(BaseModel):
    name: str
    available: bool
    reason: str | None = Field(None, description="Why not, when not available (the error /v1/ask would give)")


class ModelInfo(BaseModel):
    name: str = Field(description="The target model (a GGUF file's name, a model dir or hub id, or 'bundled')")
    runtime: str = Field(description="The runtime and its weights, e.g. cpu-quantized:gguf:Q4_K+Q5_0+Q6_K+Q8_0/"
                         "kv-bfloat16: the GGUF weight formats held, each read as stored")
    weight_mb: float = Field(description="Megabytes of weights served")
    context_window: int = Field(description="Tokens the target reads at once")


class FileSearchInfo(BaseModel):
    """OpenAI's file search as ragspec serves it (docs/api.md#openai-file-search)."""

    endpoints: list[str] = ["/v1/files", "/v1/vector_stores", "/v1/responses"]
    purposes: list[str] = Field(description="File purposes taken")
    tools: list[str] = Field(description="Responses tools run (any other is a 400)")
    include: list[str] = Field(description="Responses include values taken")
    max_file_ids: int = Field(description="Files in one vector store creation or file batch")
    max_search_results: int
    max_chunk_size_tokens: int = Field(description="How every document is chunked: the one static strategy taken")
    chunk_overlap_tokens: int


class Capabilities(BaseModel):
    model: ModelInfo = Field(description="The target model this server answers with")
    modes: list[ModeInfo] = Field(description="Every mode /v1/ask takes, in its order")
    max_new_tokens: int = Field(description="The largest max_tokens a request may ask for")
    default_max_tokens: int = Field(description="max_tokens when a request gives none")
    max_question_chars: int
    max_document_ids: int
    max_upload_bytes: int
    collections: CollectionLimits = Field(description="Collections, document attributes and their filters")
    file_search: FileSearchInfo


COLLECTION_LIMITS = CollectionLimits(
    max_attributes=filters.MAX_ATTRIBUTES,
    max_attribute_key_chars=filters.MAX_KEY_CHARS,
    max_attribute_string_chars=filters.MAX_STRING_CHARS,
    filter_operators=[*filters.COMPARISONS, *filters.COMPOUNDS],
    max_filter_depth=filters.MAX_FILTER_DEPTH,
    max_filter_terms=filters.MAX_FILTER_TERMS,
    max_in_values=filters.MAX_IN_VALUES,
    page_size_default=PAGE_SIZE_DEFAULT,
    page_size_max=PAGE_SIZE_MAX,
    max_name_chars=MAX_COLLECTION_NAME_CHARS,
    max_description_chars=MAX_COLLECTION_DESCRIPTION_CHARS,
    max_metadata_keys=MAX_METADATA_KEYS,
    max_metadata_key_chars=MAX_METADATA_KEY_CHARS,
    max_metadata_value_chars=MAX_METADATA_VALUE_CHARS,
    max_documents_per_add=MAX_DOCUMENTS_PER_ADD,
    max_files_per_upload=MAX_FILES_PER_UPLOAD,
)


@router.get("/v1/capabilities", response_model=Capabilities)
async def capabilities(services: ServicesDep, tenant: TenantDep) -> Capabilities:
    """Each mode is tried as a request would be (its drafters built for the caller, then dropped), so
    "available" is what /v1/ask would do, not a guess."""
    modes = []
    for mode in get_args(AskMode):
        try:
            services.drafters.for_mode(mode, tenant)
        except NotAvailableYet as exc:
            modes.append(ModeInfo(name=mode, available=False, reason=exc.message))
        else:
            modes.append(ModeInfo(name=mode, available=True, reason=None))
    limits, target = services.config.limits, services.target
    return Capabilities(
        model=ModelInfo(name=target.name, runtime=target.runtime, weight_mb=round(target.weight_bytes / 1e6, 1),
                        context_window=target.max_context),
        modes=modes,
        max_new_tokens=limits.max_new_tokens,
        default_max_tokens=limits.default_max_tokens,
        max_question_chars=limits.max_question_chars,
        max_document_ids=limits.max_document_ids,
        max_upload_bytes=limits.max_upload_bytes,
        collections=COLLECTION_LIMITS,
        file_search=FileSearchInfo(
            purposes=list(FILE_PURPOSES), tools=["file_search"], include=list(INCLUDABLE), max_file_ids=MAX_FILE_IDS,
            max_search_results=MAX_SEARCH_RESULTS, max_chunk_size_tokens=services.indexing.config.chunk_tokens,
            chunk_overlap_tokens=services.indexing.config.chunk_overlap),
    )
