"""Service settings: one pydantic-settings class, environment prefix ``RAGSPEC_``, composed of one model per
concern (paths, the HTTP edge, the store, the cluster, sessions, models, kernels, retrieval, requests, drafting,
scheduling, the KV cache).

Every setting stays a top-level field of ``Settings``: its variable is ``RAGSPEC_<FIELD>`` whichever concern holds
it, and ``Settings(chunk_tokens=...)`` and ``settings.chunk_tokens`` read as before. A function that needs one
concern takes that model (``open_retriever(settings: RetrievalSettings, ...)``), so its signature says what it reads.
Only the wiring modules read this object (``tests/test_libraries.py``); the rest of the service gets the frozen
configs ``app.config`` builds from it, the libraries plain values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from decoding.errors import ModelLoadError
from decoding.runtime.bundled import BUNDLED  # the one definition of the bundled model names
from decoding.runtime.rope import check_rope_scaling

ROPE_SCALING_FORM = ('must be a JSON object like {"rope_type": "yarn", "factor": 4.0, '
                     '"original_max_position_embeddings": 32768}')


def byte_count_or_auto(value: object) -> object:
    """An integer byte count or ``auto`` (any case), in one line rather than the union's two errors."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError("must be a byte count (integer) or auto")


class PathSettings(BaseModel):
    """Where the service keeps what it stores: the data dir, and the models and documents dirs, under it unless set
    elsewhere. The data dir comes first: the other two are derived from the one given with them."""

    data_dir: Path = Field(Path("data"), description="Documents, indexes, KV cache and converted models")
    models_dir: Path = Field(  # None -> <data_dir>/models (the validator below; the image sets one outside /data)
        None, validate_default=True, description="Bundled and converted models (default: <data_dir>/models)"
    )
    documents_dir: Path = Field(  # None -> <data_dir>/documents (the validator below)
        None, validate_default=True, description="Uploaded documents and their indexes (default: "
        "<data_dir>/documents); in cluster mode a path every replica reads (a shared volume)"
    )

    @field_validator("documents_dir", mode="before")
    @classmethod
    def _documents_under_data(cls, value: object, info: ValidationInfo) -> object:
        if value is None or value == "":
            return Path(info.data.get("data_dir", "data")) / "documents"
        return value

    @field_validator("models_dir", mode="before")
    @classmethod
    def _models_under_data(cls, value: object, info: ValidationInfo) -> object:
        if value is None or value == "":
            return Path(info.data.get("data_dir", "data")) / "models"
        return value


class ServerSettings(BaseModel):
    """The HTTP service at its edge: where it listens and logs, who may call it (keys, the metrics scraper, the
    proxies it believes), the keep-alives of its streams and when it calls itself ready."""

    host: str = Field("127.0.0.1", description="Bind address of `ragspec serve`")
    port: int = Field(8000, ge=1, le=65535, description="Port of `ragspec serve`")
    log_level: str = Field("INFO", description="Python logging level")
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Comma-separated Bearer keys; each key is a tenant. Empty: no auth"
    )
    metrics_token: str | None = Field(
        None, description="Bearer token of a metrics scraper: /metrics shows every tenant's series to it (API "
        "keys see only their own tenant's)"
    )
    trusted_proxies: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Comma-separated addresses whose X-Forwarded-For / -Proto `ragspec "
        "serve` honours (* for any). Empty: forwarded headers are ignored"
    )
    sse_ping_s: float = Field(
        15.0, gt=0, le=300, description="Seconds between SSE keep-alive comments (`: ping`) on answer streams, "
        "from the moment a request is accepted: a proxy's read timeout never sees a silent stream"
    )
    min_free_disk_mb: float = Field(
        256.0, ge=0, description="Free space the data dir's disk needs for /readyz to answer ready (MB)"
    )

    @field_validator("api_keys", "trusted_proxies", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [k.strip() for k in value.split(",") if k.strip()]
        return value


class StoreSettings(BaseModel):
    """The documents' catalogue and how they are indexed: the database, whether other processes share it, the
    ingestion jobs' lease and the chunks."""

    database_url: str | None = Field(
        None, description="postgresql://user:password@host:port/db for the document catalogue (one that several "
        "replicas share; needs the `postgres` extra); unset: SQLite in the data dir"
    )
    shared_store: bool = Field(
        False, description="Other processes share the documents dir and catalogue (set for cluster replicas): "
        "start-up leaves their ingests alone, whose jobs' leases hand them over if their worker died"
    )
    ingest_lease_s: float = Field(
        30.0, gt=0, description="An ingestion job's lease: a worker that stops renewing it (died) loses the job to "
        "another after this long"
    )
    chunk_tokens: int = Field(512, ge=16, le=8192, description="Chunk size in target tokens")
    chunk_overlap: int = Field(0, ge=0, description="Chunk overlap in tokens")

    @model_validator(mode="after")
    def _overlap_fits(self) -> Self:
        if self.chunk_overlap > self.chunk_tokens // 2:
            raise ValueError(
                f"chunk_overlap ({self.chunk_overlap}) must be at most chunk_tokens // 2 ({self.chunk_tokens // 2})"
            )
        return self


class ClusterSettings(BaseModel):
    """``ragspec serve --cluster``: the engine replicas, how requests are routed among them, the Ray they run on."""

    cluster_replicas: int = Field(2, ge=1, description="Engine replicas of `ragspec serve --cluster`")
    cluster_load_factor: float = Field(
        1.5, gt=1.0, description="Cluster routing: a document's owner replica takes its requests until it holds this "
        "many times the mean load (why 1.5: docs/benchmarks.md#routing-replicas-by-document)"
    )
    ray_address: str | None = Field(
        None, description="`ragspec serve --cluster`: the Ray cluster to join (auto, or the head's host:port); "
        "unset: a local one on loopback, started and stopped with the command"
    )
    ray_temp_dir: Path | None = Field(
        None, description="`ragspec serve --cluster` with a local Ray: the directory of its files and sockets "
        "(default: Ray's, /tmp/ray)"
    )


class SessionSettings(BaseModel):
    """What outlives one request: sessions and RACER's cross-session drafts, in Redis or in the process."""

    redis_url: str | None = Field(
        None, description="redis://host:port/db for sessions and the cross-session draft cache; in-process when unset"
    )
    session_ttl_s: int = Field(24 * 3600, ge=60, description="Session history lifetime")
    session_sources: bool = Field(
        True, description="Keep each answer's sources in its session, so a resumed conversation shows them"
    )
    draft_cache_ttl_s: int = Field(7 * 24 * 3600, ge=60, description="Cross-session draft cache TTL")


class ModelSettings(BaseModel):
    """The target, the RAPID drafter's LM and the embedder, and how they are loaded: device, precision, threads,
    the target's window and rope scaling."""

    target_model: str = Field(
        BUNDLED, description="Target LLM: 'bundled' (SmolLM2-135M), a GGUF file (llama, qwen2, qwen3, gemma2, "
        "gemma3, phi3 architectures on the CPU), a local HF dir or hub id"
    )
    drafter_model: str = Field(
        "target", description="RAPID drafter LM: 'target' (the target's weights, its own KV cache) or a model "
        "with the target's vocabulary ('bundled', a GGUF file, a local HF dir): e.g. a 1B GGUF of the target's family"
    )
    embedding_model: str = Field(BUNDLED, description="'bundled' (all-MiniLM-L6-v2), a local dir or hub id")
    embedding_kind: Literal["auto", "bge-m3", "flag"] = Field(
        "auto", description="bge-m3 (BGEM3FlagModel) or flag (FlagModel, mean pooling); auto picks by name"
    )
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bf16 on GPU, fp32 on CPU"
    )
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: torch's choice)")
    cpu_quant: Literal["auto", "q8_0", "q4_1", "none"] = Field(
        "auto",
        description="CPU target weights: auto (a GGUF as stored, an HF model quantized to q8_0), q8_0, q4_1, "
        "or none (fp32 on transformers)",
    )
    kv_dtype: Literal["auto", "float16", "bfloat16", "float32", "int8"] = Field(
        "auto", description="KV cache storage of the quantized CPU runtime (auto: bfloat16 where its attention "
        "multiplies bf16 operands, the amx path's tiles and the avx512 path on a CPU with AVX-512 BF16; float16 "
        "elsewhere; int8: half the bytes per cached token, quantized per 32 values, which changes answers: opt-in)"
    )
    max_context: int | None = Field(
        None, ge=256, description="The target's context window in tokens (default: the model's own, capped on a CPU "
        "to what one generation's KV leaves room for in RAM): lower, or higher up to what its rope scaling supports "
        "(RAGSPEC_ROPE_SCALING); beyond it, or beyond the RAM, the service does not start"
    )
    rope_scaling: Annotated[dict[str, Any] | None, NoDecode] = Field(  # parsed by _rope_scaling_json
        None, description='JSON rope scaling applied to the target\'s config at load, e.g. {"rope_type": "yarn", '
        '"factor": 4.0, "original_max_position_embeddings": 32768}: linear, yarn or llama3; the window becomes '
        "factor x original positions"
    )
    thinking: bool = Field(
        False, description="A model with a thinking mode (Qwen3's enable_thinking in its chat template) writes its "
        "reasoning before answering; off by default: document questions are answered straight"
    )
    reasoning_effort: Literal["low", "medium", "high"] = Field(
        "low", description="How long a model with a reasoning-effort switch (gpt-oss's harmony template, its "
        "reasoning_effort) reasons before it answers: low, medium or high; low by default: document questions want "
        "short reasoning. Templates without the switch ignore it"
    )

    @field_validator("rope_scaling", mode="before")
    @classmethod
    def _rope_scaling_json(cls, value: object) -> object:
        """JSON text (the environment's) to a dict, with an example of the form when it is not one."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(ROPE_SCALING_FORM) from None
        if value is not None and not isinstance(value, dict):
            raise ValueError(ROPE_SCALING_FORM)
        return value

    @field_validator("rope_scaling")
    @classmethod
    def _rope_scaling_checked(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """The checks ``load_model`` runs on it (type, factor, original positions), here: a bad value stops the
        start before any model loads."""
        if value is not None:
            try:
                check_rope_scaling(value)
            except ModelLoadError as exc:
                raise ValueError(str(exc)) from None
        return value


class KernelSettings(BaseModel):
    """ragspec's CPU kernels: used at all, which ISA path, where they are built and with which compiler."""

    cpu_kernels: bool = Field(
        True, description="ragspec's CPU kernels (built with cc); 0: none, the CPU target runs fp32 on transformers"
    )
    cpu_isa: Literal["auto", "avx2", "avx512", "amx"] = Field(
        "auto", description="ISA path of the CPU kernels: auto (the best this CPU runs), avx2, avx512 (AVX-512 "
        "VNNI and 16-lane attention) or amx (linear layers of 8 rows and more on the AMX int8 tiles, attention on "
        "the bf16 tiles with a bf16 KV cache); every path gives the same results on the same KV storage except "
        "the bf16 tiles' attention (each path lossless in itself); a path the CPU lacks stops the start"
    )
    kernel_cache: Path | None = Field(
        None, description="Directory the CPU kernels are compiled into (default: ~/.cache/ragspec/kernels)"
    )
    kernel_compiler: str | None = Field(
        None, description="C compiler that builds the CPU kernels (default: cc, else gcc, on the PATH)"
    )


class RetrievalSettings(BaseModel):
    """How chunks are found and ranked for a question, and how much of a long document the target reads."""

    retrieval_threshold: float | None = Field(
        None, description="Similarity threshold: a chunk whose best window is less similar to the question is "
        "dropped (default 0.3 for BGE-M3, calibrated for the bundled embedder)"
    )
    retrieval_scoring: Literal["hybrid", "dense"] = Field(
        "hybrid", description="How chunks are ranked: hybrid (similarity and BM25, weighted) or dense (similarity)"
    )
    retrieval_lexical_weight: float | None = Field(
        None, ge=0.0, le=1.0, description="Weight of BM25 in a chunk's hybrid score (default: calibrated on the QA "
        "set, docs/benchmarks.md#retrieval)"
    )
    retrieval_budget_cap: int = Field(8192, ge=256, description="Cap on the RAG context budget max(L/24, 4096)")
    retrieval_top_k: int = Field(16, ge=1, le=256, description="Hits considered per question")
    retrieval_cache_bytes: int = Field(
        256 << 20, ge=0, description="Memory for documents' indexes and chunks kept loaded between questions (least "
        "recently asked dropped first); a collection question loads every candidate's document"
    )
    long_document_budget: int = Field(
        4096, ge=0, description="Tokens of documents longer than the target's window that it reads (the best "
        "chunks for the question); 0: as many as the window holds"
    )
    long_document_lead: int = Field(
        0, ge=0, description="Of those, tokens always taken from the documents' beginning (their KV is computed "
        "at upload and shared by every question)"
    )


class RequestSettings(BaseModel):
    """The bounds of one request (past them a 413 / 422) and what a request gets when it gives none."""

    max_upload_mb: float = Field(50.0, gt=0, description="Largest accepted upload (MB) -> 413 above")
    max_json_mb: float = Field(
        1.0, gt=0, description="Largest request body (MB) of every other route (ask, chat, ...) -> 413 above"
    )
    max_pdf_pages: int = Field(2000, ge=1, description="Most pages of an uploaded PDF -> 413 above (counted first)")
    max_question_chars: int = Field(4000, ge=1, description="Longest accepted question -> 422 above")
    max_document_ids: int = Field(16, ge=1, description="Most documents per question")
    max_collection_ids: int = Field(16, ge=1, description="Most collections per question")
    max_new_tokens: int = Field(1024, ge=1, description="Upper bound on max_tokens per answer")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when the request gives none")
    default_frequency_penalty: float = Field(
        1.0, ge=-2.0, le=2.0, description="frequency_penalty when the request gives none (OpenAI's: per occurrence "
        "in the answer so far; 0: off); the default fits the bundled model (docs/benchmarks.md#penalties-on-the-qa-set)"
    )
    default_presence_penalty: float = Field(0.0, ge=-2.0, le=2.0,
                                            description="presence_penalty when the request gives none")
    default_repetition_penalty: float = Field(
        1.0, gt=0.0, le=10.0, description="repetition_penalty when the request gives none (multiplicative; counts "
        "the prompt, so the document's own words too)"
    )


class DraftingSettings(BaseModel):
    """Speculative decoding's own: RAPID's retrieved context, the draft tree's size and the verify-cost
    calibration that sizes it."""

    rapid_context_tokens: int = Field(
        1024, ge=64, description="Retrieved-chunk tokens in the RAPID drafter's prompt (capped by the RAG budget)"
    )
    draft_budget_max: int = Field(64, ge=0, le=512, description="Most draft-tree nodes per verify step")
    calibrate: bool = Field(True, description="Measure verify cost per draft size at start (background)")


class SchedulingSettings(BaseModel):
    """Generations at once: the queue, the batch, the KV working memory they share, how prompts are fed in."""

    queue_size: int = Field(32, ge=0, description="Waiting generations beyond the running ones -> 429 above")
    max_batch: int = Field(
        8, ge=1, le=64, description="Most generations that run at once: on the quantized CPU runtime their forwards "
        "share one batched forward, each answer as it is alone; the torch runtime runs one at a time"
    )
    kv_pool_bytes: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="Working memory the running generations' KV caches may hold together; a generation "
        "waits until its cache fits beside the others', one that can never fit is refused (413); auto: 25% of the "
        "RAM available at start-up, at least one generation at the full window"
    )
    prefill_rows_per_step: int = Field(
        64, ge=1, le=128, description="Prompt rows a new generation adds to each batched forward while others "
        "decode (alone it reads 128 a forward): fewer keeps the others' tokens flowing, more starts it sooner"
    )
    prefill_chunk: int | None = Field(
        None, ge=1, description="Prompt tokens per prefill forward (default: by device, 256 on a CPU, 4096 on a GPU)"
    )

    @field_validator("kv_pool_bytes", mode="before")
    @classmethod
    def _pool_bytes(cls, value: object) -> object:
        return byte_count_or_auto(value)


class KVCacheSettings(BaseModel):
    """The document KV cache: its budget on the device and on the host, and its copy on disk."""

    kv_cache_bytes: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="Byte budget of the document KV cache on the model's device (LRU); auto: on CUDA 90% "
        "of the device memory free once the models are loaded, less one generation's KV at the full window and "
        "2 GiB, on a CPU 2 GiB; 0: no KV cache"
    )
    kv_host_bytes: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="On CUDA, byte budget of the host-memory tier that KV evicted from the device moves to "
        "(LRU); auto: 40% of the RAM available at start-up; 0: none. Unused on a CPU (the device is the host)"
    )
    kv_cache_persist: bool = Field(True, description="Persist document KV caches to disk across restarts")
    kv_disk_bytes: int = Field(
        8 << 30, ge=0, description="Byte quota of the persisted KV cache (least recently used files go first)"
    )

    @field_validator("kv_cache_bytes", "kv_host_bytes", mode="before")
    @classmethod
    def _cache_bytes(cls, value: object) -> object:
        return byte_count_or_auto(value)


GROUPS: tuple[type[BaseModel], ...] = (
    PathSettings, ServerSettings, StoreSettings, ClusterSettings, SessionSettings, ModelSettings, KernelSettings,
    RetrievalSettings, RequestSettings, DraftingSettings, SchedulingSettings, KVCacheSettings,
)  # the concerns in the order of their fields (and of docs/settings.md)


class Settings(  # pydantic takes the fields of the last base first: these are GROUPS reversed, so paths come first
    KVCacheSettings, SchedulingSettings, DraftingSettings, RequestSettings, RetrievalSettings, KernelSettings,
    ModelSettings, SessionSettings, ClusterSettings, StoreSettings, ServerSettings, PathSettings, BaseSettings,
):
    """Every setting, read from the ``RAGSPEC_*`` environment (or given as keyword arguments, which win over it)."""

    # An empty variable is an unset one: docker-compose passes `VAR=` through as "" (see docker-compose.yml)
    model_config = SettingsConfigDict(env_prefix="RAGSPEC_", env_file=None, extra="ignore", env_ignore_empty=True)
