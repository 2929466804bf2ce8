"""Request and response bodies, one class per direction. Limits that depend on settings (question length,
number of documents, max_tokens ceiling) are checked in the routes against ``RequestLimits``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DocumentStatus = Literal["queued", "indexing", "ready", "failed"]
AskMode = Literal["auto", "autoregressive", "racer", "rapid", "rapid_kv", "combined", "suffix", "prompt_lookup"]
RAG_MODES = ("rapid", "rapid_kv", "combined")  # modes with the RAG drafter (eta applies to its drafts)

ID_PATTERN = r"^[A-Za-z0-9_.:\-]{1,128}$"


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ---- documents ------------------------------------------------------------------------------------


MAX_TITLE_CHARS = 512


class DocumentTitleIn(BaseModel):
    """A client's title, JSON or multipart: one rule for both (422 when too long, never cut)."""

    model_config = ConfigDict(extra="forbid")
    title: str | None = Field(None, max_length=MAX_TITLE_CHARS)


MAX_FILES_PER_UPLOAD = 64  # files in one multipart upload (each within RAGSPEC_MAX_UPLOAD_MB)
AttributeValue = bool | int | float | str  # a document attribute's value as the API gives it back

ATTRIBUTES_DOC = (
    "Document attributes: a JSON object of at most 16 keys (1-64 characters each), each value a string (at most 512 "
    "characters), a finite number or a boolean; what collection filters compare"
)


class DocumentUploadFields(DocumentTitleIn):
    """The fields an upload takes beside its content, JSON or multipart (one rule for both)."""

    collection_id: str | None = Field(None, max_length=128, description="Put the document in this collection "
                                      "(one of yours: another's or an unknown one is a 404, and nothing is stored)")
    attributes: dict[str, Any] | None = Field(None, description=ATTRIBUTES_DOC + " (in a multipart upload: the "
                                              "object as a JSON string, or a list of one object per file)")


class DocumentTextIn(DocumentUploadFields):
    """JSON upload: plain text with an optional title, collection and attributes."""

    text: str = Field(min_length=1, description="Document text (plain text or Markdown)")


class DocumentAccepted(BaseModel):
    id: str
    title: str
    status: DocumentStatus
    progress: float = Field(ge=0, le=1)
    collection_ids: list[str] = Field(default_factory=list, description="The collections the document is in")
    attributes: dict[str, AttributeValue] = Field(default_factory=dict, description="The document's attributes")


class DocumentsAccepted(BaseModel):
    """A multipart upload of more than one file: each file's document, in the order of the files."""

    documents: list[DocumentAccepted]


class DocumentPatch(BaseModel):
    """``PATCH /v1/documents/{id}``: the document's attributes, replaced whole (``{}`` removes them all)."""

    model_config = ConfigDict(extra="forbid")
    attributes: dict[str, Any] = Field(description=ATTRIBUTES_DOC)


class DocumentOut(DocumentAccepted):
    message: str | None = None
    media_type: str | None = None
    size_bytes: int | None = None
    chunks: int | None = None
    tokens: int | None = Field(None, description="The text's length in target tokens (once indexed)")
    created_at: float | None = None


class DocumentList(BaseModel):
    documents: list[DocumentOut]


# ---- sampling controls and log-probabilities (both APIs) -------------------------------------------

MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20


class LogitControls(BaseModel):
    """The sampling and logit-shaping fields both APIs take: OpenAI's names and semantics, and vLLM's for
    ``repetition_penalty``, ``top_k`` and ``min_p``. Each applies inside speculative decoding exactly as in
    plain decoding (every verified draft row is shaped with its own path's counts)."""

    top_k: int = Field(0, ge=-1, description="Sample among the k most likely tokens only; 0 or -1: off")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens less likely than min_p times the most "
                         "likely one (after temperature and top_k); 0: off")
    frequency_penalty: float | None = Field(
        None, ge=-2.0, le=2.0, description="Subtracted from a token's logit once per time it occurs in the answer "
        "so far (the prompt does not count); null: the server's default (RAGSPEC_DEFAULT_FREQUENCY_PENALTY)")
    presence_penalty: float | None = Field(
        None, ge=-2.0, le=2.0, description="Subtracted from the logit of every token the answer already holds; "
        "null: the server's default (RAGSPEC_DEFAULT_PRESENCE_PENALTY)")
    repetition_penalty: float | None = Field(
        None, gt=0.0, le=10.0, description="Multiplicative (HF / vLLM): the logit of a token present in the prompt "
        "(the document included) or the answer is divided by it when positive, multiplied when negative; 1: off; "
        "null: the server's default (RAGSPEC_DEFAULT_REPETITION_PENALTY)")
    logit_bias: dict[str, float] | None = Field(
        None, description=f"Token id (a string, as OpenAI's) -> bias in [-100, 100] added to its logit (at most "
        f"{MAX_LOGIT_BIAS} entries); -100 bans a token, 100 forces it")
    logprobs: bool | None = Field(None, description="Return each answer token's log-probability (of the logits "
                                  "after logit_bias and the penalties, before temperature and truncation)")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="With logprobs: also the most likely tokens at each position")

    @field_validator("logit_bias")
    @classmethod
    def _bias_entries(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is None:
            return None
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        for key, value in bias.items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"keys are token ids (non-negative integers as strings), got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"token {key}: a bias must lie in [-100, 100], got {value}")
        return bias

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> LogitControls:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class TopLogprob(BaseModel):
    token: str = Field(description="The token's text (a token that ends inside a UTF-8 character shows U+FFFD)")
    logprob: float
    bytes: list[int] = Field(description="The token's bytes (join a character split across tokens from these)")


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="The most likely tokens at this position, best first")


# ---- ask ------------------------------------------------------------------------------------------


class AskRequest(LogitControls):
    model_config = ConfigDict(extra="forbid")
    question: str = Field(min_length=1)
    document_ids: list[str] = Field(
        default_factory=list,
        description="The documents to ask about; may be left out on a follow-up (a session_id whose "
        "conversation asked about documents): the conversation's last documents are used",
    )
    collection_ids: list[str] = Field(
        default_factory=list,
        description="Collections to ask, beside or instead of document_ids: the question is answered from every "
        "ready document of theirs that matches `filter`",
    )
    filter: dict[str, Any] | None = Field(
        None, description="An attribute filter over the collections' documents (OpenAI's vector-store filter shape): "
        '{"type": "eq"|"ne"|"gt"|"gte"|"lt"|"lte"|"in"|"nin", "key", "value"} or {"type": "and"|"or", "filters": '
        "[...]}, nested")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    session_id: str | None = Field(None, pattern=ID_PATTERN)
    mode: AskMode = "auto"
    eta: float = Field(
        0.0, ge=0.0, le=50.0,
        description="RAPID knowledge transfer, NOT lossless: > 0 lets the RAG drafter's distribution shift the "
        "target's, so the answer no longer follows the target's distribution (docs/benchmarks.md, RAPID's knowledge "
        "transfer). Needs temperature > 0, no seed, and a mode with the RAG drafter (rapid, rapid_kv, combined).",
    )

    @model_validator(mode="after")
    def _eta_needs_rag_sampling(self) -> AskRequest:
        if self.eta > 0 and (self.temperature <= 0 or self.seed is not None or self.mode not in RAG_MODES):
            raise ValueError(
                "eta (knowledge transfer) needs temperature > 0, no seed, and mode rapid, rapid_kv or combined"
            )
        return self


class Source(BaseModel):
    """A retrieved chunk. Sources come best first."""

    document_id: str
    title: str | None = Field(None, description="The document's title")
    attributes: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="The document's attributes (set at upload or with PATCH /v1/documents/{id})")
    chunk_id: str
    text: str
    score: float = Field(description="Relevance that ranks the sources: (1 - w) x similarity + w x the chunk's BM25 "
                         "score as a share of the most any chunk could score for the question (w: "
                         "RAGSPEC_RETRIEVAL_LEXICAL_WEIGHT; 0 with dense scoring)")
    similarity: float = Field(description="Cosine similarity between the question and the chunk's best-matching "
                              "window of ~60 words; the retrieval threshold applies to it")
    start: int
    end: int
    page: int | None = Field(None, description="PDFs: the page of the chunk's first character")
    page_end: int | None = Field(
        None, description="PDFs: the page of the chunk's last character (= page when the chunk is on one page; "
        "null for a PDF indexed before page ranges were recorded: `ragspec reindex` fills it)"
    )
    highlights: list[tuple[int, int]] = Field(
        default_factory=list,
        description="Spans [start, end) of `text` (character offsets) that support the answer: the sentences of "
        "this source that answer sentences citing it match best, whole words only; empty when no sentence of the "
        "answer cites this source (and in the stream's first `sources` event: see the `citations` event)",
    )


class Citation(BaseModel):
    """One sentence of the answer and the source that supports it (attributed after generation)."""

    start: int = Field(description="Character offset of the sentence in the answer")
    end: int = Field(description="End (exclusive) of the sentence in the answer")
    source: int = Field(ge=0, description="Index of the supporting source in `sources` (0-based; its marker is "
                        "[source + 1])")
    support: float = Field(ge=0, le=1, description="Share of the sentence's content words (weighted by how "
                           "distinctive they are among the sources) that the source's text holds")


class Citations(BaseModel):
    """What attribution adds to an answer: the ``citations`` event of the ``/v1/ask`` stream, and the same fields
    of the JSON answer."""

    citations: list[Citation]
    cited_answer: str = Field(description="The answer with an [n] marker after each cited sentence (n: the "
                              "source's 1-based position in `sources`); `answer` stays the model's text")
    highlights: list[list[tuple[int, int]]] = Field(
        description="Per source, in the order of `sources`: its `highlights`"
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class AskStats(BaseModel):
    documents: int = Field(0, description="Documents the question was asked over: the named ones and the ready "
                           "documents of its collections that match its filter")
    documents_pending: int = Field(0, description="Documents of its collections matching its filter that were still "
                                   "queued or indexing (not read)")
    context: Literal["documents", "chunks"] = Field(
        "documents", description="What the target read: the documents whole, or (past its window) their best chunks")
    ttft_ms: float
    tokens_per_second: float
    acceptance_length: float
    drafted: int
    drafted_by_source: dict[str, int]
    accepted_by_source: dict[str, int]
    drafting_ms: dict[str, float] = Field(
        default_factory=dict, description="Wall time each drafter spent proposing (its own prefill and forwards "
        "included), charged against what its drafts saved")
    prefix_cache_hit: bool
    prefix_reused_tokens: int = Field(
        0, description="Prompt tokens whose KV came from the prefix cache (a document, or retrieved chunks "
        "that an earlier question's prompt also began with)"
    )
    context_truncated: bool
    finish_reason: str
    mode: str


class AskResponse(BaseModel):
    answer: str = Field(description="The model's text, exactly as generated")
    cited_answer: str = Field("", description="The answer with [n] markers after the sentences that cite source n")
    citations: list[Citation] = Field(default_factory=list)
    session_id: str
    sources: list[Source]
    usage: Usage
    stats: AskStats
    logprobs: list[TokenLogprobOut] | None = Field(None, description="One per answer token, with `logprobs: true`")


# ---- OpenAI-compatible ----------------------------------------------------------------------------


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = Field(False, description="A last chunk (no choices) with the usage; the others' usage null")


class ChatCompletionRequest(LogitControls):
    """OpenAI's fields that ragspec implements, plus ``document_ids`` (and vLLM's ``repetition_penalty``,
    ``top_k``, ``min_p``); any other field is refused with a 400 naming it, never ignored."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256, description="An end user's id (OpenAI's): logged, nothing else")
    document_ids: list[str] = Field(default_factory=list)
    collection_ids: list[str] = Field(default_factory=list, description="Collections to ask (as /v1/ask's)")
    filter: dict[str, Any] | None = Field(None, description="An attribute filter over the collections' documents "
                                          "(as /v1/ask's)")

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> ChatCompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    reasoning_content: str | None = Field(
        None, description="A reasoning model's reasoning before its answer (gpt-oss's analysis channel), never part "
        "of content; null for a model that writes none apart"
    )


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatChoiceMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class ChatUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage
    sources: list[Source]
    citations: list[Citation] = Field(
        default_factory=list, description="Sentences of the message's content and their sources (the content "
        "itself is the model's text, without markers)"
    )
    stats: AskStats


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ragspec"
    max_context: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- health ---------------------------------------------------------------------------------------


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ready", "degraded", "unavailable"]
    checks: dict[str, str]


# ---- collections ----------------------------------------------------------------------------------

MAX_COLLECTION_NAME_CHARS = 256
MAX_COLLECTION_DESCRIPTION_CHARS = 2048
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
PAGE_SIZE_DEFAULT = 20
PAGE_SIZE_MAX = 100
MAX_DOCUMENTS_PER_ADD = 1000  # document ids in one POST /v1/collections/{id}/documents


def _checked_name(name: str | None) -> str | None:
    if name is not None and not name.strip():
        raise ValueError("a collection's name must not be blank")
    return name


def _checked_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    if len(metadata) > MAX_METADATA_KEYS:
        raise ValueError(f"at most {MAX_METADATA_KEYS} keys, got {len(metadata)}")
    for key, value in metadata.items():
        if not 1 <= len(key) <= MAX_METADATA_KEY_CHARS:
            raise ValueError(f"a key must be 1-{MAX_METADATA_KEY_CHARS} characters, got {key[:80]!r}")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"{key}: {len(value)} characters, at most {MAX_METADATA_VALUE_CHARS} allowed")
    return metadata


METADATA_DOC = (f"Your own labels: at most {MAX_METADATA_KEYS} keys of 1-{MAX_METADATA_KEY_CHARS} characters, string "
                f"values of at most {MAX_METADATA_VALUE_CHARS} characters")


class CollectionIn(BaseModel):
    """``POST /v1/collections``."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=MAX_COLLECTION_NAME_CHARS)
    description: str | None = Field(None, max_length=MAX_COLLECTION_DESCRIPTION_CHARS)
    metadata: dict[str, str] | None = Field(None, description=METADATA_DOC)

    _name = field_validator("name")(_checked_name)
    _metadata = field_validator("metadata")(_checked_metadata)


class CollectionPatch(BaseModel):
    """``PATCH /v1/collections/{id}``: the fields given are set (a null description or metadata clears it), the
    others kept."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(None, min_length=1, max_length=MAX_COLLECTION_NAME_CHARS)
    description: str | None = Field(None, max_length=MAX_COLLECTION_DESCRIPTION_CHARS)
    metadata: dict[str, str] | None = Field(None, description=METADATA_DOC)

    _name = field_validator("name")(_checked_name)
    _metadata = field_validator("metadata")(_checked_metadata)

    @model_validator(mode="after")
    def _name_not_null(self) -> CollectionPatch:
        if "name" in self.model_fields_set and self.name is None:
            raise ValueError("name: a collection keeps a name (give a new one, or leave the field out)")
        return self


class DocumentCounts(BaseModel):
    """A collection's documents by status."""

    queued: int
    indexing: int
    ready: int
    failed: int
    total: int


class CollectionOut(BaseModel):
    id: str
    name: str
    description: str | None
    metadata: dict[str, str]
    created_at: float
    document_counts: DocumentCounts
    chunks: int = Field(description="Chunks of its indexed documents")
    tokens: int = Field(description="Target tokens of its indexed documents")
    bytes: int = Field(description="Bytes of its documents as uploaded")


class CollectionPage(BaseModel):
    """A page of collections, oldest first: the next page is ``?after=<last_id>`` while ``has_more``."""

    data: list[CollectionOut]
    has_more: bool
    last_id: str | None


class CollectionDocumentsIn(BaseModel):
    """``POST /v1/collections/{id}/documents``: existing documents of yours to add (those in it already stay)."""

    model_config = ConfigDict(extra="forbid")
    document_ids: list[str] = Field(min_length=1, max_length=MAX_DOCUMENTS_PER_ADD)


class CollectionDocumentPage(BaseModel):
    """A page of a collection's documents, oldest first, each with its status and progress (follow indexing here):
    the next page is ``?after=<last_id>`` while ``has_more``."""

    data: list[DocumentOut]
    has_more: bool
    last_id: str | None


class CollectionLimits(BaseModel):
    """The bounds of collections and attributes (``/v1/capabilities``)."""

    max_attributes: int = Field(description="Attributes per document")
    max_attribute_key_chars: int
    max_attribute_string_chars: int
    filter_operators: list[str] = Field(description="The attribute filters' operators (comparisons, then and / or)")
    max_filter_depth: int
    max_filter_terms: int = Field(description="Comparisons in one filter")
    max_in_values: int = Field(description="Values of one in / nin comparison")
    page_size_default: int
    page_size_max: int
    max_name_chars: int
    max_description_chars: int
    max_metadata_keys: int
    max_metadata_key_chars: int
    max_metadata_value_chars: int
    max_documents_per_add: int
    max_files_per_upload: int
