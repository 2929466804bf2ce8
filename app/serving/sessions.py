"""Conversation history per (tenant, session): Redis when configured and up, in process otherwise.

A conversation is its last ``max_turns`` turns (question, answer, the documents asked and, unless
``keep_sources`` is off, the sources shown) plus a summary kept whole: its title (the first question),
when it began and was last written, and how many questions it had. The same turns are what a follow-up
question feeds back to the target.

Writes go to both stores (the in-process copy is what keeps a conversation going through a Redis outage);
reads prefer Redis and fall back to the in-process copy, which wins when it was written later (its last
turn was written while Redis was down). The in-process copy is a ``cachetools.TTLCache``: at most
``max_sessions`` conversations, each kept ``ttl_s`` after its last write (a read does not extend it, as
Redis's EXPIRE, set on append, does not); when full, the least recently used one goes first.

In Redis a conversation is three keys: its turns (a list), its summary (a hash) and the tenant's index of
conversations (a sorted set scored by last write); all expire ``ttl_s`` after the last write. A delete
leaves a marker of when (for ``ttl_s``): another process drops its in-process copy written before then. A
delete while Redis is down is remembered and done when Redis is back (Redis's copy is not read until
then), so a deleted conversation does not come back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from cachetools import Cache, TTLCache

from app.serving.redis_link import RedisLink, RedisUnavailable

logger = logging.getLogger(__name__)

TITLE_CHARS = 200  # a conversation's title: its first question, cut here


@dataclass(frozen=True)
class Turn:
    question: str
    answer: str
    documents: tuple[str, ...] = ()  # the documents asked about
    sources: tuple[Mapping[str, Any], ...] = ()  # the sources shown (empty when not kept)
    citations: Mapping[str, Any] | None = None  # the answer's citations of those sources (None when not kept)
    collections: tuple[str, ...] = ()  # the collections asked about
    filter: Mapping[str, Any] | None = None  # their attribute filter

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "documents": list(self.documents), "sources": list(self.sources),
                           "collections": list(self.collections)})

    @classmethod
    def from_json(cls, raw: str) -> Turn:
        data = json.loads(raw)
        return cls(
            question=str(data["question"]),
            answer=str(data["answer"]),
            documents=tuple(str(d) for d in data.get("documents", ())),
            sources=tuple(dict(s) for s in data.get("sources", ())),
            citations=dict(data["citations"]) if data.get("citations") is not None else None,
            collections=tuple(str(c) for c in data.get("collections", ())),
            filter=dict(data["filter"]) if data.get("filter") is not None else None,
        )


def last_scope(turns: Sequence[Turn]) -> tuple[list[str], list[str], Mapping[str, Any] | None]:
    """The documents, collections and filter of a conversation's last turn that asked about any (none: empty
    lists): what a follow-up naming neither documents nor collections asks about."""
    for turn in reversed(turns):
        if turn.documents or turn.collections:
            return list(turn.documents), list(turn.collections), turn.filter
    return [], [], None


@dataclass
class Conversation:
    id: str
    title: str
    created: float  # wall-clock seconds
    updated: float
    asked: int  # questions asked in it (turns beyond the last max_turns are no longer kept)
    turns: list[Turn] = field(default_factory=list)


class SessionStore:
    """Used from the event loop only (no await between a read and a write of the in-process copy)."""

    def __init__(
        self,
        link: RedisLink,
        ttl_s: int,
        max_turns: int,
        max_sessions: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        keep_sources: bool = True,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.link = link
        self.ttl_s = ttl_s
        self.max_turns = max_turns
        self.keep_sources = keep_sources
        self._wall = wall
        self._memory: TTLCache[str, Conversation] = TTLCache(maxsize=max_sessions, ttl=ttl_s, timer=clock)
        # deletes Redis has not seen yet (it was down): key -> when
        self._deleted: TTLCache[str, float] = TTLCache(maxsize=max_sessions, ttl=ttl_s, timer=clock)

    @staticmethod
    def _key(tenant: str, session_id: str) -> str:
        return f"ragspec:session:{tenant}:{session_id}"

    @staticmethod
    def _meta_key(tenant: str, session_id: str) -> str:
        return f"ragspec:session-meta:{tenant}:{session_id}"

    @staticmethod
    def _index_key(tenant: str) -> str:
        return f"ragspec:sessions:{tenant}"

    async def history(self, tenant: str, session_id: str) -> list[Turn]:
        """The turns a follow-up question is asked after (oldest first); none for an unknown session."""
        conversation = await self.get(tenant, session_id)
        return conversation.turns[-self.max_turns :] if conversation is not None else []

    async def get(self, tenant: str, session_id: str) -> Conversation | None:
        """The tenant's conversation ``session_id``, or None (unknown, expired, deleted or another's)."""
        key = self._key(tenant, session_id)
        local = self._memory.get(key)  # a read: counts as a use for the LRU order
        shared, gone = None, None
        if await self._redis_deletes_done(tenant, [session_id]):
            with contextlib.suppress(RedisUnavailable):
                shared, gone = await self._shared(tenant, session_id)
        if local is not None and gone is not None and local.updated <= gone:  # deleted by another process
            self._memory.pop(key, None)
            local = None
        return _newer(local, shared)

    async def recent(self, tenant: str, limit: int = 100) -> list[Conversation]:
        """The tenant's conversations, last written first (turns not loaded)."""
        found: dict[str, Conversation] = {}
        prefix = self._key(tenant, "")
        for key in self._memory:  # iterating neither touches the LRU order nor returns expired ones
            if key.startswith(prefix):
                local: Conversation = Cache.__getitem__(self._memory, key)  # a peek, not a use
                found[local.id] = local
        with contextlib.suppress(RedisUnavailable):
            pending = [k.removeprefix(prefix) for k in self._deleted if k.startswith(prefix)]
            if await self._redis_deletes_done(tenant, pending):
                shared, gone = await self._shared_list(tenant, limit, list(found))
                for session_id, at in gone.items():
                    if found[session_id].updated <= at:  # deleted by another process
                        self._memory.pop(self._key(tenant, session_id), None)
                        del found[session_id]
                for conversation in shared:
                    newer = _newer(found.get(conversation.id), conversation)
                    if newer is not None:
                        found[conversation.id] = newer
        ordered = sorted(found.values(), key=lambda c: (-c.updated, c.id))[:limit]
        return [Conversation(c.id, c.title, c.created, c.updated, c.asked) for c in ordered]

    async def append(self, tenant: str, session_id: str, turn: Turn) -> None:
        if not self.keep_sources:
            turn = Turn(turn.question, turn.answer, turn.documents)  # citations point into the sources
        key = self._key(tenant, session_id)
        now = self._wall()
        local = self._memory.get(key)
        if local is None:  # new, or asked again after a delete: a new conversation
            local = Conversation(session_id, turn.question[:TITLE_CHARS], now, now, 0)
        local = Conversation(
            session_id, local.title, local.created, now, local.asked + 1, [*local.turns, turn][-self.max_turns :]
        )
        self._memory[key] = local
        meta_key, index_key = self._meta_key(tenant, session_id), self._index_key(tenant)
        deleted_at = self._deleted.get(key)

        async def write(client):  # type: ignore[no-untyped-def]
            async with client.pipeline(transaction=True) as pipe:
                if deleted_at is not None:  # a delete Redis missed comes first: the old turns must not return
                    self._queue_delete(pipe, tenant, session_id, deleted_at)
                pipe.rpush(key, turn.to_json())
                pipe.ltrim(key, -self.max_turns, -1)
                pipe.expire(key, self.ttl_s)
                pipe.hsetnx(meta_key, "title", local.title)
                pipe.hsetnx(meta_key, "created", repr(local.created))
                pipe.hset(meta_key, "updated", repr(now))
                pipe.hincrby(meta_key, "asked", 1)
                pipe.expire(meta_key, self.ttl_s)
                pipe.zadd(index_key, {session_id: now})
                pipe.zremrangebyscore(index_key, "-inf", now - self.ttl_s)
                pipe.expire(index_key, self.ttl_s)
                return await pipe.execute()

        with contextlib.suppress(RedisUnavailable):
            await self.link.run(write)
            self._deleted.pop(key, None)

    async def delete(self, tenant: str, session_id: str) -> bool:
        """Forget the conversation, here and in Redis (or there once Redis is back); False when the tenant has
        no such conversation."""
        existed = await self.get(tenant, session_id) is not None
        key = self._key(tenant, session_id)
        self._memory.pop(key, None)
        if self.link.state != "disabled":
            self._deleted[key] = self._wall()
        with contextlib.suppress(RedisUnavailable):
            await self._redis_deletes_done(tenant, [session_id])
        return existed

    def _queue_delete(self, pipe: Any, tenant: str, session_id: str, at: float) -> None:
        """Delete a conversation in Redis and leave a marker of when, so that other processes drop their
        in-process copies written before then (a Redis that lost its data has no marker: their copies win)."""
        pipe.delete(self._key(tenant, session_id), self._meta_key(tenant, session_id))
        pipe.zrem(self._index_key(tenant), session_id)
        pipe.set(self._gone_key(tenant, session_id), repr(at), ex=self.ttl_s)

    async def _redis_deletes_done(self, tenant: str, session_ids: Sequence[str]) -> bool:
        """Do the deletes of ``session_ids`` that Redis missed; False while some are still to do (Redis is
        down: its copies of them must not be read)."""
        todo = [(i, self._deleted[self._key(tenant, i)]) for i in session_ids if self._key(tenant, i) in self._deleted]
        if not todo:
            return True

        async def drop(client):  # type: ignore[no-untyped-def]
            async with client.pipeline(transaction=True) as pipe:
                for session_id, at in todo:
                    self._queue_delete(pipe, tenant, session_id, at)
                return await pipe.execute()

        try:
            await self.link.run(drop)
        except RedisUnavailable:
            return False
        for session_id, _ in todo:
            self._deleted.pop(self._key(tenant, session_id), None)
        return True

    @staticmethod
    def _gone_key(tenant: str, session_id: str) -> str:
        return f"ragspec:session-deleted:{tenant}:{session_id}"

    async def _shared(self, tenant: str, session_id: str) -> tuple[Conversation | None, float | None]:
        """The conversation as Redis has it (None when Redis lacks it) and when it was last deleted (None:
        never, as far as Redis knows). Raises ``RedisUnavailable``."""
        key, meta_key = self._key(tenant, session_id), self._meta_key(tenant, session_id)

        async def read(client):  # type: ignore[no-untyped-def]
            async with client.pipeline(transaction=False) as pipe:
                pipe.lrange(key, -self.max_turns, -1)
                pipe.hgetall(meta_key)
                pipe.get(self._gone_key(tenant, session_id))
                return await pipe.execute()

        raw, meta, gone = await self.link.run(read)
        deleted_at = _float(gone)
        try:
            turns = [Turn.from_json(item) for item in raw]
            conversation = _conversation(session_id, meta, turns) if turns else None
        except (ValueError, TypeError, KeyError):
            logger.warning("discarding a malformed session %s", key)
            return None, deleted_at
        return conversation, deleted_at

    async def _shared_list(
        self, tenant: str, limit: int, local_ids: Sequence[str]
    ) -> tuple[list[Conversation], dict[str, float]]:
        """Redis's summaries of the tenant's conversations, and when those of ``local_ids`` that Redis saw
        deleted were. Raises ``RedisUnavailable``."""
        index_key = self._index_key(tenant)
        since = self._wall() - self.ttl_s
        ids: list[str] = await self.link.run(
            lambda c: c.zrevrangebyscore(index_key, "+inf", since, start=0, num=limit)  # type: ignore[arg-type, return-value]
        )

        async def read(client):  # type: ignore[no-untyped-def]
            async with client.pipeline(transaction=False) as pipe:
                for session_id in ids:
                    pipe.hgetall(self._meta_key(tenant, session_id))
                for session_id in local_ids:
                    pipe.get(self._gone_key(tenant, session_id))
                return await pipe.execute()

        replies: Sequence[Any] = await self.link.run(read) if ids or local_ids else []
        found = []
        for session_id, meta in zip(ids, replies[: len(ids)], strict=True):
            if meta:  # gone (expired) since the index was written
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    found.append(_conversation(session_id, meta, []))
        gone = {i: at for i, raw in zip(local_ids, replies[len(ids) :], strict=True) if (at := _float(raw)) is not None}
        return found, gone


def _float(raw: object) -> float | None:
    try:
        return float(raw) if raw is not None else None  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _conversation(session_id: str, meta: Mapping[str, str], turns: list[Turn]) -> Conversation:
    """A conversation from its Redis summary hash (a list written before summaries: titled by its turns)."""
    updated = float(meta.get("updated", 0.0))
    title = meta.get("title") or (turns[0].question[:TITLE_CHARS] if turns else "")
    return Conversation(
        session_id, title, float(meta.get("created", updated)), updated, int(meta.get("asked", len(turns))), turns
    )


def _newer(local: Conversation | None, shared: Conversation | None) -> Conversation | None:
    """The later written of the two copies (this process's on a tie: it wrote both, and its copy outlives a
    Redis that lost its data)."""
    if local is None or shared is None:
        return local or shared
    return local if local.updated >= shared.updated else shared
