"""Cross-session draft cache: n-gram continuations learned from a tenant's earlier answers.

RACER's retrieval path only knows this request's prompt and output. The shared tier remembers,
for a context of ``context_len`` tokens, which ``continuation_len``-token sequences followed it in
earlier answers of the same tenant on the same model, with decayed counts. A later session asking the
same question (greedy answers repeat) or one whose answer retraces an earlier one gets those
continuations as drafts. Tiers are never shared across tenants (acceptance length leaks timing), nor
across models or tokenizers (ids would mean other things): a namespace is (model id, tokenizer hash,
tenant), and the raw tenant string is never stored (it may be an API key).

Counts decay by half every ``half_life_s`` (applied when a context is next updated); a context keeps at
most ``max_continuations`` continuations (the weakest old ones go first, so a new one gets in) and a
namespace at most ``max_contexts`` contexts (least recently updated dropped first).

Beside the counts, the tier keeps each tenant's latest answers whole, per *scope* (the document or documents
they were asked over: the prompt's prefix key), at most ``max_answers`` of ``max_answer_tokens`` each: the
suffix drafter (``decoding.drafters.suffix``) finds the longest exact match of the text's end in them, so a
repeated or paraphrased question drafts long stretches of the earlier answer it retraces.

This module holds the interface (``SharedTier``; each tenant gets a ``CrossSessionCache`` handle) and the
in-process store; ``redis_tier`` holds the Redis store (``redis_schema``: its keys and update script).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

logger = logging.getLogger(__name__)

Context = tuple[int, ...]
Continuation = tuple[tuple[int, ...], float]  # (token ids, score)


@dataclass(frozen=True)
class CrossSessionConfig:
    redis_url: str | None = None  # None: in-process tier
    context_len: int = 3  # tokens of context that key a continuation set
    continuation_len: int = 16  # tokens kept per continuation (the first follows the context): a repeat drafts 15
    ttl_s: float = 7 * 24 * 3600.0  # a context not updated for this long is gone
    half_life_s: float = 24 * 3600.0  # counts halve over this time
    max_contexts: int = 50_000  # per namespace (model, tokenizer, tenant)
    max_continuations: int = 8  # per context
    max_namespaces: int = 1024  # in-process tier: tenants kept (LRU)
    max_answers: int = 32  # whole answers kept per (namespace, scope), newest first
    max_answer_tokens: int = 1024  # an answer's tokens kept (its beginning)
    max_scopes: int = 4096  # in-process tier / Redis mirror: (namespace, scope) answer lists kept (LRU)
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
        if self.max_answers < 0 or self.max_answer_tokens < 1:
            raise ValueError("need max_answers >= 0 and max_answer_tokens >= 1")


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
    def learn(self, ns: Namespace, items: dict[Context, dict[tuple[int, ...], float]]) -> None:
        """Add continuation counts (non-blocking)."""

    @abstractmethod
    def answers(self, ns: Namespace, scope: str) -> list[tuple[int, ...]]:
        """Earlier answers in ``scope`` known locally now (never waits on I/O), newest first."""

    def prefetch_answers(self, ns: Namespace, scope: str) -> None:
        """Ask for ``scope``'s answers to be made available locally (non-blocking)."""
        return None

    @abstractmethod
    def add_answer(self, ns: Namespace, scope: str, tokens: tuple[int, ...]) -> None:
        """Keep an answer (non-blocking); the oldest beyond ``max_answers`` goes."""

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
        self._answers: OrderedDict[tuple[str, str], tuple[float, list[tuple[int, ...]]]] = OrderedDict()
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

    def learn(self, ns: Namespace, items: dict[Context, dict[tuple[int, ...], float]]) -> None:
        cfg = self.config
        now = self.clock()
        with self._lock:
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

    def answers(self, ns: Namespace, scope: str) -> list[tuple[int, ...]]:
        with self._lock:
            hit = self._answers.get((ns.tag, scope))
            if hit is None:
                return []
            if self.clock() - hit[0] > self.config.ttl_s:
                del self._answers[(ns.tag, scope)]
                return []
            self._answers.move_to_end((ns.tag, scope))
            return list(hit[1])

    def add_answer(self, ns: Namespace, scope: str, tokens: tuple[int, ...]) -> None:
        cfg = self.config
        with self._lock:
            _, kept = self._answers.pop((ns.tag, scope), (0.0, []))
            self._answers[(ns.tag, scope)] = (self.clock(), [tokens[: cfg.max_answer_tokens], *kept][: cfg.max_answers])
            while len(self._answers) > cfg.max_scopes:
                self._answers.popitem(last=False)

    def contexts(self, ns: Namespace) -> int:
        with self._lock:
            space = self._space(ns, create=False)
            return 0 if space is None else len(space)


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

    def answers(self, scope: str) -> list[tuple[int, ...]]:
        """Earlier answers in ``scope`` known now (newest first; never waits)."""
        return self.tier.answers(self.namespace, scope)

    def prefetch_answers(self, scope: str) -> None:
        self.tier.prefetch_answers(self.namespace, scope)

    def add_answer(self, scope: str, tokens: Sequence[int]) -> None:
        if tokens and self.tier.config.max_answers:
            self.tier.add_answer(self.namespace, scope, tuple(int(t) for t in tokens))

    def remember(self, prompt_ids: Sequence[int], answer: Sequence[int], scope: str, counts: bool = True) -> None:
        """Keep an answer for later sessions: whole, in ``scope``'s answers, and (``counts``) as continuation
        counts after the prompt's tail (False where a drafter counted it itself: RACER's ``end``)."""
        if not answer:
            return
        self.add_answer(scope, answer)
        if counts:
            tail = list(prompt_ids[-self.context_len :])
            self.learn([*tail, *answer], len(tail))

    def learn(self, tokens: Sequence[int], start: int) -> int:
        """Learn the continuations in ``tokens[start:]`` (``tokens[:start]`` is leading context only).

        Returns the number of contexts sent (in the background).
        """
        items = ngram_items(tokens, start, self.context_len, self.continuation_len)
        self.tier.learn(self.namespace, items)
        return len(items)
