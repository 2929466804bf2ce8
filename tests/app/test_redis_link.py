"""RedisLink against a real redis-server that restarts, hangs (SIGSTOP) and comes back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Awaitable

import pytest
from redis.asyncio import Redis

from app.serving.redis_link import RedisLink, RedisUnavailable
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


class SilentServer:
    """A TCP server that accepts connections and never answers: a hung Redis whose connections can be counted."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.accepted.append(self.sock.accept()[0])

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


def test_a_hung_redis_costs_one_attempt_then_calls_fail_fast() -> None:
    server = SilentServer()
    calls = 0

    def get_k(client: Redis) -> Awaitable[object]:
        nonlocal calls
        calls += 1
        return client.get("k")

    async def main() -> None:
        link = RedisLink(f"redis://127.0.0.1:{server.port}/0", timeout_s=0.3, retry_every_s=30.0)
        with pytest.raises(RedisUnavailable):
            await link.run(get_k)
        assert calls == 1 and len(server.accepted) == 1  # a timeout is not retried on a second connection
        for _ in range(20):
            with pytest.raises(RedisUnavailable, match="redis is down"):
                await link.run(get_k)
        assert calls == 1 and len(server.accepted) == 1  # no network at all while Redis is known down
        assert link.state == "down" and link.failures == 1
        await link.close()

    try:
        asyncio.run(main())
    finally:
        server.close()


def test_a_hung_redis_is_down_until_it_answers_again(redis_server: RedisServer) -> None:
    async def main() -> None:
        link = RedisLink(redis_server.url, timeout_s=0.5, retry_every_s=30.0)
        assert await link.ping()
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            assert not await link.ping()
            with pytest.raises(RedisUnavailable, match="redis is down"):
                await link.run(lambda c: c.get("k"))
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert link.state == "down" and link.failures == 1
        assert await link.ping() and link.state == "up"  # a health check always tries
        await link.close()

    asyncio.run(main())


def test_no_part_of_a_password_reaches_the_log(caplog: pytest.LogCaptureFixture) -> None:
    link = RedisLink("redis://ragspec:pa@ss-w0rd@127.0.0.1:1/0")  # redis-py reads the password "pa@ss-w0rd"

    async def answered(client: object) -> int:
        return 1

    with caplog.at_level(logging.INFO, logger="app.serving.redis_link"):
        assert asyncio.run(link.run(answered)) == 1
    assert "redis://***@127.0.0.1:1/0" in caplog.text
    assert "pa@" not in caplog.text and "w0rd" not in caplog.text
