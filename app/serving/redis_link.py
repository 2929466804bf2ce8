"""A Redis connection that may go away: calls fail fast while it is down, a monitor reconnects.

Every user of Redis in the service has an in-process fallback; this class only says whether Redis is
usable right now and runs commands with short timeouts, never blocking a request for long.

redis-py does the connection work: its pool opens connections on demand and replaces broken ones, and its
``Retry`` retries a command once, at once, on a fresh connection when the pooled one was closed under it
(Redis restarted, or dropped the idle client after its ``timeout``), so that case costs no request its
Redis answer. Only connection errors are retried: a timeout means Redis is slow or hung, and a retry would
double the wait. What redis-py does not give, and this class adds: a state for /readyz and metrics, and
failing fast without touching the network for ``retry_every_s`` after a failure (a plain redis-py client
tries every command, each paying the socket timeout while Redis hangs; its circuit breakers belong to
``MultiDBClient``, failover across several databases, and need pybreaker), with a monitor that pings so the
state comes back without waiting for traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

T = TypeVar("T")
RedisState = Literal["disabled", "up", "down"]


class RedisUnavailable(Exception):  # noqa: N818
    """Redis is configured but not reachable now; callers use their in-process fallback."""


class RedisLink:
    def __init__(self, url: str | None, timeout_s: float = 0.5, retry_every_s: float = 1.0) -> None:
        self.url = url
        self.retry_every_s = retry_every_s
        self._client: aioredis.Redis | None = None
        if url:
            self._client = aioredis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
                decode_responses=True,
            )
        self._up = False
        self._next_try = 0.0
        self._monitor: asyncio.Task[None] | None = None
        self.failures = 0

    @property
    def where(self) -> str:
        """Where Redis is, fit for a log line: from the parsed URL, so no credential can be in it."""
        if self._client is None:
            return "nowhere (not configured)"
        kwargs = self._client.connection_pool.connection_kwargs
        credentials = "***@" if kwargs.get("username") or kwargs.get("password") else ""
        if kwargs.get("path"):
            return f"unix://{credentials}{kwargs['path']}?db={kwargs.get('db', 0)}"
        scheme = urlsplit(self.url or "").scheme or "redis"
        return f"{scheme}://{credentials}{kwargs.get('host')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"

    @property
    def state(self) -> RedisState:
        if self._client is None:
            return "disabled"
        return "up" if self._up else "down"

    def _mark_down(self, exc: BaseException) -> None:
        if self._up:
            logger.warning("redis unavailable (%s); using in-process fallbacks", exc)
        self._up = False
        self.failures += 1
        self._next_try = time.monotonic() + self.retry_every_s

    async def run(self, command: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
        """Run ``command`` on the client, or raise ``RedisUnavailable`` (fast while Redis is known down)."""
        if self._client is None:
            raise RedisUnavailable("redis is not configured")
        if not self._up and time.monotonic() < self._next_try:
            raise RedisUnavailable("redis is down")
        try:
            result = await command(self._client)
        except (TimeoutError, RedisError, OSError) as exc:
            self._mark_down(exc)
            raise RedisUnavailable(str(exc)) from exc
        if not self._up:
            logger.info("redis is reachable at %s", self.where)
        self._up = True
        return result

    async def ping(self) -> bool:
        if self._client is None:
            return False
        self._next_try = 0.0  # a health check always tries
        try:
            await self.run(lambda c: c.ping())  # type: ignore[arg-type, return-value]
        except RedisUnavailable:
            return False
        return True

    async def _watch(self, every_s: float) -> None:
        while True:
            await self.ping()
            await asyncio.sleep(every_s)

    def start_monitor(self, every_s: float = 1.0) -> None:
        if self._client is not None and self._monitor is None:
            self._monitor = asyncio.create_task(self._watch(every_s), name="redis-monitor")

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()
