"""Prometheus metrics, one registry per app (several apps may live in one process, e.g. in tests).

Generation stats are data (``decoding.stats``); this module only reports them. Gauges that mirror live
state (queue depth, KV-cache bytes, indexing jobs, Redis) are read at scrape time by a collector.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from decoding.stats import GenerationStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "ragspec_http_requests",
            "HTTP requests by route, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "ragspec_http_request_seconds",
            "HTTP request latency (to the last byte)",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.generations = Counter(
            "ragspec_generations",
            "Finished generations by mode and finish reason",
            ["mode", "finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "ragspec_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tokens_per_second = Histogram(
            "ragspec_decode_tokens_per_second",
            "Decode throughput per generation (tokens after the first)",
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
            registry=r,
        )
        self.acceptance_length = Histogram(
            "ragspec_acceptance_length",
            "Tokens emitted per verify step (accepted + bonus)",
            buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 6, 8, 12),
            registry=r,
        )
        self.drafted = Counter(
            "ragspec_drafted_tokens", "Draft tokens verified, by source", ["source"], registry=r
        )
        self.accepted = Counter(
            "ragspec_accepted_tokens", "Draft tokens accepted, by source", ["source"], registry=r
        )
        self.completion_tokens = Counter("ragspec_completion_tokens", "Generated tokens", registry=r)
        self.prompt_tokens = Counter("ragspec_prompt_tokens", "Prompt tokens", registry=r)
        self.rejected = Counter("ragspec_overloaded", "Requests refused with 429 (queue full)", registry=r)

    def observe_generation(self, mode: str, stats: GenerationStats) -> None:
        self.generations.labels(mode, stats.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.completion_tokens.inc(stats.completion_tokens)
        if stats.completion_tokens:
            self.ttft.observe(stats.ttft_s)
        if stats.tokens_per_second > 0:
            self.tokens_per_second.observe(stats.tokens_per_second)
        if stats.steps:
            self.acceptance_length.observe(stats.acceptance_length)
        for source, n in stats.drafted_by_source.items():
            self.drafted.labels(source).inc(n)
        for source, n in stats.accepted_by_source.items():
            self.accepted.labels(source).inc(n)

    def add_live(self, read: Callable[[], Mapping[str, Any]]) -> None:
        """Report live state at scrape time (see ``LiveCollector``)."""
        self.registry.register(LiveCollector(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LiveCollector(Collector):
    """Gauges / counters read from the running service at scrape time.

    ``read()`` returns: queue_waiting, generation_running, kv_cache_bytes, kv_disk_bytes, kv_cache_hits,
    kv_cache_misses, redis_up (1/0, or None when Redis is not configured), indexing_jobs ({status: count}).
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
        yield GaugeMetricFamily(
            "ragspec_generation_running", "1 while a generation runs", 1 if live["generation_running"] else 0
        )
        yield GaugeMetricFamily(
            "ragspec_kv_cache_bytes", "Bytes held by the document KV cache", live["kv_cache_bytes"]
        )
        yield GaugeMetricFamily(
            "ragspec_kv_disk_bytes", "Bytes of the persisted KV cache on disk", live.get("kv_disk_bytes", 0)
        )
        yield CounterMetricFamily("ragspec_kv_cache_hits", "Document KV cache hits", live["kv_cache_hits"])
        yield CounterMetricFamily(
            "ragspec_kv_cache_misses", "Document KV cache misses", live["kv_cache_misses"]
        )
        jobs = GaugeMetricFamily("ragspec_indexing_jobs", "Documents by indexing status", labels=["status"])
        for status, count in sorted(live["indexing_jobs"].items()):
            jobs.add_metric([status], count)
        yield jobs
        if live.get("redis_up") is not None:
            yield GaugeMetricFamily("ragspec_redis_up", "1 when Redis answers", 1 if live["redis_up"] else 0)


class RequestMetricsMiddleware:
    """Pure ASGI middleware (keeps streaming and disconnects intact): counts and times every request."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or (
                "static" if scope["path"].startswith("/static") else "unmatched"
            )
            self.metrics.requests.labels(path, scope["method"], str(status)).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - t0)
