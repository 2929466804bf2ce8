"""Conversation history per (tenant, session): Redis when configured and up, in process otherwise.

Writes go to both (the in-process copy is what keeps a conversation going through a Redis outage);
reads prefer Redis and fall back to the in-process copy. The in-process copy is a ``cachetools.TTLCache``:
at most ``max_sessions`` conversations, each kept ``ttl_s`` after its last write (a read does not extend it,
as Redis's EXPIRE, set on append, does not); when full, the least recently used one goes first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from cachetools import TTLCache

from app.redis_link import RedisLink, RedisUnavailable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Turn:
    question: str
    answer: str


class SessionStore:
    """Used from the event loop only (no await between a read and a write of the in-process copy)."""

    def __init__(
        self,
        link: RedisLink,
        ttl_s: int,
        max_turns: int,
        max_sessions: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.link = link
        self.ttl_s = ttl_s
        self.max_turns = max_turns
        self._memory: TTLCache[str, list[Turn]] = TTLCache(maxsize=max_sessions, ttl=ttl_s, timer=clock)

    @staticmethod
    def _key(tenant: str, session_id: str) -> str:
        return f"ragspec:session:{tenant}:{session_id}"

    async def history(self, tenant: str, session_id: str) -> list[Turn]:
        key = self._key(tenant, session_id)
        local = list(self._memory.get(key) or [])
        try:
            raw = await self.link.run(lambda c: c.lrange(key, -self.max_turns, -1))  # type: ignore[arg-type]
            shared = [Turn(**json.loads(item)) for item in raw]
        except RedisUnavailable:
            return local
        except (ValueError, TypeError):
            logger.warning("discarding a malformed session %s", key)
            return local
        # the local copy is newer when its last turn was written while Redis was down
        if local and local[-1] not in shared:
            return local
        return shared or local

    async def append(self, tenant: str, session_id: str, turn: Turn) -> None:
        key = self._key(tenant, session_id)
        turns = [*(self._memory.get(key) or []), turn][-self.max_turns :]
        self._memory[key] = turns
        payload = json.dumps(asdict(turn))

        async def write(client):  # type: ignore[no-untyped-def]
            async with client.pipeline(transaction=True) as pipe:
                pipe.rpush(key, payload)
                pipe.ltrim(key, -self.max_turns, -1)
                pipe.expire(key, self.ttl_s)
                return await pipe.execute()

        with contextlib.suppress(RedisUnavailable):
            await self.link.run(write)
