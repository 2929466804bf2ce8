"""The cross-session tier in Redis, against a real redis-server (killed and restarted too)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from decoding.drafters.racer import (
    SOURCE_CROSS_SESSION,
    CrossSessionConfig,
    LogitsTable,
    RacerConfig,
    RacerFactory,
    RedisSharedTier,
)
from decoding.drafters.racer.redis_schema import decode_continuation, redact_url
from tests.conftest import RedisServer
from tests.decoding.drafters.racer.conftest import scripted_run


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def decoded(raw: Any) -> dict[tuple[int, ...], float]:
    """A context hash as stored in Redis: continuation -> count (the decay stamp left out)."""
    return {decode_continuation(f): float(v) for f, v in raw.items() if f != b"_t"}


@pytest.fixture
def tiers() -> Iterator[list[RedisSharedTier]]:
    made: list[RedisSharedTier] = []
    yield made
    for t in made:
        t.close()


def redis_tier(made: list[RedisSharedTier], server: RedisServer, clock: Clock | None = None,
               **kw: object) -> RedisSharedTier:
    cfg = CrossSessionConfig(redis_url=server.url, **kw)  # type: ignore[arg-type]
    tier = RedisSharedTier(cfg, clock or time.time)
    made.append(tier)
    return tier


@pytest.mark.redis
def test_redis_key_schema_ttl_and_fetch(redis_server: RedisServer, tiers: list[RedisSharedTier]) -> None:
    tier = redis_tier(tiers, redis_server, context_len=2, continuation_len=3, ttl_s=3600)
    cache = tier.cache("org/tiny model", "tok123", "secret-api-key")
    cache.learn([1, 2, 3, 4, 5], start=0)
    assert tier.drain()
    client = redis.Redis.from_url(redis_server.url)
    keys = sorted(k.decode() for k in client.keys("*"))  # type: ignore[union-attr]
    assert len(keys) == 4  # three contexts + the index
    tag = re.escape(cache.namespace.tag)
    assert cache.namespace.tag.startswith("{m=org_tiny_model;t=tok123;u=")
    for k in keys:
        assert re.fullmatch(rf"ragspec:dc:{tag}:(c:[0-9a-f]{{16}}|idx)", k)
        assert "secret-api-key" not in k
        assert 0 < client.ttl(k) <= 3600
    assert decoded(client.hgetall(tier.context_key(cache.namespace, [1, 2]))) == {(3, 4, 5): 1.0}
    assert client.zcard(tier.index_key(cache.namespace)) == 3
    # a fresh process: nothing local until a prefetch (one background round trip) has arrived
    fresh = redis_tier(tiers, redis_server, context_len=2, continuation_len=3)
    view = fresh.cache("org/tiny model", "tok123", "secret-api-key")
    assert view.continuations([1, 2]) == []
    view.prefetch([[9, 1, 2], [2, 3]])
    assert fresh.drain()
    assert view.continuations([1, 2]) == [((3, 4, 5), 1.0)]
    assert view.continuations([2, 3]) == [((4, 5), 1.0)]
    assert fresh.status()["fetches"] == 1 and fresh.status()["fetched_contexts"] == 2
    other = fresh.cache("org/tiny model", "tok123", "another-tenant")
    other.prefetch([[1, 2]])
    assert fresh.drain()
    assert other.continuations([1, 2]) == []


@pytest.mark.redis
def test_a_fetch_landing_after_a_local_learn_does_not_hide_it(
    redis_server: RedisServer, tiers: list[RedisSharedTier]
) -> None:
    tier = redis_tier(tiers, redis_server, context_len=1, continuation_len=2)
    cache = tier.cache("m", "t", "a")
    with tier._cv:  # hold the worker: the fetch (of nothing yet) runs first, then the learn
        cache.prefetch([[1]])
        cache.learn([1, 2, 3], start=0)
        assert cache.continuations([1]) == [((2, 3), 1.0)]
    assert tier.drain()
    assert tier.status()["fetches"] == 1 and tier.status()["learns"] == 1
    assert cache.continuations([1]) == [((2, 3), 1.0)]


@pytest.mark.redis
def test_redis_decay_and_memory_bound(redis_server: RedisServer, tiers: list[RedisSharedTier]) -> None:
    clock = Clock()
    tier = redis_tier(tiers, redis_server, clock, context_len=1, continuation_len=2, half_life_s=10,
                      max_contexts=5, max_continuations=2)
    cache = tier.cache("m", "t", "a")
    cache.learn([1, 2, 3], start=0)
    clock.now += 10
    cache.learn([1, 5, 6], start=0)
    clock.now += 10
    cache.learn([1, 7, 7], start=0)
    for t in range(10, 30):
        cache.learn([t, t + 1, t + 2], start=0)
    assert tier.drain()
    client = redis.Redis.from_url(redis_server.url)
    ctx_keys = client.keys("ragspec:dc:*:c:*")
    assert len(ctx_keys) <= 5 and client.zcard(tier.index_key(cache.namespace)) <= 5
    for k in ctx_keys:
        assert client.hlen(k) <= 2 + 1  # max_continuations + the decay stamp
    # context (1,) was decayed and trimmed like the in-process tier; it is among the oldest, so evicted now
    assert client.exists(tier.context_key(cache.namespace, [1])) == 0
    small = redis_tier(tiers, redis_server, clock, context_len=1, continuation_len=2, half_life_s=10,
                       max_continuations=2)
    c2 = small.cache("m", "t", "b")
    c2.learn([1, 2, 3], start=0)
    assert small.drain()
    clock.now += 10
    c2.learn([1, 5, 6], start=0)
    assert small.drain()
    clock.now += 10
    c2.learn([1, 7, 7], start=0)
    assert small.drain()
    raw = client.hgetall(small.context_key(c2.namespace, [1]))
    assert decoded(raw) == {(5, 6): 0.5, (7, 7): 1.0}


@pytest.mark.redis
def test_redis_second_session_benefits_and_survives_a_restart(
    redis_server: RedisServer, tiers: list[RedisSharedTier]
) -> None:
    vocab = 500
    prompt = [1, 2, 3, 4, 5, 6]
    answer = [300 + (i * 37) % 150 for i in range(40)]
    tier = redis_tier(tiers, redis_server)
    factory = RacerFactory(RacerConfig(), LogitsTable(vocab), tier, model_id="tiny", tokenizer_hash="t0")
    first = scripted_run(factory.drafter("acme"), prompt, answer, budget=8, topk_token=vocab - 1)
    assert first.accepted == 0
    assert tier.drain()
    redis.Redis.from_url(redis_server.url).save()  # persist (the fixture runs without automatic saves)
    redis_server.start()  # restart: data comes back from the RDB file
    # a new process (fresh tier, empty mirror), the same tenant asks again
    tier2 = redis_tier(tiers, redis_server)
    factory2 = RacerFactory(RacerConfig(), LogitsTable(vocab), tier2, model_id="tiny", tokenizer_hash="t0")
    second = scripted_run(factory2.drafter("acme"), [*prompt, 9], answer, budget=8, topk_token=vocab - 1,
                          between_steps=tier2.drain)
    assert second.accepted_by_source[SOURCE_CROSS_SESSION] > len(answer) // 2
    assert second.steps < first.steps // 2
    assert tier2.status()["fetches"] <= second.steps + 1  # at most one round trip per step (+ begin)
    other = scripted_run(factory2.drafter("globex"), [*prompt, 9], answer, budget=8, topk_token=vocab - 1,
                         between_steps=tier2.drain)
    assert other.accepted == 0  # tenants never share a tier


@pytest.mark.redis
def test_redis_answers_are_kept_per_scope_shared_across_processes_and_trimmed(
    redis_server: RedisServer, tiers: list[RedisSharedTier]
) -> None:
    tier = redis_tier(tiers, redis_server, max_answers=2, ttl_s=3600)
    acme = tier.cache("tiny", "t0", "acme")
    for answer in ([1, 2, 3], [4, 5], [6]):
        acme.add_answer("doc-a", answer)
    assert acme.answers("doc-a") == [(6,), (4, 5)]  # write-through: this process at once
    assert tier.drain()
    client = redis.Redis.from_url(redis_server.url)
    [key] = client.keys("ragspec:dc:*:a:*")
    assert client.llen(key) == 2 and 0 < client.ttl(key) <= 3600 and b"acme" not in key
    other = redis_tier(tiers, redis_server)  # another replica: empty mirror until its prefetch lands
    assert other.cache("tiny", "t0", "acme").answers("doc-a") == []
    other.cache("tiny", "t0", "acme").prefetch_answers("doc-a")
    assert other.drain()
    assert other.cache("tiny", "t0", "acme").answers("doc-a") == [(6,), (4, 5)]
    assert other.cache("tiny", "t0", "globex").answers("doc-a") == []
    assert other.cache("tiny", "t0", "acme").answers("doc-b") == []


@pytest.mark.redis
def test_dead_redis_degrades_logs_once_and_reconnects(
    redis_server: RedisServer, tiers: list[RedisSharedTier], caplog: pytest.LogCaptureFixture
) -> None:
    tier = redis_tier(tiers, redis_server, context_len=1, continuation_len=2, retry_initial_s=0.05,
                      retry_max_s=0.2)
    cache = tier.cache("m", "t", "a")
    redis_server.stop()
    with caplog.at_level(logging.INFO, logger="decoding.drafters.racer.redis_tier"):
        for i in range(5):
            cache.learn([1, 2, 3], start=0)  # never raises, never waits
            cache.prefetch([[i + 10]])
            assert tier.drain()
            time.sleep(0.06)
        assert tier.status()["available"] is False
        assert cache.continuations([1]) == [((2, 3), 5.0)]  # the local tier still serves (write-through)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()
        redis_server.start()
        deadline = time.monotonic() + 10
        while not tier.status()["available"] and time.monotonic() < deadline:
            time.sleep(0.1)
            cache.prefetch([[42]])
            tier.drain()
        assert tier.status()["available"] is True
        assert any("reachable again" in r.getMessage() for r in caplog.records)
    cache.learn([7, 8, 9], start=0)
    assert tier.drain()
    assert redis.Redis.from_url(redis_server.url).exists(tier.context_key(cache.namespace, [7])) == 1


def test_redact_url_names_the_server_never_the_credentials() -> None:
    assert redact_url("redis://user:p@ss@cache.internal:6380/2") == "redis://cache.internal:6380/2"
    assert redact_url("rediss://:s3cret@10.0.0.5/0") == "rediss://10.0.0.5/0"
    assert redact_url("redis://localhost:6379") == "redis://localhost:6379"
    assert "s3cret" not in redact_url("redis://:s3cret@host:notaport/0")
