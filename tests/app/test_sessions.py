"""Session history with a real redis-server that goes away and comes back."""

from __future__ import annotations

import asyncio

import pytest

from app.redis_link import RedisLink
from app.sessions import SessionStore, Turn
from tests.conftest import RedisServer

pytestmark = pytest.mark.redis


def test_history_survives_a_redis_outage(redis_server: RedisServer) -> None:
    async def main() -> None:
        link = RedisLink(redis_server.url, retry_every_s=0.0)
        store = SessionStore(link, ttl_s=600, max_turns=3)
        await store.append("t1", "s", Turn("q1", "a1"))
        assert link.state == "up"
        assert await store.history("t1", "s") == [Turn("q1", "a1")]
        assert await store.history("t2", "s") == []  # another tenant's session of the same id

        redis_server.stop()
        await store.append("t1", "s", Turn("q2", "a2"))  # no error: kept in process
        assert link.state == "down"
        assert await store.history("t1", "s") == [Turn("q1", "a1"), Turn("q2", "a2")]

        redis_server.start()
        assert await link.ping()
        # Redis lost the data (no persistence in the fixture); the newer in-process copy wins
        assert await store.history("t1", "s") == [Turn("q1", "a1"), Turn("q2", "a2")]
        for i in range(3, 6):
            await store.append("t1", "s", Turn(f"q{i}", f"a{i}"))
        assert [t.question for t in await store.history("t1", "s")] == ["q3", "q4", "q5"]  # max_turns
        await link.close()

    asyncio.run(main())


def test_without_redis_everything_is_in_process() -> None:
    async def main() -> None:
        link = RedisLink(None)
        store = SessionStore(link, ttl_s=600, max_turns=2)
        await store.append("t", "s", Turn("q", "a"))
        assert link.state == "disabled" and await store.history("t", "s") == [Turn("q", "a")]

    asyncio.run(main())


def test_redis_down_from_the_start() -> None:
    from tests.conftest import free_port

    async def main() -> None:
        link = RedisLink(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
        store = SessionStore(link, ttl_s=600, max_turns=2)
        await store.append("t", "s", Turn("q", "a"))
        assert await store.history("t", "s") == [Turn("q", "a")]
        assert link.state == "down" and not await link.ping()
        await link.close()

    asyncio.run(main())
