"""The cross-session tier in Redis (redis-py), read through an in-process mirror; the decode loop never waits.

A background thread owns the connection. Each decode step submits at most one *prefetch* (one pipelined
round trip of HGETALLs, coalesced with any fetch still queued) for the contexts the next step may need,
and reads only what has already arrived in the mirror (a scope's earlier answers likewise: ``prefetch_answers``
at the start of a request, ``answers`` reads the mirror). ``learn`` (at the end of an answer) adds to the
mirror's local part at once and sends one script call per 512 contexts in the background; a fetch that
lands meanwhile never hides those local counts. A dead or slow Redis (short socket timeouts) is logged
once; the tier then serves from the mirror and retries the connection with exponential backoff. Keys and
the update script: ``redis_schema``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from decoding.drafters.racer.cross_session import (
    Context,
    Continuation,
    CrossSessionConfig,
    InProcessSharedTier,
    Namespace,
    SharedTier,
)
from decoding.drafters.racer.redis_schema import (
    LEARN_LUA,
    answers_key,
    context_hash,
    context_prefix,
    decode_continuation,
    encode_continuation,
    index_key,
    redact_url,
)

logger = logging.getLogger(__name__)
K = TypeVar("K")
V = TypeVar("V")


class _Mirrored:
    """A context as this process knows it: what Redis returned, plus increments Redis has not confirmed."""

    __slots__ = ("fetched_at", "local", "ranked", "remote")

    def __init__(self) -> None:
        self.fetched_at = 0.0  # monotonic time of the last fetch (0: never fetched)
        self.remote: dict[tuple[int, ...], float] = {}
        self.local: dict[tuple[int, ...], float] = {}
        self.ranked: list[Continuation] = []

    def rank(self, limit: int) -> None:
        merged = dict(self.remote)
        for c, v in self.local.items():
            merged[c] = merged.get(c, 0.0) + v
        self.ranked = sorted(merged.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]


class _Answers:
    """A scope's answers as this process knows them: what Redis returned, plus ones not confirmed yet."""

    __slots__ = ("fetched_at", "local", "remote")

    def __init__(self) -> None:
        self.fetched_at = 0.0  # monotonic time of the last fetch (0: never fetched)
        self.remote: list[tuple[int, ...]] = []
        self.local: list[tuple[int, ...]] = []  # added here, newest first, not yet confirmed by Redis


def _lru_entry(table: OrderedDict[K, V], key: K, make: Callable[[], V], limit: int) -> V:
    """``table[key]``, made by ``make`` if missing (the least recently used entries dropped beyond ``limit``),
    and marked most recently used."""
    entry = table.get(key)
    if entry is None:
        entry = table[key] = make()
        while len(table) > limit:
            table.popitem(last=False)
    else:
        table.move_to_end(key)
    return entry


@dataclass
class _Job:
    kind: str  # "fetch" | "learn" | "answers" (fetch a scope's) | "answer" (push one)
    ns: Namespace
    contexts: list[Context] = field(default_factory=list)
    items: dict[Context, dict[tuple[int, ...], float]] = field(default_factory=dict)
    scope: str = ""
    answer: tuple[int, ...] = ()


class RedisSharedTier(SharedTier):
    """Continuations in Redis (key schema in the module doc), read through an in-process mirror."""

    remote = True

    def __init__(self, config: CrossSessionConfig, clock: Callable[[], float] = time.time) -> None:
        if not config.redis_url:
            raise ValueError("RedisSharedTier needs config.redis_url")
        super().__init__(config, clock)
        self._mirror: OrderedDict[tuple[str, Context], _Mirrored] = OrderedDict()
        self._inflight: set[tuple[str, Context]] = set()
        self._answers: OrderedDict[tuple[str, str], _Answers] = OrderedDict()
        self._answers_inflight: set[tuple[str, str]] = set()
        self._jobs: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._client: Any = None
        self._script: Any = None
        self._down = False
        self._retry_at = 0.0
        self._backoff = config.retry_initial_s
        self.counters = {"fetches": 0, "fetched_contexts": 0, "learns": 0, "errors": 0, "dropped": 0}
        self._thread = threading.Thread(target=self._work, name="racer-shared-tier", daemon=True)
        self._thread.start()

    # ---- decode-loop side (never blocks on I/O) ----------------------------------------------------

    def get(self, ns: Namespace, context: Context) -> list[Continuation]:
        with self._cv:
            hit = self._mirror.get((ns.tag, context))
            if hit is None:
                return []
            self._mirror.move_to_end((ns.tag, context))
            return hit.ranked

    def prefetch(self, ns: Namespace, contexts: Sequence[Context]) -> None:
        tag = ns.tag
        now = time.monotonic()
        with self._cv:
            if self._closed or (self._down and now < self._retry_at):
                return
            want = []
            for ctx in contexts:
                key = (tag, ctx)
                hit = self._mirror.get(key)
                if key in self._inflight or (hit is not None and now - hit.fetched_at < self.config.mirror_ttl_s):
                    continue
                want.append(ctx)
                self._inflight.add(key)
                if len(want) >= self.config.max_fetch_keys:
                    break
            if not want:
                return
            last = self._jobs[-1] if self._jobs else None
            if last is not None and last.kind == "fetch" and last.ns == ns and \
                    len(last.contexts) + len(want) <= self.config.max_fetch_keys:
                last.contexts.extend(want)  # coalesce: still one round trip
            else:
                self._enqueue(_Job("fetch", ns, contexts=want))

    def learn(self, ns: Namespace, items: dict[Context, dict[tuple[int, ...], float]]) -> None:
        if not items:
            return
        tag = ns.tag
        with self._cv:
            for ctx, incs in items.items():  # write-through: this process sees it at once
                entry = self._entry((tag, ctx))
                for c, v in incs.items():
                    entry.local[c] = entry.local.get(c, 0.0) + v
                entry.rank(self.config.max_continuations)
            if not self._closed:
                self._enqueue(_Job("learn", ns, items=items))

    def answers(self, ns: Namespace, scope: str) -> list[tuple[int, ...]]:
        with self._cv:
            hit = self._answers.get((ns.tag, scope))
            if hit is None:
                return []
            self._answers.move_to_end((ns.tag, scope))
            return [*hit.local, *(a for a in hit.remote if a not in hit.local)][: self.config.max_answers]

    def prefetch_answers(self, ns: Namespace, scope: str) -> None:
        key, now = (ns.tag, scope), time.monotonic()
        with self._cv:
            if self._closed or (self._down and now < self._retry_at) or key in self._answers_inflight:
                return
            hit = self._answers.get(key)
            if hit is not None and now - hit.fetched_at < self.config.mirror_ttl_s:
                return
            self._answers_inflight.add(key)
            self._enqueue(_Job("answers", ns, scope=scope))

    def add_answer(self, ns: Namespace, scope: str, tokens: tuple[int, ...]) -> None:
        tokens = tokens[: self.config.max_answer_tokens]
        with self._cv:
            entry = self._answer_entry((ns.tag, scope))
            entry.local.insert(0, tokens)  # write-through: this process drafts from it at once
            if not self._closed:
                self._enqueue(_Job("answer", ns, scope=scope, answer=tokens))

    def _answer_entry(self, key: tuple[str, str]) -> _Answers:
        """The mirror entry of a scope's answers (made if missing; LRU-bounded). Caller holds ``_cv``."""
        return _lru_entry(self._answers, key, _Answers, self.config.max_scopes)

    def _entry(self, key: tuple[str, Context]) -> _Mirrored:
        """The mirror entry of ``key`` (made if missing; LRU-bounded). Caller holds ``_cv``."""
        return _lru_entry(self._mirror, key, _Mirrored, self.config.mirror_size)

    def _enqueue(self, job: _Job) -> None:
        """Caller holds ``_cv``. Beyond ``max_pending`` the oldest queued fetch (else the oldest job) goes."""
        self._jobs.append(job)
        while len(self._jobs) > self.config.max_pending:
            victim = next((j for j in self._jobs if j.kind in ("fetch", "answers")), self._jobs[0])
            self._jobs.remove(victim)
            self._forget(victim)
            self.counters["dropped"] += 1
        self._cv.notify_all()

    def _forget(self, job: _Job) -> None:
        tag = job.ns.tag
        for ctx in job.contexts:
            self._inflight.discard((tag, ctx))
        if job.kind == "answers":
            self._answers_inflight.discard((tag, job.scope))

    # ---- background worker -------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                self._execute(job)
            except Exception:  # never let the worker die; the decode loop does not depend on it
                logger.exception("cross-session cache: unexpected error")
            finally:
                with self._cv:
                    self._forget(job)
                    self._busy = False
                    self._cv.notify_all()

    def _connect(self) -> Any:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis.from_url(
            self.config.redis_url,  # type: ignore[arg-type]
            socket_timeout=self.config.socket_timeout_s,
            socket_connect_timeout=self.config.connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._script = client.register_script(LEARN_LUA)
        return client

    def _execute(self, job: _Job) -> None:
        import redis

        if self._down and time.monotonic() < self._retry_at:
            with self._cv:
                self.counters["dropped"] += 1
            return
        try:
            if self._client is None:
                self._client = self._connect()
            {"fetch": self._fetch, "learn": self._learn, "answers": self._fetch_answers,
             "answer": self._push_answer}[job.kind](job)
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return
        if self._down:
            logger.info("cross-session cache: Redis reachable again at %s", redact_url(self.config.redis_url))
            self._down = False
            self._backoff = self.config.retry_initial_s

    def _failed(self, exc: Exception) -> None:
        with self._cv:
            self.counters["errors"] += 1
        if not self._down:
            logger.warning(
                "cross-session cache: Redis at %s unavailable (%s); drafting from the local tiers, "
                "retrying in %.1fs",
                redact_url(self.config.redis_url), exc, self._backoff,
            )
        else:
            logger.debug("cross-session cache: Redis still unavailable (%s)", exc)
        self._down = True
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.config.retry_max_s)
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a broken connection may fail too; it is gone either way
                logger.debug("closing the Redis client failed", exc_info=True)

    def index_key(self, ns: Namespace) -> str:
        return index_key(self.config.key_prefix, ns.tag)

    def context_key(self, ns: Namespace, context: Sequence[int]) -> str:
        return context_prefix(self.config.key_prefix, ns.tag) + context_hash(context)

    def _fetch(self, job: _Job) -> None:
        pipe = self._client.pipeline(transaction=False)
        for ctx in job.contexts:
            pipe.hgetall(self.context_key(job.ns, ctx))
        replies = pipe.execute()  # one round trip
        now = time.monotonic()
        tag = job.ns.tag
        with self._cv:
            self.counters["fetches"] += 1
            self.counters["fetched_contexts"] += len(job.contexts)
            for ctx, reply in zip(job.contexts, replies, strict=True):
                entry = self._entry((tag, ctx))
                entry.remote = {decode_continuation(f): float(v) for f, v in reply.items() if f != b"_t"}
                entry.fetched_at = now
                entry.rank(self.config.max_continuations)

    def _learn(self, job: _Job) -> None:
        cfg = self.config
        ctxs = list(job.items.items())
        prefix = context_prefix(cfg.key_prefix, job.ns.tag)
        for start in range(0, len(ctxs), 512):
            keys = [self.index_key(job.ns)]
            args: list[Any] = [repr(self.clock()), int(max(1, cfg.ttl_s)), cfg.half_life_s,
                               cfg.max_continuations, cfg.max_contexts, prefix]
            for ctx, incs in ctxs[start : start + 512]:
                h = context_hash(ctx)
                keys.append(prefix + h)
                args.extend([h, len(incs)])
                for cont, inc in incs.items():
                    args.extend([encode_continuation(cont), repr(float(inc))])
            self._script(keys=keys, args=args, client=self._client)
        with self._cv:
            self.counters["learns"] += 1
            tag = job.ns.tag
            for ctx, incs in job.items.items():  # confirmed: from the local part to the remote part
                entry = self._mirror.get((tag, ctx))
                if entry is None:
                    continue
                for c, v in incs.items():
                    left = entry.local.get(c, 0.0) - v
                    if left > 1e-9:
                        entry.local[c] = left
                    else:
                        entry.local.pop(c, None)
                    entry.remote[c] = entry.remote.get(c, 0.0) + v
                entry.rank(self.config.max_continuations)

    def _fetch_answers(self, job: _Job) -> None:
        raw = self._client.lrange(answers_key(self.config.key_prefix, job.ns.tag, job.scope), 0,
                                  self.config.max_answers - 1)
        with self._cv:
            entry = self._answer_entry((job.ns.tag, job.scope))
            entry.remote = [decode_continuation(r) for r in raw]
            entry.fetched_at = time.monotonic()

    def _push_answer(self, job: _Job) -> None:
        key = answers_key(self.config.key_prefix, job.ns.tag, job.scope)
        pipe = self._client.pipeline(transaction=True)
        pipe.lpush(key, encode_continuation(job.answer))
        pipe.ltrim(key, 0, self.config.max_answers - 1)
        pipe.expire(key, int(max(1, self.config.ttl_s)))
        pipe.execute()
        with self._cv:  # confirmed: from the local part to the remote part
            entry = self._answer_entry((job.ns.tag, job.scope))
            if job.answer in entry.local:
                entry.local.remove(job.answer)
            entry.remote = [job.answer, *entry.remote][: self.config.max_answers]

    def drain(self, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5.0)
        if self._client is not None:
            self._client.close()
            self._client = None

    def status(self) -> dict[str, Any]:
        with self._cv:
            return {"backend": "redis", "available": not self._down, "queued": len(self._jobs),
                    "mirrored": len(self._mirror), **self.counters}


def open_shared_tier(config: CrossSessionConfig, clock: Callable[[], float] = time.time) -> SharedTier:
    """Redis when ``config.redis_url`` is set, else in process. One per process."""
    if config.redis_url:
        return RedisSharedTier(config, clock)
    return InProcessSharedTier(config, clock)
