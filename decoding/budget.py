"""Draft budget policy: how many tree nodes to verify per step, from measured costs and acceptance.

On a GPU verifying 64 tokens costs about as much as 1; on a CPU a 16-token verify costs ~2x a 1-token
step. So the node budget is chosen per step to maximise expected tokens per second:

    rate(N) = (1 + E[accepted | N]) / (cost(N) + draft_time)

``cost(N)`` is the seconds of a target forward over N + 1 tokens, calibrated at start-up and refined by
every measured step (EMA per size bucket). ``E[accepted | N]`` is an EMA of accepted tokens per step for
each bucket tried. Buckets never tried borrow an optimistic estimate, and every bucket is re-explored
now and then, so a drafter that starts paying later is noticed. N = 0 is plain autoregressive decoding:
when drafts do not pay for themselves the policy falls back to it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

DEFAULT_BUCKETS: tuple[int, ...] = (0, 2, 4, 8, 16, 32, 64)


@dataclass
class BudgetPolicy:
    """Shared by every generation of one engine (costs are properties of the hardware + model)."""

    max_budget: int = 64
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    ema: float = 0.2
    explore_every: int = 16  # steps between re-exploring a neighbouring bucket
    cost_s: dict[int, float] = field(default_factory=dict)  # bucket -> seconds per verify forward
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
        b = self.bucket_of(nodes)
        with self._lock:
            old = self.cost_s.get(b)
            self.cost_s[b] = seconds if old is None else (1 - self.ema) * old + self.ema * seconds

    def bucket_of(self, nodes: int) -> int:
        for b in self.buckets:
            if nodes <= b:
                return b
        return self.buckets[-1]

    def cost(self, bucket: int) -> float:
        """Seconds for a verify forward of ``bucket`` nodes; interpolated when not measured yet."""
        if bucket in self.cost_s:
            return self.cost_s[bucket]
        known = sorted(self.cost_s)
        if not known:
            return 1.0 + 0.03 * bucket  # neutral prior: relative units
        lo = max((k for k in known if k <= bucket), default=known[0])
        hi = min((k for k in known if k >= bucket), default=known[-1])
        if lo == hi:
            base = self.cost_s[lo]
            return base * (1.0 + 0.03 * abs(bucket - lo))
        t = (bucket - lo) / (hi - lo)
        return self.cost_s[lo] + t * (self.cost_s[hi] - self.cost_s[lo])


@dataclass
class BudgetState:
    """Per-generation acceptance estimates (acceptance depends on the request, costs do not)."""

    policy: BudgetPolicy
    accepted_ema: dict[int, float] = field(default_factory=dict)
    tried: dict[int, int] = field(default_factory=dict)
    step: int = 0
    draft_time_ema: float = 0.0

    def choose(self) -> int:
        """Node budget for the next step."""
        self.step += 1
        buckets = self.policy.buckets
        best, best_rate = 0, -1.0
        for b in buckets:
            rate = self.expected_rate(b)
            if rate > best_rate:
                best, best_rate = b, rate
        # Exploration: periodically probe the next bucket up (cheap information; bounded loss).
        if self.step % self.policy.explore_every == 0:
            i = buckets.index(best)
            if i + 1 < len(buckets):
                return buckets[i + 1]
        return best

    def expected_accepted(self, bucket: int) -> float:
        if bucket == 0:
            return 0.0
        if bucket in self.accepted_ema:
            return self.accepted_ema[bucket]
        # Untried: optimistic. Acceptance grows with the budget and never exceeds it, so a smaller bucket
        # is estimated from the nearest larger tried one (capped by its size), a larger one from the
        # nearest smaller tried one plus a little; with nothing tried, a prior.
        larger = [b for b in self.accepted_ema if b > bucket]
        if larger:
            return min(self.accepted_ema[min(larger)], float(bucket))
        smaller = [b for b in self.accepted_ema if 0 < b < bucket]
        if smaller:
            b0 = max(smaller)
            return self.accepted_ema[b0] + 0.25 * math.log2(bucket / b0)
        return 0.5 * math.log2(1 + bucket)

    def expected_rate(self, bucket: int) -> float:
        draft = self.draft_time_ema if bucket else 0.0
        return (1.0 + self.expected_accepted(bucket)) / (self.policy.cost(bucket) + draft)

    def observe(self, budget: int, drafted: int, accepted: int, draft_s: float) -> None:
        """Record one step: the budget asked for, nodes actually drafted, accepted count, drafting time."""
        if budget == 0:
            return
        b = self.policy.bucket_of(budget)
        a = self.policy.ema
        old = self.accepted_ema.get(b)
        self.accepted_ema[b] = accepted if old is None else (1 - a) * old + a * accepted
        self.tried[b] = self.tried.get(b, 0) + 1
        self.draft_time_ema = draft_s if self.step <= 1 else (1 - a) * self.draft_time_ema + a * draft_s
