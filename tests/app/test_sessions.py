"""Session history with a real redis-server that goes away and comes back."""

from __future__ import annotations

import asyncio

import pytest

from app.serving.redis_link import RedisLink
from app.serving.sessions import SessionStore, Turn
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


def _turn(i: int, doc: str = "d1") -> Turn:
    return Turn(f"q{i}", f"a{i}", (doc,), ({"document_id": doc, "chunk_id": f"{doc}:{i}", "text": f"passage {i}"},))


def test_conversations_are_listed_read_and_deleted_in_redis(redis_server: RedisServer) -> None:
    """Summaries survive the turns' trimming; another process on the same Redis (empty memory) sees the same
    list and turns; another tenant sees nothing."""

    async def main() -> None:
        link = RedisLink(redis_server.url, retry_every_s=0.0)
        store = SessionStore(link, ttl_s=600, max_turns=2)
        for i in range(1, 4):
            await store.append("t1", "long", _turn(i))
        await store.append("t1", "short", _turn(9, "d2"))
        await store.append("t2", "theirs", _turn(5))

        other_link = RedisLink(redis_server.url, retry_every_s=0.0)
        replica = SessionStore(other_link, ttl_s=600, max_turns=2)  # nothing in its memory
        for s in (store, replica):
            listed = await s.recent("t1")
            assert [(c.id, c.title, c.asked) for c in listed] == [("short", "q9", 1), ("long", "q1", 3)]
            long = await s.get("t1", "long")
            assert long is not None and long.turns == [_turn(2), _turn(3)]  # the last max_turns, whole
            assert await s.get("t2", "long") is None and await s.get("t1", "theirs") is None
        assert [c.id for c in await replica.recent("t2")] == ["theirs"]

        assert await replica.delete("t1", "long") is True
        assert await store.get("t1", "long") is None  # gone from Redis, so from every process
        assert [c.id for c in await store.recent("t1")] == ["short"]
        assert await store.delete("t1", "long") is False
        assert await store.delete("t2", "short") is False  # another tenant's id: not found, not deleted
        assert await store.get("t1", "short") is not None
        await link.close()
        await other_link.close()

    asyncio.run(main())


def test_a_delete_while_redis_is_unreachable_is_done_when_it_is_back(redis_server: RedisServer) -> None:
    """Redis keeps its data while this process cannot reach it (a partition): the delete holds here at once,
    reaches Redis on the next read, and an id asked again meanwhile starts afresh (the old turns never return)."""
    from tests.conftest import free_port

    async def main() -> None:
        link = RedisLink(redis_server.url, retry_every_s=0.0)
        store = SessionStore(link, ttl_s=600, max_turns=4)
        replica = SessionStore(RedisLink(redis_server.url, retry_every_s=0.0), ttl_s=600, max_turns=4)
        await store.append("t", "s", _turn(1))
        await store.append("t", "kept", _turn(2))

        store.link = RedisLink(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
        assert await store.delete("t", "s") is True
        assert await store.get("t", "s") is None and [c.id for c in await store.recent("t")] == ["kept"]
        assert await replica.get("t", "s") is not None  # Redis has not seen the delete yet

        store.link = link  # reachable again: the next read does the delete in Redis
        assert [c.id for c in await store.recent("t")] == ["kept"]
        assert await replica.get("t", "s") is None

        # the same while the id is asked again before Redis is back
        await store.append("t", "s2", _turn(3))
        store.link = RedisLink(f"redis://127.0.0.1:{free_port()}/0")
        assert await store.delete("t", "s2") is True
        await store.append("t", "s2", _turn(4))  # kept in process
        store.link = link
        await store.append("t", "s2", _turn(5))  # reaches Redis: the delete first, then this turn
        again = await replica.get("t", "s2")
        assert again is not None and again.turns == [_turn(5)]
        await link.close()
        await replica.link.close()

    asyncio.run(main())


def test_sources_are_dropped_when_not_kept() -> None:
    async def main() -> None:
        store = SessionStore(RedisLink(None), ttl_s=600, max_turns=2, keep_sources=False)
        await store.append("t", "s", _turn(1))
        conversation = await store.get("t", "s")
        assert conversation is not None and conversation.turns == [Turn("q1", "a1", ("d1",))]
        assert [c.title for c in await store.recent("t")] == ["q1"] and await store.recent("other") == []

    asyncio.run(main())
