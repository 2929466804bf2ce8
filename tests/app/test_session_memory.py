"""The in-process copy of conversations (a cachetools.TTLCache): its bound, its expiry and its eviction order."""

from __future__ import annotations

import asyncio

from app.serving.redis_link import RedisLink
from app.serving.sessions import SessionStore, Turn


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def questions(store: SessionStore, session: str) -> list[str]:
    return [t.question for t in asyncio.run(store.history("t", session))]


def append(store: SessionStore, session: str, question: str) -> None:
    asyncio.run(store.append("t", session, Turn(question, "a")))


def test_a_read_keeps_a_session_from_being_evicted_first() -> None:
    store = SessionStore(RedisLink(None), ttl_s=600, max_turns=4, max_sessions=2, clock=Clock())
    append(store, "s1", "q1")
    append(store, "s2", "q2")
    assert questions(store, "s1") == ["q1"]  # s1 is now the most recently used
    append(store, "s3", "q3")  # full: the least recently used session (s2) goes
    assert questions(store, "s2") == []
    assert questions(store, "s1") == ["q1"] and questions(store, "s3") == ["q3"]


def test_a_session_expires_ttl_after_its_last_write_and_a_read_does_not_extend_it() -> None:
    clock = Clock()
    store = SessionStore(RedisLink(None), ttl_s=60, max_turns=4, clock=clock)
    append(store, "s", "q1")
    clock.now += 50
    append(store, "s", "q2")  # a write restarts the session's time to live
    clock.now += 50
    assert questions(store, "s") == ["q1", "q2"]  # 100 s after the first write, 50 after the last
    clock.now += 9
    assert questions(store, "s") == ["q1", "q2"]  # reads do not extend it ...
    clock.now += 1
    assert questions(store, "s") == []  # ... it ends 60 s after the last write
    append(store, "s", "q3")
    assert questions(store, "s") == ["q3"]  # a new conversation, not the expired one continued


def test_expired_sessions_make_room_before_a_live_one_is_evicted() -> None:
    clock = Clock()
    store = SessionStore(RedisLink(None), ttl_s=60, max_turns=4, max_sessions=2, clock=clock)
    append(store, "old", "q0")
    clock.now += 30
    append(store, "live", "q1")
    assert questions(store, "old") == ["q0"]  # old is the most recently used, live the least
    clock.now += 31  # old has expired, live has not
    append(store, "new", "q2")
    assert questions(store, "live") == ["q1"] and questions(store, "new") == ["q2"]
