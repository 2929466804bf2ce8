"""Prometheus metrics, one registry per app (several apps may live in one process, e.g. in tests).

Generation stats are data (``decoding.speculative.stats``); this module only reports them. Gauges that mirror live
state (queue depth, KV-cache bytes, indexing jobs, Redis) are read at scrape time by a collector.

Series about a tenant's traffic (requests, latency, generations, tokens, its documents) carry a ``tenant``
label. ``render`` has three views: ``all`` (every series as stored, for a scraper with the metrics token),
``total`` (the tenant label summed away: the service's totals, what everyone sees with auth off) and a
tenant's own (only series labelled with that tenant, the label dropped; nothing service-wide, nothing of
another tenant).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from decoding.speculative.stats import GenerationStats

TENANT_LABEL = "tenant"
View = Literal["all", "total", "tenant"]
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "ragspec_http_requests",
            "HTTP requests by tenant, route, method and status",
            [TENANT_LABEL, "route", "method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "ragspec_http_request_seconds",
            "HTTP request latency (to the last byte)",
            [TENANT_LABEL, "route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.generations = Counter(
            "ragspec_generations",
            "Finished generations by tenant, mode and finish reason",
            [TENANT_LABEL, "mode", "finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "ragspec_ttft_seconds", "Time to first token", [TENANT_LABEL], buckets=LATENCY_BUCKETS, registry=r
        )
        self.tokens_per_second = Histogram(
            "ragspec_decode_tokens_per_second",
            "Decode throughput per generation (tokens after the first)",
            [TENANT_LABEL],
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
            registry=r,
        )
        self.acceptance_length = Histogram(
            "ragspec_acceptance_length",
            "Tokens emitted per verify step (accepted + bonus)",
            [TENANT_LABEL],
            buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 6, 8, 12),
            registry=r,
        )
        self.drafted = Counter(
            "ragspec_drafted_tokens", "Draft tokens verified, by source", [TENANT_LABEL, "source"], registry=r
        )
        self.accepted = Counter(
            "ragspec_accepted_tokens", "Draft tokens accepted, by source", [TENANT_LABEL, "source"], registry=r
        )
        self.drafting = Counter(
            "ragspec_drafting_seconds", "Wall time drafters spent proposing, by drafter", [TENANT_LABEL, "drafter"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "ragspec_completion_tokens", "Generated tokens", [TENANT_LABEL], registry=r
        )
        self.prompt_tokens = Counter("ragspec_prompt_tokens", "Prompt tokens", [TENANT_LABEL], registry=r)
        self.rejected = Counter("ragspec_overloaded", "Requests refused with 429 (queue full)", registry=r)
        self.queue_wait = Histogram(
            "ragspec_queue_wait_seconds", "Time a generation waited for a slot", buckets=LATENCY_BUCKETS, registry=r
        )

    def observe_generation(self, mode: str, stats: GenerationStats, tenant: str) -> None:
        self.generations.labels(tenant, mode, stats.finish_reason or "unknown").inc()
        self.prompt_tokens.labels(tenant).inc(stats.prompt_tokens)
        self.completion_tokens.labels(tenant).inc(stats.completion_tokens)
        if stats.completion_tokens:
            self.ttft.labels(tenant).observe(stats.ttft_s)
        if stats.tokens_per_second > 0:
            self.tokens_per_second.labels(tenant).observe(stats.tokens_per_second)
        if stats.steps:
            self.acceptance_length.labels(tenant).observe(stats.acceptance_length)
        for source, n in stats.drafted_by_source.items():
            self.drafted.labels(tenant, source).inc(n)
        for source, n in stats.accepted_by_source.items():
            self.accepted.labels(tenant, source).inc(n)
        for drafter, seconds in stats.draft_s_by_drafter.items():
            self.drafting.labels(tenant, drafter).inc(seconds)

    def add_live(self, read: Callable[[], Mapping[str, Any]]) -> None:
        """Report live state at scrape time (see ``LiveCollector``)."""
        self.registry.register(LiveCollector(read))

    def render(self, view: View = "total", tenant: str | None = None) -> bytes:
        """The exposition text in one of the views of the module docstring (``tenant`` for "tenant")."""
        if view == "all":
            return generate_latest(self.registry)
        return generate_latest(_View(self.registry, tenant if view == "tenant" else None))


class _View:
    """A registry-like reader of ``registry`` with the tenant label summed away (``tenant`` None) or
    restricted to one tenant's series."""

    def __init__(self, registry: CollectorRegistry, tenant: str | None) -> None:
        self.registry = registry
        self.tenant = tenant

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            tenanted = any(TENANT_LABEL in sample.labels for sample in family.samples)
            if self.tenant is not None and not tenanted:
                continue  # service-wide: not a tenant's business
            merged: dict[tuple[str, tuple[tuple[str, str], ...]], Sample] = {}
            for sample in family.samples:
                if self.tenant is not None and sample.labels.get(TENANT_LABEL) != self.tenant:
                    continue
                labels = {k: v for k, v in sample.labels.items() if k != TENANT_LABEL}
                key = (sample.name, tuple(sorted(labels.items())))
                seen = merged.get(key)
                if seen is None:
                    merged[key] = Sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
                elif sample.name.endswith("_created"):  # a series' start: the earliest one
                    merged[key] = seen._replace(value=min(seen.value, sample.value))
                else:
                    merged[key] = seen._replace(value=seen.value + sample.value)
            if self.tenant is not None and not merged:
                continue
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = list(merged.values())
            yield out


class LiveCollector(Collector):
    """Gauges / counters read from the running service at scrape time.

    ``read()`` returns: queue_waiting, generations_running (how many run now; ``ragspec_generation_running`` is 1
    while it is not 0), batch (the engine's ``BatchStats``, or None), kv_cache_bytes, kv_disk_bytes,
    kv_host_bytes, kv_cache_hits, kv_cache_misses, redis_up (1/0, or None when Redis is not configured),
    indexing_jobs ({(tenant, status): count}).
    """

    def __init__(self, read: Callable[[], Mapping[str, Any]]) -> None:
        self._read = read

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        live = self._read()
        yield GaugeMetricFamily(
            "ragspec_queue_depth", "Generations waiting for the engine", live["queue_waiting"]
        )
        running = live["generations_running"]
        yield GaugeMetricFamily("ragspec_generation_running", "1 while a generation runs", 1 if running else 0)
        yield GaugeMetricFamily("ragspec_generations_running", "Generations running at once", running)
        batch = live.get("batch")
        if batch is not None:  # the engine's batched forwards (decoding.speculative.batching.BatchStats)
            yield CounterMetricFamily("ragspec_batch_forwards", "Target forwards run", batch.forwards)
            yield CounterMetricFamily("ragspec_batch_sequences", "Sequences in those forwards (batch sizes summed)",
                                      batch.sequences)
            yield CounterMetricFamily("ragspec_batch_rows", "Rows in those forwards", batch.rows)
            yield CounterMetricFamily("ragspec_batch_prefill_rows", "Prompt rows among them", batch.prefill_rows)
            yield CounterMetricFamily("ragspec_batch_forward_seconds", "Wall time in those forwards (the rest of the "
                                      "time the engine is busy is the sequences' host work)", batch.seconds)
            yield GaugeMetricFamily("ragspec_batch_size", "Sequences in the last forward", batch.last_sequences)
            yield GaugeMetricFamily("ragspec_batch_last_rows", "Rows in the last forward", batch.last_rows)
        yield GaugeMetricFamily(
            "ragspec_kv_cache_bytes", "Bytes held by the document KV cache", live["kv_cache_bytes"]
        )
        yield GaugeMetricFamily(
            "ragspec_kv_disk_bytes", "Bytes of the persisted KV cache on disk", live.get("kv_disk_bytes", 0)
        )
        yield GaugeMetricFamily(
            "ragspec_kv_host_bytes", "Bytes of the KV cache's host-memory tier (CUDA)", live.get("kv_host_bytes", 0)
        )
        yield CounterMetricFamily("ragspec_kv_cache_hits", "Document KV cache hits", live["kv_cache_hits"])
        yield CounterMetricFamily(
            "ragspec_kv_cache_misses", "Document KV cache misses", live["kv_cache_misses"]
        )
        jobs = GaugeMetricFamily(
            "ragspec_indexing_jobs", "Documents by tenant and indexing status", labels=[TENANT_LABEL, "status"]
        )
        for (tenant, status), count in sorted(live["indexing_jobs"].items()):
            jobs.add_metric([tenant, status], count)
        yield jobs
        if live.get("redis_up") is not None:
            yield GaugeMetricFamily("ragspec_redis_up", "1 when Redis answers", 1 if live["redis_up"] else 0)
