"""Draft budget policy: which drafted nodes to verify each step, from measured costs and learned acceptance.

On a GPU verifying 64 tokens costs about as much as 1; on a CPU it does not (here, with the CPU kernels,
a verify over 8 nodes costs ~1.4x a plain step and 16 nodes ~1.9x). So each step the engine asks the
drafters for a generous candidate tree and keeps the prefix of it that maximises expected tokens per
second:

    rate(N) = (1 + sum of the N most likely nodes' acceptance probabilities) / cost(N)

- ``cost(N)``: seconds of a target forward over N + 1 tokens, calibrated at start-up for a set of sizes
  and refined by every step of exactly such a size (EMA); other sizes interpolate.
- a node's acceptance probability is the product, down its path, of P(accepted | parent accepted) for
  each node's *kind* (``DraftTree.kinds``: e.g. a retrieval path under a 6-token context seen 3 times, the
  top-1 of a logits row) at its depth (1, 2, 3+). That conditional rate is learned from every verify
  pass: engine-wide (all requests, so a new request starts from what earlier ones taught) blended with
  this request's own counts, which take over as they accumulate.

N = 0 is plain autoregressive decoding: when the drafts are not worth their cost the step verifies
nothing, so speculation is never slower than autoregressive decoding beyond the drafting time (well
under 1 ms a step). Every ``explore_every`` steps a step that would verify nothing verifies the best
two nodes anyway, so a kind whose estimate fell low gets re-measured (bounded cost: one small verify per
``explore_every`` steps).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from decoding.tree import ROOT, DraftTree

DEFAULT_BUCKETS: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass
class AcceptanceModel:
    """P(node accepted | its parent accepted) per node kind, learned from every verify of every request."""

    prior: float = 0.3  # for a kind never seen: optimistic enough to get it tried
    ema: float = 0.02  # engine-wide: slow, many requests
    _rates: dict[str, tuple[float, int]] = field(default_factory=dict)  # kind -> (rate, times tested)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def rate(self, kind: str) -> tuple[float, int]:
        return self._rates.get(kind, (self.prior, 0))

    def update(self, kind: str, accepted: bool) -> None:
        with self._lock:
            rate, n = self._rates.get(kind, (self.prior, 0))
            a = max(self.ema, 1.0 / (n + 1))  # a plain mean until 1/ema samples, then an EMA
            self._rates[kind] = ((1 - a) * rate + a * float(accepted), n + 1)

    def snapshot(self) -> dict[str, tuple[float, int]]:
        with self._lock:
            return dict(self._rates)


@dataclass
class BudgetPolicy:
    """Shared by every generation of one engine: verify costs (hardware + model) and acceptance by kind."""

    max_budget: int = 64  # candidate nodes asked from the drafters per step
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    ema: float = 0.2
    explore_every: int = 16
    cost_s: dict[int, float] = field(default_factory=dict)  # bucket -> seconds per verify forward
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.buckets = tuple(b for b in self.buckets if b <= self.max_budget) or (0,)

    def calibrate(self, measure: Callable[[int], float], sizes: Sequence[int] | None = None) -> dict[int, float]:
        """Fill ``cost_s`` with ``measure(n_nodes)`` seconds for each bucket (n_nodes + 1 tokens forward)."""
        for b in sizes or self.buckets:
            if b in self.buckets:
                self.cost_s[b] = measure(b)
        return dict(self.cost_s)

    def observe_cost(self, nodes: int, seconds: float) -> None:
        """A verify over ``nodes`` nodes took ``seconds``; refines that size's cost if it is a bucket."""
        if nodes not in self.buckets:
            return
        with self._lock:
            old = self.cost_s.get(nodes)
            self.cost_s[nodes] = seconds if old is None else (1 - self.ema) * old + self.ema * seconds

    def cost(self, nodes: int) -> float:
        """Seconds for a verify forward of ``nodes`` nodes; interpolated between measured sizes."""
        if nodes in self.cost_s:
            return self.cost_s[nodes]
        known = sorted(self.cost_s)
        if not known:
            return 1.0 + 0.03 * nodes  # neutral prior: relative units
        lo = max((k for k in known if k <= nodes), default=known[0])
        hi = min((k for k in known if k >= nodes), default=known[-1])
        if lo == hi:  # outside the measured range: grow linearly from the nearest end
            base = self.cost_s[lo]
            slope = _slope(self.cost_s, known)
            return base + slope * (nodes - lo)
        t = (nodes - lo) / (hi - lo)
        return self.cost_s[lo] + t * (self.cost_s[hi] - self.cost_s[lo])


def _slope(costs: dict[int, float], known: Sequence[int]) -> float:
    if len(known) < 2:
        return 0.03 * costs[known[0]]
    a, b = known[-2], known[-1]
    return max(0.0, (costs[b] - costs[a]) / (b - a))


@dataclass
class TreeSelector:
    """Per generation: keeps the part of each candidate tree worth verifying, and learns from the outcome."""

    policy: BudgetPolicy
    request_weight: float = 8.0  # engine-wide rate counts as this many of this request's observations
    step: int = 0
    _local: dict[str, list[float]] = field(default_factory=dict)  # kind -> [accepted, tested] this request

    def probability(self, kind: str) -> float:
        rate, _ = self.policy.acceptance.rate(kind)
        acc, tested = self._local.get(kind, (0.0, 0.0))
        w = self.request_weight
        return (acc + w * rate) / (tested + w)

    @staticmethod
    def keys(tree: DraftTree) -> list[str]:
        """Statistics key per node: its kind and depth (1, 2, 3+): once a draft is on track, it tends to stay."""
        depths = tree.depths()
        return [f"{kind}@{min(d, 3)}" for kind, d in zip(tree.kinds, depths, strict=True)]

    def node_probabilities(self, tree: DraftTree) -> list[float]:
        """P(node accepted) for every node: the product of conditional rates down its path."""
        p: list[float] = []
        for parent, key in zip(tree.parents, self.keys(tree), strict=True):
            base = 1.0 if parent == ROOT else p[parent]
            p.append(base * self.probability(key))
        return p

    def select(self, tree: DraftTree) -> DraftTree:
        """The most likely nodes (ancestors included) whose number maximises expected tokens per second."""
        self.step += 1
        if not len(tree):
            return tree
        p = self.node_probabilities(tree)
        order = sorted(range(len(tree)), key=lambda i: (-p[i], i))  # a parent never ranks below its child
        cost = self.policy.cost
        best_n, best_rate = 0, 1.0 / cost(0)
        gain = 1.0
        for n, i in enumerate(order[: self.policy.max_budget], start=1):
            gain += p[i]
            rate = gain / cost(n)
            if rate > best_rate:
                best_n, best_rate = n, rate
        if best_n == 0 and self.step % self.policy.explore_every == 0:
            best_n = min(2, len(tree))
        if best_n == len(tree):
            return tree
        return tree.subset(sorted(order[:best_n]))

    def observe(self, tree: DraftTree, accepted_nodes: Sequence[int]) -> None:
        """Every node whose parent was accepted was tested: accepted or not, it teaches its kind's rate."""
        accepted = set(accepted_nodes)
        model = self.policy.acceptance
        for i, (parent, kind) in enumerate(zip(tree.parents, self.keys(tree), strict=True)):
            if parent == ROOT or parent in accepted:
                hit = i in accepted
                stats = self._local.setdefault(kind, [0.0, 0.0])
                stats[0] += float(hit)
                stats[1] += 1.0
                model.update(kind, hit)
