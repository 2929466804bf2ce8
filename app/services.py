"""Everything the service holds while it runs, loaded once (``lifespan``, or the CLI in process).

Settings are read here at start-up and only here; every library object gets plain values or a small frozen config,
and what the running service reads is its ``ServiceConfig`` (``Services`` holds no settings).
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from app.answering.drafters import Drafters, DraftingConfig
from app.answering.logprobs import LogprobText
from app.answering.prompts import PromptBuilder, document_texts
from app.config import ServiceConfig
from app.serving.auth import KeyRing
from app.serving.file_search import FileSearch
from app.serving.indexing import IndexingConfig, IndexingJobs
from app.serving.kv_tuning import (
    RecalibrationBackoff,
    available_ram_bytes,
    check_weights_fit,
    check_window_fits,
    fit_cpu_window,
    kv_budgets,
    schedule_recalibration,
    start_calibration,
)
from app.serving.metrics import Metrics
from app.serving.prefix_registry import PrefixRegistry
from app.serving.redis_link import RedisLink
from app.serving.scheduler import GenerationScheduler
from app.serving.sessions import SessionStore
from app.settings import KernelSettings, ModelSettings, PathSettings, RetrievalSettings, SchedulingSettings, Settings
from decoding.cache.prefix import PrefixCache
from decoding.errors import ModelLoadError
from decoding.runtime import kernels
from decoding.runtime.loader import (
    LoadedModel,
    LoadOptions,
    check_same_vocab,
    load_model,
    tokenizer_fingerprint,
    with_context_window,
)
from decoding.speculative.engine import Engine, EngineConfig
from decoding.speculative.generation import GenerationConfig, Prompt
from retrieval.embedding import Embedder, load_embedder
from retrieval.errors import CollectionNotFound
from retrieval.library import CollectionIndexes
from retrieval.retriever import Retriever
from retrieval.store import DocumentStore

logger = logging.getLogger(__name__)


@dataclass
class Services:
    config: ServiceConfig
    target: LoadedModel
    engine: Engine
    prefix_cache: PrefixCache | None
    embedder: Embedder
    store: DocumentStore
    retriever: Retriever
    library: CollectionIndexes  # every collection's search index, kept in step with the catalogue
    indexing: IndexingJobs
    scheduler: GenerationScheduler
    prompts: PromptBuilder
    prefix_registry: PrefixRegistry  # which cached prefixes hold which documents
    drafters: Drafters
    redis: RedisLink
    sessions: SessionStore
    metrics: Metrics
    keys: KeyRing
    started_at: float
    recalibration: RecalibrationBackoff = field(default_factory=RecalibrationBackoff)
    # collections' syncs and warm-ups after a change of their members, one at a time, off the request
    background: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="ragspec-collections"))
    _soon: set[str] = field(default_factory=set)  # collections whose change is queued on ``background``
    _soon_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def vocab_size(self) -> int:
        return self.target.model.vocab_size

    @functools.cached_property
    def logprob_text(self) -> LogprobText:
        """The target's log-probabilities in the APIs' shape (token texts cached)."""
        return LogprobText(self.target.tokenizer)

    def warm_document(self, doc_id: str) -> None:
        """Queue the document's KV prefix computation, run only while no question waits."""
        if self.prefix_cache is None:
            return
        record = self.store.get(doc_id)
        docs = document_texts(self.store, [record])
        prompt = self.prompts.warm_prompt(docs, self.config.limits.default_max_tokens, self.retriever,
                                          record.tenant)
        self._warm(prompt, [doc_id])

    def _warm(self, prompt: Prompt | None, doc_ids: list[str]) -> None:
        """Queue the KV computation of ``prompt``'s prefix (over ``doc_ids``), run only while no question waits."""
        if prompt is None or prompt.prefix_key is None:
            return
        self.prefix_registry.add(prompt.prefix_key, doc_ids)
        engine = self.engine

        def run(cancel: threading.Event) -> Iterator[Any]:
            engine.warm_prefix(prompt, cancel)
            yield from ()

        self.scheduler.submit_background(run, key=prompt.prefix_key)

    def documents_ready(self, doc_ids: list[str]) -> None:
        """After an ingest (of one document, or of a group indexed together): a document in no collection gets its
        prefix warmed, as a document asked by name; one in collections brings their indexes in step and warms the
        prefix of each collection that the target reads whole, once none of its documents is still waiting (so a
        batch of uploads warms it once, after its last documents; warming each of a library's documents alone
        would double its ingestion, docs/benchmarks.md)."""
        collections: dict[str, None] = {}
        for doc_id, of_doc in self.store.collections_of(doc_ids).items():
            if not of_doc:
                self.warm_document(doc_id)
            collections.update(dict.fromkeys(of_doc))
        for cid in collections:
            self.collection_changed_soon(cid)

    def collection_changed(self, collection_id: str) -> None:
        """Its members changed: sync its index now (questions then find it ready) and warm its whole-collection
        prefix when it fits the window and nothing of it is queued or indexing."""
        self.library.sync(collection_id)
        if self.prefix_cache is None:
            return
        counts = self.store.member_counts([collection_id])
        pending = counts.by_status.get("queued", 0) + counts.by_status.get("indexing", 0)
        max_tokens = self.config.limits.default_max_tokens
        if pending or not counts.by_status.get("ready") or counts.ready_tokens + max_tokens > self.prompts.max_context:
            return
        records = self.store.members([collection_id], statuses=["ready"])
        self._warm(self.prompts.warm_prompt(document_texts(self.store, records), max_tokens), [r.id for r in records])

    def collection_changed_soon(self, collection_id: str) -> None:
        """``collection_changed`` on the background worker, once for any number of changes made before it starts
        (a request that changed the members does not wait for the sync: a question syncs what it needs itself)."""
        with self._soon_lock:
            if collection_id in self._soon:
                return
            self._soon.add(collection_id)
        self.background.submit(self._changed, collection_id)

    def _changed(self, collection_id: str) -> None:
        with self._soon_lock:
            self._soon.discard(collection_id)
        self._quietly(self.collection_changed, collection_id)

    def forget_collection(self, collection_id: str) -> None:
        """After a collection is deleted: its index dropped, in memory and on disk."""
        self.library.forget(collection_id)

    @staticmethod
    def _quietly(work: Callable[[str], None], collection_id: str) -> None:
        try:
            work(collection_id)
        except CollectionNotFound:  # deleted meanwhile
            pass
        except Exception:
            logger.exception("background work on collection %s failed", collection_id)

    @property
    def file_search(self) -> FileSearch:
        """What OpenAI's file search objects read (``app.serving.file_search``)."""
        config = self.indexing.config
        return FileSearch(self.store, self.retriever, self.library, config.chunk_tokens, config.chunk_overlap)

    def forget_document(self, doc_id: str) -> None:
        """After a delete: drop cached chunks/index and every KV prefix the document is part of."""
        self.retriever.invalidate(doc_id)
        for key in self.prefix_registry.pop_document(doc_id):
            if self.prefix_cache is not None:
                self.prefix_cache.drop(key)

    def recalibrate_if_due(self) -> None:
        """After a generation, on a GPU: queue a verify-cost calibration at the cache lengths requests now run
        at, if well beyond the calibrated ones (``app.serving.kv_tuning.schedule_recalibration``). A CPU keeps its
        start-up calibration (its costs grow along the fitted line; a long prefill would hold up questions).
        One that requests keep cutting short is held back for a while (``self.recalibration``)."""
        if self.config.calibration.enabled and self.engine.device.type == "cuda":
            schedule_recalibration(self.engine, self.scheduler, backoff=self.recalibration)

    def live_metrics(self) -> dict[str, Any]:
        counts: dict[tuple[str, str], int] = {}  # (tenant, status) -> documents
        for record in self.store.list():
            for status in ("queued", "indexing", "ready", "failed"):
                counts.setdefault((record.tenant, status), 0)
            counts[record.tenant, record.status] += 1
        cache = self.prefix_cache
        return {
            "queue_waiting": self.scheduler.waiting,
            "generations_running": self.scheduler.running_count,
            "batch": self.engine.batcher.stats if self.engine.batcher is not None else None,
            "kv_cache_bytes": cache.bytes_used if cache is not None else 0,
            "kv_disk_bytes": cache.disk_bytes if cache is not None else 0,
            "kv_host_bytes": cache.host_bytes if cache is not None else 0,
            "kv_cache_hits": cache.hits if cache is not None else 0,
            "kv_cache_misses": cache.misses if cache is not None else 0,
            "indexing_jobs": counts,
            "redis_up": None if self.redis.state == "disabled" else self.redis.state == "up",
        }

    def close(self) -> None:
        self.scheduler.stop()
        self.indexing.stop()
        self.background.shutdown(wait=True, cancel_futures=True)
        self.library.close()
        self.drafters.close()
        self.store.close()


def configure_kernels(settings: KernelSettings) -> None:
    """Hand the CPU kernels' settings (used at all, build dir, compiler, ISA path) to ``decoding.runtime.kernels``;
    an ISA path this CPU lacks stops the start (``ModelLoadError``)."""
    try:
        kernels.configure(enabled=settings.cpu_kernels, cache_dir=settings.kernel_cache,
                          compiler=settings.kernel_compiler, isa=settings.cpu_isa)
    except kernels.KernelUnavailable as exc:
        raise ModelLoadError(f"RAGSPEC_CPU_ISA={settings.cpu_isa}: {exc}") from exc


def load_llm(settings: Settings, spec: str, rope_scaling: dict[str, Any] | None = None) -> LoadedModel:
    """A target or drafter LM as the settings ask for it (local files only)."""
    configure_kernels(settings)
    return load_model(spec, LoadOptions(
        models_dir=settings.models_dir, device=settings.device, dtype=settings.dtype, threads=settings.threads,
        local_files_only=True, cpu_kernels=settings.cpu_kernels, cpu_quant=settings.cpu_quant,
        kv_dtype=settings.kv_dtype, rope_scaling=rope_scaling,
    ))


def load_target(settings: Settings) -> LoadedModel:
    """The target LM with ``RAGSPEC_ROPE_SCALING`` applied and the window ``RAGSPEC_MAX_CONTEXT`` asks for:
    lower than the model's, or higher up to what the rope scaling supports; beyond it the service stops here,
    at start, rather than serving positions the model was never trained for. On a CPU the window must fit the RAM
    (``fit_cpu_window``): the model's own is capped to what does, one asked for that does not stops the start."""
    if settings.device != "cuda":  # a GPU's loader checks its own memory
        check_weights_fit(settings.target_model)
    target = load_llm(settings, settings.target_model, rope_scaling=settings.rope_scaling)
    if settings.max_context is None:
        return fit_cpu_window(target, explicit=False)
    try:
        return fit_cpu_window(with_context_window(target, settings.max_context), explicit=True)
    except ModelLoadError as exc:
        raise ModelLoadError(f"RAGSPEC_MAX_CONTEXT={settings.max_context}: {exc} (RAGSPEC_ROPE_SCALING)") from exc


def load_draft_model(settings: Settings, target: LoadedModel) -> LoadedModel:
    """The RAPID drafter's LM: the target itself (same weights, its own KV cache per request) unless
    ``RAGSPEC_DRAFTER_MODEL`` names another model, which must share the target's vocabulary."""
    if settings.drafter_model in (settings.target_model, "target"):
        return target
    drafter = load_llm(settings, settings.drafter_model)
    check_same_vocab(target, drafter)
    return drafter


def open_store(settings: Settings) -> DocumentStore:
    """The document store, recovered from an interrupted shutdown (its half-indexed documents fail; in a shared store
    other replicas' ingests are left to their jobs' leases)."""
    store = DocumentStore(settings.documents_dir, max_pdf_pages=settings.max_pdf_pages,
                          database=settings.database_url)
    report = store.recover(shared=settings.shared_store)
    if report.failed:
        logger.warning("documents interrupted by the last shutdown are now failed: %s", ", ".join(report.failed))
    return store


def open_embedder(settings: ModelSettings, store: DocumentStore) -> Embedder:
    """The embedder, warmed up; documents indexed by another one are named in the log (``ragspec reindex``)."""
    embedder = load_embedder(settings.embedding_model, settings.embedding_kind, settings.device)
    embedder.encode_query("warm-up")  # fixes the tokenizer's truncation state before threads share it
    stale = store.stale(embedder)
    if stale:
        logger.warning(
            "%d documents were indexed with another embedder than %s, or without the windows and BM25 index of "
            "hybrid retrieval; run `ragspec reindex --all`",
            len(stale),
            embedder.name,
        )
    return embedder


def open_drafters(settings: Settings, target: LoadedModel) -> Drafters:
    """Every drafter's process-wide state: RACER's tables and cross-session tier, RAPID's LM."""
    return Drafters(
        DraftingConfig(
            redis_url=settings.redis_url,
            draft_cache_ttl_s=settings.draft_cache_ttl_s,
            model_id=target.name,
            tokenizer_hash=tokenizer_fingerprint(target.tokenizer),
            vocab_size=target.vocab_size,
            draft_model=load_draft_model(settings, target).model,
            target_model=target.model,
            device=str(target.device),
        )
    )


def open_prefix_cache(settings: Settings, target: LoadedModel) -> PrefixCache | None:
    """The KV prefix cache (None when switched off), sized once every model is loaded (auto: from the free
    device memory)."""
    if settings.kv_cache_bytes == 0:
        if target.device.type == "cuda":
            check_window_fits(target)  # kv_budgets checks it otherwise: one generation at the window must fit
        return None
    device_bytes, host_bytes = kv_budgets(target, settings.kv_cache_bytes, settings.kv_host_bytes)
    persist = settings.kv_cache_persist and settings.kv_disk_bytes > 0
    return PrefixCache(
        device_bytes,
        settings.data_dir / "kv" if persist else None,
        disk_budget=settings.kv_disk_bytes,
        host_budget=host_bytes,
        device=target.device,
    )


def open_retriever(settings: RetrievalSettings, store: DocumentStore, embedder: Embedder) -> Retriever:
    return Retriever(
        store,
        embedder,
        threshold=settings.retrieval_threshold,
        budget_cap=settings.retrieval_budget_cap,
        top_k=settings.retrieval_top_k,
        scoring=settings.retrieval_scoring,
        lexical_weight=settings.retrieval_lexical_weight,
        cache_bytes=settings.retrieval_cache_bytes,
    )


def open_library(settings: Settings, store: DocumentStore, embedder: Embedder) -> CollectionIndexes:
    """The collections' indexes: a cache under the data dir (a replica's own in cluster mode), rebuilt from the
    catalogue and the documents' files where missing; those of collections that are gone are deleted."""
    library = CollectionIndexes(settings.data_dir / "collections", store, embedder)
    library.prune({c.id for c in store.list_collections(None)})
    return library


def open_prompts(settings: Settings, tokenizer: Any, model_name: str, max_context: int) -> PromptBuilder:
    """The target's prompts: its window, the long-document budget and lead, and the chat template's options
    (``enable_thinking``: Qwen3's thinking switch; ``reasoning_effort``: gpt-oss's harmony template's)."""
    return PromptBuilder(tokenizer, model_name, max_context, long_budget=settings.long_document_budget,
                         lead_tokens=settings.long_document_lead,
                         chat_options={"enable_thinking": settings.thinking,
                                       "reasoning_effort": settings.reasoning_effort})


def open_prefix_registry(
    settings: PathSettings, store: DocumentStore, prefix_cache: PrefixCache | None
) -> PrefixRegistry:
    """Which KV prefixes each document is part of; those of documents that are gone are dropped (memory, disk)."""
    registry = PrefixRegistry(settings.data_dir / "kv-prefixes.json")
    orphans = registry.prune({r.id for r in store.list()})
    if prefix_cache is not None:
        for key in orphans:
            prefix_cache.drop(key)
    return registry


def open_scheduler(settings: SchedulingSettings, engine: Engine,
                   on_start: Callable[[float], None] | None = None) -> GenerationScheduler:
    """``max_batch`` generations at once where the engine batches forwards (one elsewhere), within the KV pool."""
    slots = settings.max_batch if engine.batcher is not None else 1
    pool = settings.kv_pool_bytes
    if pool == "auto":
        window = engine.kv_bytes(engine.cache_rows(engine.max_context, GenerationConfig(max_new_tokens=1)))
        pool = max(int(0.25 * available_ram_bytes()), window)
    return GenerationScheduler(settings.queue_size, slots=slots, pool_bytes=int(pool), on_start=on_start)


def load_services(settings: Settings, metrics: Metrics | None = None, *, config: ServiceConfig | None = None,
                  keys: KeyRing | None = None, target: LoadedModel | None = None) -> Services:
    """Load models, open the store (recovering from a crash) and start the worker threads. ``config`` and ``keys``:
    the ones the app already built from these settings (its request gate reads them too), else built here;
    ``target``: the target LM ``load_target`` loaded already (``ragspec serve`` loads it first, to say which setting a
    failure is about)."""
    t0 = time.perf_counter()
    config = config if config is not None else ServiceConfig.from_settings(settings)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    store = open_store(settings)
    embedder = open_embedder(settings, store)
    target = load_target(settings) if target is None else target
    drafters = open_drafters(settings, target)
    prefix_cache = open_prefix_cache(settings, target)
    engine = Engine(
        target,
        prefix_cache,
        config=EngineConfig(max_budget=settings.draft_budget_max, prompt_topk=drafters.prompt_topk,
                            prefill_chunk=settings.prefill_chunk, prefill_rows=settings.prefill_rows_per_step),
    )
    metrics = metrics or Metrics()
    scheduler = open_scheduler(settings, engine, metrics.queue_wait.observe)
    redis = RedisLink(settings.redis_url)
    indexing = IndexingJobs(
        store,
        copy.deepcopy(target.tokenizer),
        embedder,
        IndexingConfig(chunk_tokens=settings.chunk_tokens, chunk_overlap=settings.chunk_overlap,
                       lease_s=settings.ingest_lease_s, poll_s=min(5.0, settings.ingest_lease_s / 3)),
    )
    services = Services(
        config=config,
        target=target,
        engine=engine,
        prefix_cache=prefix_cache,
        embedder=embedder,
        store=store,
        retriever=open_retriever(settings, store, embedder),
        library=open_library(settings, store, embedder),
        indexing=indexing,
        scheduler=scheduler,
        prompts=open_prompts(settings, target.tokenizer, target.name, engine.max_context),
        prefix_registry=open_prefix_registry(settings, store, prefix_cache),
        drafters=drafters,
        redis=redis,
        sessions=SessionStore(redis, config.sessions.session_ttl_s, config.sessions.max_turns,
                              keep_sources=config.sessions.keep_sources),
        metrics=metrics,
        keys=keys if keys is not None else KeyRing(config.access.api_keys),
        started_at=time.time(),
    )
    if not settings.shared_store:  # a replica that ingests a document is not the one its questions are routed to
        indexing.on_ready = services.documents_ready
    if config.calibration.enabled:
        start_calibration(engine, scheduler)  # 256 and 2048 tokens; on a GPU, longer caches up to the window
    logger.info("services ready in %.1f s (target %s, embedder %s)", time.perf_counter() - t0, target.name,
                embedder.name)
    return services
