"""RedisLink against a real redis-server that restarts, hangs (SIGSTOP) and comes back."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest
from redis.asyncio import Redis

from app.redis_link import RedisLink
from tests.conftest import RedisServer

pytestmark = pytest.mark.redis


def test_a_restart_under_idle_pooled_connections_costs_no_request(redis_server: RedisServer) -> None:
    async def main() -> None:
        link = RedisLink(redis_server.url)

        async def set_k(client: Redis) -> bool:
            return bool(await client.set("k", 0))

        await asyncio.gather(*(link.run(set_k) for _ in range(4)))  # at once: 4 connections in the pool
        assert len(await link.run(lambda c: c.client_list())) == 4  # type: ignore[arg-type, return-value]
        redis_server.start()  # killed and started again: every pooled connection is now closed
        values = await asyncio.gather(*(link.run(lambda c: c.set("k", 1)) for _ in range(4)))
        assert values == [True] * 4
        assert link.state == "up" and link.failures == 0
        await link.close()

    asyncio.run(main())


def test_a_hung_redis_costs_one_timeout_then_calls_fail_fast_until_it_answers(redis_server: RedisServer) -> None:
    async def main() -> None:
        link = RedisLink(redis_server.url, timeout_s=0.5, retry_every_s=30.0)
        assert await link.ping()
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.perf_counter()
            assert not await link.ping()
            first = time.perf_counter() - t0
            t1 = time.perf_counter()
            for _ in range(20):
                with pytest.raises(Exception, match="redis is down"):
                    await link.run(lambda c: c.get("k"))
            rest = time.perf_counter() - t1
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert 0.45 < first < 0.9  # one socket timeout: a timeout is not retried
        assert rest < 0.1  # no network while Redis is known down
        assert link.state == "down" and link.failures == 1
        assert await link.ping() and link.state == "up"  # a health check always tries
        await link.close()

    asyncio.run(main())


def test_no_part_of_a_password_reaches_the_log(caplog: pytest.LogCaptureFixture) -> None:
    link = RedisLink("redis://ragspec:pa@ss-w0rd@127.0.0.1:1/0")  # redis-py reads the password "pa@ss-w0rd"

    async def answered(client: object) -> int:
        return 1

    with caplog.at_level(logging.INFO, logger="app.redis_link"):
        assert asyncio.run(link.run(answered)) == 1
    assert "redis://***@127.0.0.1:1/0" in caplog.text
    assert "pa@" not in caplog.text and "w0rd" not in caplog.text
