"""Document-affine routing: each request goes to the replica that holds its documents' KV, within a load cap.

The prompt is built server-side, so the prefix a request can reuse is named by its documents (``prefix_key`` of the
document set), not by its text: routing keys on that, and a follow-up in a session, asking about the same documents,
reaches the same replica. The policy is consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam,
2018): every replica owns ``vnodes`` points on a hash ring; a key goes to the first replica clockwise from the key's
point whose load is below ``ceil(load_factor * (total load + 1) / replicas)``. A hot document spills to the next
replicas along the ring, always the same ones, whose caches then warm to it too, instead of anywhere; a replica
added or gone moves only the keys it owned. Since the cap is above the mean load, some replica is always below it.

``bench/routing.py`` compares this with random, least-loaded and unbounded hashing on a simulated cluster; why the
defaults (``DEFAULT_LOAD_FACTOR``, ``DEFAULT_VNODES``) are what they are: docs/benchmarks.md, Routing.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Mapping, Sequence

DEFAULT_LOAD_FACTOR = 1.5
DEFAULT_VNODES = 64


def routing_key(document_ids: Sequence[str], tenant: str = "") -> str:
    """The key a request routes by: its tenant and its set of documents (order and repeats do not matter); the
    empty set (a question without documents) has a key too, so such requests spread by load alone."""
    return tenant + "\0" + "\0".join(sorted(set(document_ids)))


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class AffinityRouter:
    """Consistent hashing with bounded loads over a set of named replicas (see the module's docstring)."""

    def __init__(self, replicas: Sequence[str], load_factor: float = DEFAULT_LOAD_FACTOR,
                 vnodes: int = DEFAULT_VNODES, floor: int = 0) -> None:
        """``floor``: requests a replica takes whatever the others hold (a batching replica's slots: below them
        nothing waits, so sending a request elsewhere would only cost it the cached prefix)."""
        if load_factor <= 1.0:
            raise ValueError(f"load_factor must be above 1 (a cap above the mean load), got {load_factor}")
        if vnodes < 1:
            raise ValueError(f"vnodes must be at least 1, got {vnodes}")
        self.load_factor = load_factor
        self.vnodes = vnodes
        self.floor = floor
        self._points: list[int] = []
        self._owners: list[str] = []
        self.replicas: tuple[str, ...] = ()
        self.set_replicas(replicas)

    def set_replicas(self, replicas: Sequence[str]) -> None:
        """The replicas now (one joined, one gone): only the keys of those that changed move."""
        names = tuple(dict.fromkeys(replicas))
        if not names:
            raise ValueError("a router needs at least one replica")
        ring = sorted((_point(f"{name}#{v}"), name) for name in names for v in range(self.vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [name for _, name in ring]
        self.replicas = names

    def cap(self, total_load: int) -> int:
        """The most requests a replica may hold before the next one along the ring takes a key's request."""
        return max(self.floor, math.ceil(self.load_factor * (total_load + 1) / len(self.replicas)))

    def owner(self, key: str) -> str:
        """The replica that owns ``key`` (where its requests go while it is under the cap)."""
        return self._owners[bisect.bisect_left(self._points, _point(key)) % len(self._owners)]

    def owners(self, key: str) -> list[str]:
        """The replicas in the order a key's request tries them: its owner first, then along the ring."""
        start = bisect.bisect_left(self._points, _point(key))
        seen: dict[str, None] = {}
        for i in range(len(self._owners)):
            seen.setdefault(self._owners[(start + i) % len(self._owners)], None)
            if len(seen) == len(self.replicas):
                break
        return list(seen)

    def route(self, key: str, loads: Mapping[str, int], total: int | None = None) -> str:
        """The replica for a request with ``key``, given each replica's requests in flight (missing: 0) and, when
        the caller keeps it, their sum."""
        cap = self.cap(sum(loads.get(name, 0) for name in self.replicas) if total is None else total)
        start = bisect.bisect_left(self._points, _point(key))
        n = len(self._owners)
        for i in range(n):
            name = self._owners[(start + i) % n]
            if loads.get(name, 0) < cap:
                return name
        raise AssertionError("unreachable: the cap is above the mean load")  # pragma: no cover
