"""Cross-session draft cache: n-gram continuations learned from earlier answers, per tenant.

RACER's per-request automaton only knows this request's prompt and output. The shared tier remembers,
for a context of ``context_len`` tokens, which ``continuation_len``-token sequences followed it in
earlier answers of the same tenant on the same model (and, when the caller asks with
``learn_document``, in its documents: once per document key), with decayed counts. A later session (say a
related question on the same document) then gets those continuations as drafts. Tiers are never shared
across tenants (acceptance length leaks timing), nor across models or tokenizers (ids would mean
other things): a namespace is (model id, tokenizer hash, tenant).

Two stores behind one interface (``SharedTier``; each tenant gets a ``CrossSessionCache`` handle):

- ``InProcessSharedTier``: LRU dicts in this process (lost at restart).
- ``RedisSharedTier`` (redis-py): survives restarts when Redis persists. A background thread owns the
  connection; the decode loop never waits for Redis. Each decode step submits at most one *prefetch*
  (one pipelined round trip of HGETALLs, coalesced with any fetch still queued) for the contexts the next
  step may need, and reads only what has already arrived in a local mirror. ``learn`` (at the end of an
  answer) adds to the mirror's local part at once and sends one script call per 512 contexts, in the
  background; a fetch that lands meanwhile never hides those local counts. A dead
  or slow Redis (short socket timeouts) is logged once; the tier then serves from the mirror and
  retries the connection with exponential backoff.

Redis key schema (``prefix`` defaults to ``ragspec:dc``)::

    {prefix}:{ns}:c:{ctx}   HASH  field = continuation: int32 little-endian token ids (1..L tokens, the
                                  first is the token right after the context); value = decayed count
                                  (float). Field "_t" = unix time the counts were last decayed to.
                                  EXPIRE = ttl_s, refreshed on every update.
    {prefix}:{ns}:idx       ZSET  member = {ctx}, score = unix time of the context's last update. Used to
                                  sweep expired contexts and to keep at most max_contexts per namespace
                                  (oldest dropped first). EXPIRE = ttl_s.
    {prefix}:{ns}:doc:{doc} STRING "1": the n-grams of document {doc} (blake2b-64 of the caller's document
                                  key) were learned; set with NX so a document is learned once per TTL.

    ns  = "{m=<model id>;t=<tokenizer hash>;u=<sha256(tenant)[:16]>}"  (braces: a Redis Cluster hash tag,
          so one namespace lives in one slot and the update script may touch all its keys)
    ctx = blake2b-64 hex digest of the context's int32 little-endian bytes

Counts decay by half every ``half_life_s`` (applied when a context is next updated); a context keeps at
most ``max_continuations`` fields (the weakest old ones go first, so a new continuation gets in). Memory
per namespace is bounded by max_contexts × max_continuations × (4·L + ~40) bytes plus Redis overhead.
The raw tenant string is never stored (it may be an API key).
"""

from __future__ import annotations

import hashlib
import logging
import re
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

logger = logging.getLogger(__name__)

Context = tuple[int, ...]
Continuation = tuple[tuple[int, ...], float]  # (token ids, score)


@dataclass(frozen=True)
class CrossSessionConfig:
    redis_url: str | None = None  # None: in-process tier
    context_len: int = 3  # tokens of context that key a continuation set
    continuation_len: int = 8  # tokens kept per continuation (the first follows the context)
    ttl_s: float = 7 * 24 * 3600.0  # a context not updated for this long is gone
    half_life_s: float = 24 * 3600.0  # counts halve over this time
    max_contexts: int = 50_000  # per namespace (model, tokenizer, tenant)
    max_continuations: int = 8  # per context
    max_namespaces: int = 1024  # in-process tier: tenants kept (LRU)
    mirror_size: int = 16_384  # Redis tier: contexts kept in process (all namespaces)
    mirror_ttl_s: float = 30.0  # Redis tier: a mirrored context older than this is fetched again
    socket_timeout_s: float = 0.25  # Redis I/O runs in the background thread, never in the decode loop
    connect_timeout_s: float = 0.25
    retry_initial_s: float = 0.5  # first reconnection delay after a failure; doubles up to retry_max_s
    retry_max_s: float = 30.0
    max_pending: int = 64  # queued background jobs; the oldest fetches are dropped beyond it
    max_fetch_keys: int = 64  # contexts per fetch round trip
    key_prefix: str = "ragspec:dc"

    def __post_init__(self) -> None:
        if self.context_len < 1 or self.continuation_len < 2:
            raise ValueError("need context_len >= 1 and continuation_len >= 2")
        if self.max_contexts < 1 or self.max_continuations < 1:
            raise ValueError("need max_contexts >= 1 and max_continuations >= 1")
        if self.ttl_s <= 0 or self.half_life_s <= 0:
            raise ValueError("ttl_s and half_life_s must be positive")


def _safe(text: str, limit: int = 64) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:limit] or "_"


@dataclass(frozen=True)
class Namespace:
    """Whose continuations: one model + tokenizer, one tenant."""

    model_id: str
    tokenizer_hash: str
    tenant: str

    @cached_property
    def tag(self) -> str:
        tenant = hashlib.sha256(self.tenant.encode()).hexdigest()[:16]
        return f"{{m={_safe(self.model_id)};t={_safe(self.tokenizer_hash, 16)};u={tenant}}}"


def context_hash(context: Sequence[int]) -> str:
    return hashlib.blake2b(struct.pack(f"<{len(context)}i", *context), digest_size=8).hexdigest()


def encode_continuation(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def decode_continuation(raw: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(raw) // 4}i", raw)


def ngram_items(tokens: Sequence[int], start: int, context_len: int, continuation_len: int
                ) -> dict[Context, dict[tuple[int, ...], float]]:
    """Context -> {continuation: occurrences} for every context ending at position >= ``start - 1``.

    ``tokens[:start]`` is leading context only (e.g. the prompt's tail), ``tokens[start:]`` the answer.
    """
    out: dict[Context, dict[tuple[int, ...], float]] = {}
    toks = [int(t) for t in tokens]
    for i in range(max(start - 1, context_len - 1), len(toks) - 1):
        ctx = tuple(toks[i - context_len + 1 : i + 1])
        cont = tuple(toks[i + 1 : i + 1 + continuation_len])
        conts = out.setdefault(ctx, {})
        conts[cont] = conts.get(cont, 0.0) + 1.0
    return out


class CountSet:
    """One context's continuations with decayed counts (the in-process twin of the Redis hash)."""

    __slots__ = ("conts", "t", "updated")

    def __init__(self, now: float) -> None:
        self.conts: dict[tuple[int, ...], float] = {}
        self.t = now  # counts are decayed to this time
        self.updated = now

    def add(self, increments: dict[tuple[int, ...], float], now: float, half_life_s: float,
            limit: int) -> None:
        factor = 0.5 ** ((now - self.t) / half_life_s) if now > self.t else 1.0
        if factor < 0.999:
            self.conts = {c: v * factor for c, v in self.conts.items() if v * factor >= 0.01}
            self.t = now
        for c, inc in increments.items():
            self.conts[c] = self.conts.get(c, 0.0) + inc
        excess = len(self.conts) - limit
        if excess > 0:  # drop the weakest, old continuations before the ones just added
            order = sorted(self.conts, key=lambda c: (c in increments, self.conts[c]))
            for c in order[:excess]:
                del self.conts[c]
        self.updated = now

    def ranked(self) -> list[Continuation]:
        return sorted(self.conts.items(), key=lambda kv: (-kv[1], kv[0]))


class SharedTier(ABC):
    """The store behind every tenant's ``CrossSessionCache`` (one per process)."""

    remote = False  # True when ``prefetch`` does I/O (worth computing the contexts to ask for)

    def __init__(self, config: CrossSessionConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock

    def cache(self, model_id: str, tokenizer_hash: str, tenant: str) -> CrossSessionCache:
        """The handle a drafter uses for ``tenant`` (cheap; may be made per request)."""
        return CrossSessionCache(self, Namespace(model_id, tokenizer_hash, tenant))

    @abstractmethod
    def get(self, ns: Namespace, context: Context) -> list[Continuation]:
        """Continuations of ``context`` known locally now (never waits on I/O), best first."""

    @abstractmethod
    def prefetch(self, ns: Namespace, contexts: Sequence[Context]) -> None:
        """Ask for ``contexts`` to be made available locally (non-blocking)."""

    @abstractmethod
    def learn(self, ns: Namespace, items: dict[Context, dict[tuple[int, ...], float]],
              document: str | None = None) -> None:
        """Add continuation counts (non-blocking). With ``document``, only if that document (a caller's
        key) was not learned in this namespace within the TTL."""

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until queued background work is done (for tests and shutdown). True if idle."""
        return True

    def close(self) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {"backend": "in-process", "available": True}


class InProcessSharedTier(SharedTier):
    """Continuations in LRU dicts: namespaces (``max_namespaces``) × contexts (``max_contexts``)."""

    def __init__(self, config: CrossSessionConfig, clock: Callable[[], float] = time.time) -> None:
        super().__init__(config, clock)
        self._spaces: OrderedDict[str, OrderedDict[Context, CountSet]] = OrderedDict()
        self._documents: OrderedDict[tuple[str, str], float] = OrderedDict()  # -> time learned
        self._lock = threading.Lock()

    def _space(self, ns: Namespace, create: bool) -> OrderedDict[Context, CountSet] | None:
        tag = ns.tag
        space = self._spaces.get(tag)
        if space is None and create:
            space = self._spaces[tag] = OrderedDict()
            while len(self._spaces) > self.config.max_namespaces:
                self._spaces.popitem(last=False)
        if space is not None:
            self._spaces.move_to_end(tag)
        return space

    def get(self, ns: Namespace, context: Context) -> list[Continuation]:
        with self._lock:
            space = self._space(ns, create=False)
            entry = None if space is None else space.get(context)
            if entry is None:
                return []
            if self.clock() - entry.updated > self.config.ttl_s:
                del space[context]  # type: ignore[union-attr]
                return []
            return entry.ranked()

    def prefetch(self, ns: Namespace, contexts: Sequence[Context]) -> None:
        return None  # everything is local

    def learn(self, ns: Namespace, items: dict[Context, dict[tuple[int, ...], float]],
              document: str | None = None) -> None:
        cfg = self.config
        now = self.clock()
        with self._lock:
            if document is not None:
                key = (ns.tag, document)
                seen = self._documents.get(key)
                if seen is not None and now - seen <= cfg.ttl_s:
                    return
                self._documents[key] = now
                self._documents.move_to_end(key)
                while len(self._documents) > cfg.max_namespaces * 64:
                    self._documents.popitem(last=False)
            space = self._space(ns, create=True)
            assert space is not None
            for ctx, incs in items.items():
                entry = space.get(ctx)
                if entry is None or now - entry.updated > cfg.ttl_s:
                    entry = space[ctx] = CountSet(now)
                entry.add(incs, now, cfg.half_life_s, cfg.max_continuations)
                space.move_to_end(ctx)
            while len(space) > cfg.max_contexts:
                space.popitem(last=False)

    def contexts(self, ns: Namespace) -> int:
        with self._lock:
            space = self._space(ns, create=False)
            return 0 if space is None else len(space)


# KEYS[1] = index zset, KEYS[2..] = context hashes. ARGV: now, ttl, half life, max continuations,
# max contexts, context key prefix, then per context: member, n, n × (field, increment).
_LEARN_LUA = """
local now = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local half = tonumber(ARGV[3])
local max_conts = tonumber(ARGV[4])
local max_ctx = tonumber(ARGV[5])
local prefix = ARGV[6]
local a = 7
for k = 2, #KEYS do
  local key = KEYS[k]
  local member = ARGV[a]
  local n = tonumber(ARGV[a + 1])
  a = a + 2
  local t = tonumber(redis.call('HGET', key, '_t'))
  if t == nil then
    redis.call('HSET', key, '_t', tostring(now))
  elseif now > t then
    local f = math.pow(0.5, (now - t) / half)
    if f < 0.999 then
      local all = redis.call('HGETALL', key)
      for i = 1, #all, 2 do
        if all[i] ~= '_t' then
          local v = tonumber(all[i + 1]) * f
          if v < 0.01 then
            redis.call('HDEL', key, all[i])
          else
            redis.call('HSET', key, all[i], tostring(v))
          end
        end
      end
      redis.call('HSET', key, '_t', tostring(now))
    end
  end
  local fresh = {}
  for j = 1, n do
    redis.call('HINCRBYFLOAT', key, ARGV[a], ARGV[a + 1])
    fresh[ARGV[a]] = true
    a = a + 2
  end
  local excess = redis.call('HLEN', key) - 1 - max_conts
  if excess > 0 then
    local all = redis.call('HGETALL', key)
    local old, new = {}, {}
    for i = 1, #all, 2 do
      if all[i] ~= '_t' then
        local e = {all[i], tonumber(all[i + 1])}
        if fresh[all[i]] then table.insert(new, e) else table.insert(old, e) end
      end
    end
    local weaker = function(x, y) return x[2] < y[2] end
    table.sort(old, weaker)
    table.sort(new, weaker)
    for _, group in ipairs({old, new}) do
      for _, e in ipairs(group) do
        if excess <= 0 then break end
        redis.call('HDEL', key, e[1])
        excess = excess - 1
      end
    end
  end
  redis.call('EXPIRE', key, ttl)
  redis.call('ZADD', KEYS[1], now, member)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
local over = redis.call('ZCARD', KEYS[1]) - max_ctx
if over > 0 then
  local gone = redis.call('ZPOPMIN', KEYS[1], over)
  for i = 1, #gone, 2 do redis.call('DEL', prefix .. gone[i]) end
end
redis.call('EXPIRE', KEYS[1], ttl)
return redis.call('ZCARD', KEYS[1])
"""


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


@dataclass
class _Job:
    kind: str  # "fetch" | "learn"
    ns: Namespace
    contexts: list[Context] = field(default_factory=list)
    items: dict[Context, dict[tuple[int, ...], float]] = field(default_factory=dict)
    document: str | None = None


class RedisSharedTier(SharedTier):
    """Continuations in Redis (key schema in the module doc), read through an in-process mirror."""

    remote = True

    def __init__(self, config: CrossSessionConfig, clock: Callable[[], float] = time.time) -> None:
        if not config.redis_url:
            raise ValueError("RedisSharedTier needs config.redis_url")
        super().__init__(config, clock)
        self._mirror: OrderedDict[tuple[str, Context], _Mirrored] = OrderedDict()
        self._inflight: set[tuple[str, Context]] = set()
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

    def learn(self, ns: Namespace, items: dict[Context, dict[tuple[int, ...], float]],
              document: str | None = None) -> None:
        if not items:
            return
        tag = ns.tag
        with self._cv:
            if document is not None:  # documents are large: no write-through, fetched when needed
                if not self._closed:
                    self._enqueue(_Job("learn", ns, items=items, document=document))
                return
            for ctx, incs in items.items():  # write-through: this process sees it at once
                entry = self._entry((tag, ctx))
                for c, v in incs.items():
                    entry.local[c] = entry.local.get(c, 0.0) + v
                entry.rank(self.config.max_continuations)
            if not self._closed:
                self._enqueue(_Job("learn", ns, items=items))

    def _entry(self, key: tuple[str, Context]) -> _Mirrored:
        """The mirror entry of ``key`` (made if missing; LRU-bounded). Caller holds ``_cv``."""
        entry = self._mirror.get(key)
        if entry is None:
            entry = self._mirror[key] = _Mirrored()
            while len(self._mirror) > self.config.mirror_size:
                self._mirror.popitem(last=False)
        else:
            self._mirror.move_to_end(key)
        return entry

    def _enqueue(self, job: _Job) -> None:
        """Caller holds ``_cv``. Beyond ``max_pending`` the oldest queued fetch (else the oldest job) goes."""
        self._jobs.append(job)
        while len(self._jobs) > self.config.max_pending:
            victim = next((j for j in self._jobs if j.kind == "fetch"), self._jobs[0])
            self._jobs.remove(victim)
            self._forget(victim)
            self.counters["dropped"] += 1
        self._cv.notify_all()

    def _forget(self, job: _Job) -> None:
        tag = job.ns.tag
        for ctx in job.contexts:
            self._inflight.discard((tag, ctx))

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
        self._script = client.register_script(_LEARN_LUA)
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
            if job.kind == "fetch":
                self._fetch(job)
            else:
                self._learn(job)
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

    def _key(self, ns: Namespace, ctx: Context | str) -> str:
        h = ctx if isinstance(ctx, str) else context_hash(ctx)
        return f"{self.config.key_prefix}:{ns.tag}:c:{h}"

    def index_key(self, ns: Namespace) -> str:
        return f"{self.config.key_prefix}:{ns.tag}:idx"

    def context_key(self, ns: Namespace, context: Sequence[int]) -> str:
        return self._key(ns, tuple(context))

    def _fetch(self, job: _Job) -> None:
        pipe = self._client.pipeline(transaction=False)
        for ctx in job.contexts:
            pipe.hgetall(self._key(job.ns, ctx))
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

    def document_key(self, ns: Namespace, document: str) -> str:
        h = hashlib.blake2b(document.encode(), digest_size=8).hexdigest()
        return f"{self.config.key_prefix}:{ns.tag}:doc:{h}"

    def _learn(self, job: _Job) -> None:
        cfg = self.config
        if job.document is not None and not self._client.set(
            self.document_key(job.ns, job.document), b"1", nx=True, ex=int(max(1, cfg.ttl_s))
        ):
            return  # this document was learned already
        ctxs = list(job.items.items())
        prefix = f"{cfg.key_prefix}:{job.ns.tag}:c:"
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
                entry = None if job.document is not None else self._mirror.get((tag, ctx))
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


def redact_url(url: str | None) -> str:
    """A connection URL fit for a log line: the user and password replaced by ***."""
    return re.sub(r"//[^@/]*@", "//***@", url or "")


def open_shared_tier(config: CrossSessionConfig, clock: Callable[[], float] = time.time) -> SharedTier:
    """Redis when ``config.redis_url`` is set, else in process. One per process."""
    if config.redis_url:
        return RedisSharedTier(config, clock)
    return InProcessSharedTier(config, clock)


class CrossSessionCache:
    """One tenant's view of the shared tier (namespace = model id, tokenizer hash, tenant)."""

    def __init__(self, tier: SharedTier, namespace: Namespace) -> None:
        self.tier = tier
        self.namespace = namespace
        self.context_len = tier.config.context_len
        self.continuation_len = tier.config.continuation_len
        self.remote = tier.remote

    def continuations(self, context: Sequence[int]) -> list[Continuation]:
        """What is known now for the last ``context_len`` tokens of ``context`` (never waits)."""
        if len(context) < self.context_len:
            return []
        return self.tier.get(self.namespace, tuple(int(t) for t in context[-self.context_len :]))

    def prefetch(self, contexts: Iterable[Sequence[int]]) -> None:
        """Make these contexts available for later ``continuations`` calls (one background round trip)."""
        n = self.context_len
        want = [tuple(int(t) for t in c[-n:]) for c in contexts if len(c) >= n]
        if want:
            self.tier.prefetch(self.namespace, list(dict.fromkeys(want)))

    def learn(self, tokens: Sequence[int], start: int) -> int:
        """Learn the continuations in ``tokens[start:]`` (``tokens[:start]`` is leading context only).

        Returns the number of contexts sent (in the background).
        """
        items = ngram_items(tokens, start, self.context_len, self.continuation_len)
        self.tier.learn(self.namespace, items)
        return len(items)

    def learn_document(self, document: str, tokens: Sequence[int]) -> int:
        """Learn the continuations of a document's tokens, once per ``document`` key within the TTL.

        For documents whose text may help *other* prompts of the tenant (a prompt holding the document
        already has it in its own automaton). Returns the number of contexts offered (in the background).
        """
        items = ngram_items(tokens, 0, self.context_len, self.continuation_len)
        self.tier.learn(self.namespace, items, document=document)
        return len(items)
