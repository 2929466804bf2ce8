"""OpenAI's shapes for its file search surface (Files, Vector Stores, their files and file batches, search): the
request bodies ragspec takes (unknown fields refused by name) and the objects it answers, field for field as the
official client reads them. A file is a ragspec document, a vector store a collection (their ids are ragspec's)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.schemas import MAX_COLLECTION_NAME_CHARS, METADATA_DOC, AttributeValue, _checked_metadata

MAX_FILE_IDS = 500  # file ids in one vector store creation or file batch (OpenAI's bound)
MAX_SEARCH_RESULTS = 50
LIST_LIMIT_MAX = 100
FILES_LIMIT_MAX = 10_000
FILE_PURPOSES = ("assistants", "user_data")


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    anchor: Literal["last_active_at"]
    days: int = Field(ge=1, le=365)


class VectorStoreCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(None, max_length=MAX_COLLECTION_NAME_CHARS)
    description: str | None = Field(None, max_length=2048)
    file_ids: list[str] = Field(default_factory=list, max_length=MAX_FILE_IDS)
    metadata: dict[str, str] | None = Field(None, description=METADATA_DOC)
    chunking_strategy: dict[str, Any] | None = None
    expires_after: ExpiresAfter | None = None

    _metadata = field_validator("metadata")(_checked_metadata)


class VectorStoreUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(None, max_length=MAX_COLLECTION_NAME_CHARS)
    metadata: dict[str, str] | None = Field(None, description=METADATA_DOC)
    expires_after: ExpiresAfter | None = None

    _metadata = field_validator("metadata")(_checked_metadata)


class VectorStoreFileCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file_id: str = Field(min_length=1, max_length=128)
    attributes: dict[str, Any] | None = None
    chunking_strategy: dict[str, Any] | None = None


class VectorStoreFileUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    attributes: dict[str, Any] | None


class FileBatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file_ids: list[str] = Field(min_length=1, max_length=MAX_FILE_IDS)
    attributes: dict[str, Any] | None = None
    chunking_strategy: dict[str, Any] | None = None


class RankingOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ranker: Literal["auto", "default-2024-11-15", "none"] | None = None
    score_threshold: float | None = Field(None, ge=0.0, le=1.0)


class VectorStoreSearch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str | list[str]
    filters: dict[str, Any] | None = None
    max_num_results: int = Field(10, ge=1, le=MAX_SEARCH_RESULTS)
    ranking_options: RankingOptions | None = None
    rewrite_query: bool = False


# ---- answers --------------------------------------------------------------------------------------------------


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"]
    status_details: str | None = None
    expires_at: int | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class FileCounts(BaseModel):
    in_progress: int
    completed: int
    failed: int
    cancelled: int
    total: int


class VectorStoreObject(BaseModel):
    id: str
    object: Literal["vector_store"] = "vector_store"
    created_at: int
    name: str
    description: str | None = None
    usage_bytes: int
    file_counts: FileCounts
    status: Literal["expired", "in_progress", "completed"]
    expires_after: ExpiresAfter | None = None
    expires_at: int | None = None
    last_active_at: int | None = None
    metadata: dict[str, str]


class VectorStoreDeleted(BaseModel):
    id: str
    object: Literal["vector_store.deleted"] = "vector_store.deleted"
    deleted: bool = True


class LastError(BaseModel):
    code: Literal["server_error", "unsupported_file", "invalid_file"]
    message: str


class StaticChunking(BaseModel):
    max_chunk_size_tokens: int
    chunk_overlap_tokens: int


class ChunkingStrategy(BaseModel):
    type: Literal["static"] = "static"
    static: StaticChunking


class VectorStoreFileObject(BaseModel):
    id: str
    object: Literal["vector_store.file"] = "vector_store.file"
    created_at: int
    vector_store_id: str
    usage_bytes: int
    status: Literal["in_progress", "completed", "cancelled", "failed"]
    last_error: LastError | None = None
    attributes: dict[str, AttributeValue] = Field(default_factory=dict)
    chunking_strategy: ChunkingStrategy


class VectorStoreFileDeleted(BaseModel):
    id: str
    object: Literal["vector_store.file.deleted"] = "vector_store.file.deleted"
    deleted: bool = True


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class FileContentPage(BaseModel):
    object: Literal["vector_store.file_content.page"] = "vector_store.file_content.page"
    data: list[TextContent]
    has_more: bool = False
    next_page: str | None = None


class FileBatchObject(BaseModel):
    id: str
    object: Literal["vector_store.files_batch"] = "vector_store.files_batch"
    created_at: int
    vector_store_id: str
    status: Literal["in_progress", "completed", "cancelled", "failed"]
    file_counts: FileCounts


class SearchResult(BaseModel):
    file_id: str
    filename: str
    score: float
    attributes: dict[str, AttributeValue] = Field(default_factory=dict)
    content: list[TextContent]


class SearchResultsPage(BaseModel):
    object: Literal["vector_store.search_results.page"] = "vector_store.search_results.page"
    search_query: list[str]
    data: list[SearchResult]
    has_more: bool = False
    next_page: str | None = None


class ListPage(BaseModel):
    """OpenAI's cursor list: ``first_id`` / ``last_id`` of ``data``, ``has_more`` when a next page exists."""

    object: Literal["list"] = "list"
    data: list[Any]
    first_id: str | None
    last_id: str | None
    has_more: bool


# ---- Responses ------------------------------------------------------------------------------------------------

INCLUDABLE = ("file_search_call.results",)


class InputMessage(BaseModel):
    """A message of ``input``: ``content`` a string or text parts (``input_text`` / ``output_text``)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class ResponseCreate(BaseModel):
    """``POST /v1/responses``: what ragspec answers (anything else is refused by name)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    previous_response_id: str | None = Field(None, max_length=128)
    store: bool = True
    metadata: dict[str, str] | None = Field(None, description=METADATA_DOC)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Literal["auto", "none", "required"] | None = None
    parallel_tool_calls: bool | None = None
    include: list[str] = Field(default_factory=list)
    text: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = Field(None, max_length=256)

    _metadata = field_validator("metadata")(_checked_metadata)


class FileSearchTool(BaseModel):
    """The one tool ragspec runs: a search of vector stores, its results the answer's context."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["file_search"]
    vector_store_ids: list[str] = Field(min_length=1, max_length=16)
    max_num_results: int | None = Field(None, ge=1, le=MAX_SEARCH_RESULTS)
    filters: dict[str, Any] | None = None
    ranking_options: RankingOptions | None = None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
