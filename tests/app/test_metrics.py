"""The live gauges: what the running service reports at scrape time (``Services.live_metrics``, or the app's
stand-in before its services are loaded) as the Prometheus series ``/metrics`` shows."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from app.main import _live, create_app
from app.services import Services
from app.serving.metrics import Metrics
from app.settings import Settings


def _samples(metrics: Metrics) -> dict[str, float]:
    """``name -> value`` of the exposition's unlabelled samples."""
    samples = {}
    for line in metrics.render().decode().splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            samples[name] = float(value)
    return samples


def _services(running: int, waiting: int) -> Any:
    """What ``live_metrics`` reads of the services: a scheduler's counts, a store, no KV cache, Redis off."""
    document = SimpleNamespace(tenant="t", status="ready")
    return SimpleNamespace(
        scheduler=SimpleNamespace(waiting=waiting, running_count=running),
        engine=SimpleNamespace(batcher=None), prefix_cache=None, store=SimpleNamespace(list=lambda: [document]),
        redis=SimpleNamespace(state="disabled"),
    )


def test_one_count_of_running_generations_feeds_both_gauges() -> None:
    for running, any_running in ((0, 0.0), (1, 1.0), (3, 1.0)):
        services = _services(running, waiting=2)
        live = Services.live_metrics(services)
        assert live["generations_running"] == running and "generation_running" not in live
        metrics = Metrics()
        metrics.add_live(functools.partial(Services.live_metrics, services))
        samples = _samples(metrics)
        assert samples["ragspec_generations_running"] == running
        assert samples["ragspec_generation_running"] == any_running
        assert samples["ragspec_queue_depth"] == 2
        assert "ragspec_redis_up" not in samples and "ragspec_batch_forwards" not in samples


def test_before_the_services_load_the_gauges_read_zero(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path))  # type: ignore[call-arg]  # its lifespan (loading) does not run
    metrics = Metrics()
    metrics.add_live(lambda: _live(app))
    samples = _samples(metrics)
    assert samples["ragspec_generations_running"] == samples["ragspec_generation_running"] == 0
    assert samples["ragspec_queue_depth"] == samples["ragspec_kv_cache_bytes"] == 0
