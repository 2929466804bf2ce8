"""Draft budget policy: which drafted nodes to verify each step, from measured costs and learned acceptance.

On a GPU a verify over many tokens costs little more than over one; on a CPU it does not (every extra row
of a verify costs its own arithmetic in the linear layers and in attention over the whole cache; docs/benchmarks.md
has the measured curve). So each step the engine asks the drafters for a generous candidate tree and keeps the
prefix of it that maximises expected tokens per second:

    rate(N) = (1 + sum of the N most likely nodes' acceptance probabilities) / cost(N)

- ``cost(N, L)``: seconds of a target forward over N + 1 tokens on an L-token cache. Calibrated at
  start-up for a set of sizes at two cache lengths: on a CPU attention makes the extra tokens of a verify
  cost more the longer the document, so one table for every request would over-draft long documents and
  under-draft short ones. Per size: a base at the reference length plus a growth per cache
  token (a line in the size, fitted over all sizes: attention's cost grows with the tokens forwarded);
  every step of exactly such a size refines the base (the median of its latest timings, each moved to the
  reference length along the slope); other sizes interpolate.
- a node's acceptance probability is the product, down its path, of P(accepted | parent accepted) for
  each node's *kind* (``DraftTree.kinds``: e.g. a retrieval path under a 6-token context seen 3 times, the
  top-1 of a logits row) at its depth (1, 2, 3+). That conditional rate is learned from every verify
  pass: engine-wide (all requests, so a new request starts from what earlier ones taught) blended with
  this request's own counts, which take over as they accumulate.

N = 0 is plain autoregressive decoding: when the drafts are not worth their cost the step verifies
nothing, so speculation is never slower than autoregressive decoding beyond the drafting time. Every
``explore_every`` steps a step that would verify nothing verifies the best two nodes anyway, so a kind
whose estimate fell low gets re-measured (bounded cost: one small verify per ``explore_every`` steps); and
a first-level node of a kind the engine has never verified is always added once, so a new source (e.g. the
cross-session tier's first continuation) is measured rather than judged by the prior alone.
"""

from __future__ import annotations

import bisect
import math
import statistics
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from decoding.speculative.tree import ROOT, DraftTree

DEFAULT_BUCKETS: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
OBSERVED_WINDOW = 31  # a size's latest verify timings kept per band of cache lengths (``BudgetPolicy.observe_cost``)
OBSERVED_MIN = 8  # timings of a size before their median replaces its calibrated cost in that band


def cache_band(context: int | None) -> int:
    """The band of cache lengths whose verify timings are kept together: within a factor of two (0: unknown)."""
    return 0 if context is None else max(context, 1).bit_length()


@dataclass
class AcceptanceModel:
    """P(node accepted | its parent accepted) per node kind, learned from every verify of every request.

    A kind starts from its prior: the drafter's own expectation where it states one (``seed``: e.g. a long
    exact match of the document is likely right), else ``prior``; the prior counts as ``prior_weight``
    observations, so the first few verdicts move it without wiping it out."""

    prior: float = 0.3  # for a kind never seen and no drafter's prior: optimistic enough to get it tried
    ema: float = 0.02  # engine-wide: slow, many requests
    prior_weight: float = 2.0
    _rates: dict[str, tuple[float, int]] = field(default_factory=dict)  # kind -> (rate, times tested)
    _priors: dict[str, float] = field(default_factory=dict)  # kind -> a drafter's stated prior
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def rate(self, kind: str) -> tuple[float, int]:
        return self._rates.get(kind) or (self._priors.get(kind, self.prior), 0)

    def seed(self, priors: dict[str, float]) -> None:
        """Drafters' priors for their kinds (a kind already learned keeps what it learned)."""
        if any(self._priors.get(k) != v for k, v in priors.items()):
            with self._lock:
                self._priors.update(priors)

    def update(self, kind: str, accepted: bool) -> None:
        with self._lock:
            rate, n = self.rate(kind)
            a = max(self.ema, 1.0 / (n + 1 + self.prior_weight))  # a mean (prior included), then an EMA
            self._rates[kind] = ((1 - a) * rate + a * float(accepted), n + 1)

    def snapshot(self) -> dict[str, tuple[float, int]]:
        with self._lock:
            return dict(self._rates)


@dataclass
class BudgetPolicy:
    """Shared by every generation of one engine: verify costs (hardware + model) and acceptance by kind."""

    max_budget: int = 64  # candidate nodes asked from the drafters per step
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    explore_every: int = 16
    cost_s: dict[int, float] = field(default_factory=dict)  # bucket -> seconds per verify forward at cost_context
    cost_context: int | None = None  # the cache length cost_s refers to (None: context-free costs)
    cost_slope: dict[int, float] = field(default_factory=dict)  # bucket -> extra seconds per cache token
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    served_context: int = 0  # the longest cache a verify step has run on (``observe_cost``)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _calibrated: dict[int | None, dict[int, float]] = field(default_factory=dict, repr=False)
    _observed: dict[tuple[int, int], deque[float]] = field(default_factory=dict, repr=False)  # (band, size) -> timings
    _observed_cost: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)  # (band, size) -> median

    def __post_init__(self) -> None:
        self.buckets = tuple(b for b in self.buckets if b <= self.max_budget) or (0,)

    def calibrate(self, measure: Callable[[int], float], sizes: Sequence[int] | None = None,
                  context: int | None = None) -> dict[int, float]:
        """Record ``measure(n_nodes)`` seconds for each bucket (n_nodes + 1 tokens forward) on a ``context``-token
        cache. Once two cache lengths are calibrated, costs follow the cache length: ``cost_s`` holds them
        at the longer one, ``cost_slope`` the growth per token in between. Returns ``cost_s``."""
        times = {b: measure(b) for b in (sizes or self.buckets) if b in self.buckets}
        ceiling = math.inf
        for b in sorted(times, reverse=True):  # a size costs no more than any larger one (it could be padded to
            times[b] = ceiling = min(ceiling, times[b])  # it): a size above a larger one met a burst of load
        with self._lock:
            self._calibrated.setdefault(context, {}).update(times)
            lengths = sorted(c for c in self._calibrated if c is not None)
            if context is None or len(lengths) < 2:
                self.cost_s.update(times)
                self.cost_context = context if context is not None else self.cost_context
                return dict(self.cost_s)
            lo, hi = lengths[0], lengths[-1]
            short, long_ = self._calibrated[lo], self._calibrated[hi]
            self.cost_context = hi
            self.cost_s.update(long_)
            both = [b for b in long_ if b in short]
            s0, s1 = _line(both, [(long_[b] - short[b]) / (hi - lo) for b in both])
            self.cost_slope = {b: max(0.0, s0 + s1 * b) for b in self.buckets}
            return dict(self.cost_s)

    def observe_cost(self, nodes: int, seconds: float, context: int | None = None) -> None:
        """A verify over ``nodes`` nodes on a ``context``-token cache took ``seconds``; refines that size's cost
        in the cache length's band (``cache_band``) if it is a bucket: the timing joins the size's last
        ``OBSERVED_WINDOW`` there, whose median replaces the calibrated cost in that band once there are
        ``OBSERVED_MIN`` of them (``costs``). A median moves little for a burst of load elsewhere on the machine
        (a moving mean drifted: a size it had made look dear was seldom verified again, so it stayed dear). Kept
        per band, not moved to one reference length along the calibrated growth: that line, fitted to short
        caches, need not be how a verify's rows grow on long ones, and timings moved along it skewed the costs of
        short caches after long documents (docs/benchmarks.md#decoding). Every step's cache length is recorded:
        ``calibration_due`` compares the longest with the calibrated ones."""
        if context is not None and context > self.served_context:
            with self._lock:
                self.served_context = max(self.served_context, context)
        if nodes not in self.buckets:
            return
        key = (cache_band(context), nodes)
        with self._lock:
            seen = self._observed.setdefault(key, deque(maxlen=OBSERVED_WINDOW))
            seen.append(seconds)
            if len(seen) >= OBSERVED_MIN or nodes not in self.cost_s:
                self._observed_cost[key] = statistics.median(seen)

    def calibrated_contexts(self) -> list[int]:
        """The cache lengths measured by ``calibrate`` so far, shortest first."""
        with self._lock:
            return sorted(c for c in self._calibrated if c is not None)

    def calibration_due(self, ratio: float = 1.5) -> int | None:
        """The cache length to calibrate at next, if requests have run on caches more than ``ratio`` times
        the longest calibrated one: beyond it costs are extrapolated along a line fitted to shorter caches,
        which a GPU's cost curve (flat, then growing with the cache) does not follow. None while the
        served lengths stay within reach, or before any calibration (none is wanted then)."""
        with self._lock:
            lengths = [c for c in self._calibrated if c is not None]
            if not lengths or self.served_context <= ratio * max(lengths):
                return None
            return self.served_context

    def cost(self, nodes: int, context: int | None = None) -> float:
        """Seconds for a verify forward of ``nodes`` nodes on a ``context``-token cache (None: the reference
        length); interpolated between measured sizes."""
        return self.costs(nodes, context, first=nodes)[0]

    def costs(self, most: int, context: int | None = None, first: int = 0) -> list[float]:
        """``[cost(n, context) for n in first..most]``, the tables read once (the selector asks every step).

        Per bucket: the calibrated cost followed to this cache length, unless the length's band has observed
        the size (its median then); calibrated sizes the band has not observed move by the observed ones'
        median ratio to their calibrated costs (a machine slower or faster than at calibration), and no size
        costs more than an observed larger one (it could be padded to it)."""
        table = self._calibrated_at(context)
        band = cache_band(context)
        # a snapshot: another thread's step may add a size meanwhile
        observed = {b: v for (bd, b), v in list(self._observed_cost.items()) if bd == band}
        if observed:
            ratios = [v / table[b] for b, v in observed.items() if table.get(b)]
            scale = statistics.median(ratios) if ratios else 1.0
            table = {b: observed.get(b, scale * c) for b, c in table.items()} | observed
            ceiling = math.inf
            for b in sorted(table, reverse=True):
                table[b] = min(table[b], ceiling)
                if b in observed:
                    ceiling = table[b]
        known = sorted(table)
        return [_interpolate(table, n, extrapolate=True, known=known) for n in range(first, most + 1)]

    def _calibrated_at(self, context: int | None) -> dict[int, float]:
        """The calibrated cost of every calibrated bucket on a ``context``-token cache (along its growth)."""
        base, slope = self.cost_s, self.cost_slope
        far = 0 if context is None or self.cost_context is None or not slope else context - self.cost_context
        if not far:
            return dict(base)
        return {b: max(0.2 * c, c + slope.get(b, 0.0) * far) for b, c in base.items()}


def _interpolate(table: dict[int, float], nodes: int, extrapolate: bool, known: Sequence[int] | None = None) -> float:
    """``table`` at ``nodes``: linear between the nearest known sizes; beyond them, linear growth from the
    nearest end (``extrapolate``) or the end value. ``known``: ``sorted(table)``, where the caller has it."""
    if nodes in table:
        return table[nodes]
    known = sorted(table) if known is None else known
    if not known:
        return 1.0 + 0.03 * nodes if extrapolate else 0.0  # neutral prior: relative units
    at = bisect.bisect_left(known, nodes)  # not in the table: known[at - 1] < nodes < known[at], where both exist
    lo, hi = known[max(at - 1, 0)], known[min(at, len(known) - 1)]
    if lo == hi:  # outside the measured range
        return table[lo] + (_slope(table, known) * (nodes - lo) if extrapolate else 0.0)
    t = (nodes - lo) / (hi - lo)
    return table[lo] + t * (table[hi] - table[lo])


def _line(xs: Sequence[int], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` with ``b >= 0``. The growth of a verify's cost per cache token is
    attention's, proportional to the tokens forwarded: a line through the sizes' timings, not each size's
    own difference of two noisy medians (extrapolated to a long document, those would swing widely)."""
    if not xs:
        return 0.0, 0.0
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx) if sxx else 0.0
    return my - b * mx, b


def _slope(costs: dict[int, float], known: Sequence[int]) -> float:
    if len(known) < 2:
        return 0.03 * costs[known[0]]
    a, b = known[-2], known[-1]
    return max(0.0, (costs[b] - costs[a]) / (b - a))


WARMUP = 4  # drafting steps a generation measures before worth_drafting may skip one
DRAFT_EWMA = 0.2  # weight of the newest drafting step in its moving means
DRAFTER_WARMUP = 16  # proposals a drafter makes before its ledger may switch it off (``drafter_on``)
PROBE_SHARE = 100  # a skipped LM drafter is probed once per this many of its drafted tokens' cost in steps


@dataclass
class DrafterLedger:
    """One drafter's spend and yield in one generation, summed over the steps it proposed: its own wall time
    (the host time of proposing and learning, an LM drafter's forwards and prefill included) and the nodes of its
    trees that were accepted. Sums, not moving means: a run of misses inside a copied span's gaps must not switch
    off a drafter whose hits pay for them."""

    proposed: int = 0
    host_s: float = 0.0
    accepted: int = 0
    skipped: int = 0  # steps skipped in a row since it stopped paying

    def observe(self, host_s: float, accepted: int) -> None:
        self.proposed += 1
        self.host_s += host_s
        self.accepted += accepted

    def pays(self, step_s: float) -> bool:
        """Whether its accepted tokens saved more target time than its own time took. (Its verified rows are
        the selector's bet, sized by the learned acceptance of each node's kind: a kind that stops landing
        stops being verified there; here only what the selector cannot see, the drafter's time, is charged.)"""
        return self.accepted * step_s > self.host_s


@dataclass
class TreeSelector:
    """Per generation: keeps the part of each candidate tree worth verifying, and learns from the outcome."""

    policy: BudgetPolicy
    request_weight: float = 8.0  # engine-wide rate counts as this many of this request's observations
    step: int = 0
    _local: dict[str, list[float]] = field(default_factory=dict)  # kind -> [accepted, tested] this request
    # drafting steps measured (worth_drafting): their host seconds, verified rows and accepted tokens (moving means)
    drafted: int = 0
    draft_host_s: float = 0.0
    draft_rows: float = 0.0
    draft_accepted: float = 0.0
    skipped: int = 0  # drafting steps skipped in a row
    ledgers: dict[str, DrafterLedger] = field(default_factory=dict)  # per drafter (``drafter_on``, ``charge``)

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

    def select(self, tree: DraftTree, context: int | None = None, batch: int = 1,
               batch_s: float | None = None) -> DraftTree:
        """The most likely nodes (ancestors included) whose number maximises expected tokens per second on a
        ``context``-token cache.

        Beside ``batch - 1`` other sequences whose shared forward takes ``batch_s`` seconds, a node's row delays
        all of them: the number maximises the batch's tokens per second, (batch - 1 + expected tokens of this
        tree) / (batch_s + cost(n) - cost(0)), so speculation shrinks as the batch grows. Alone (batch 1) that is
        expected tokens / cost(n)."""
        self.step += 1
        if not len(tree):
            return tree
        p = self.node_probabilities(tree)
        order = sorted(range(len(tree)), key=lambda i: (-p[i], i))  # a parent never ranks below its child
        order = order[: self.policy.max_budget]
        cost = self.policy.costs(len(order), context)
        others = max(batch - 1, 0)
        extra = max(batch_s - cost[0], 0.0) if others and batch_s is not None else 0.0  # the others' rows
        best_n, best_rate = 0, (others + 1.0) / (cost[0] + extra)
        gain = 1.0
        for n, i in enumerate(order, start=1):
            gain += p[i]
            rate = (others + gain) / (cost[n] + extra)
            if rate > best_rate:
                best_n, best_rate = n, rate
        if best_n == 0 and self.step % self.policy.explore_every == 0:
            best_n = min(2, len(tree))
        keep = set(order[:best_n])
        keys = self.keys(tree)
        untested = [i for i in order if tree.parents[i] == ROOT and self.policy.acceptance.rate(keys[i])[1] == 0]
        if untested:  # a kind never verified gets one try: its prior alone may never pay on a slow verify
            keep.add(untested[0])
        if len(keep) == len(tree):
            return tree
        return tree.subset(sorted(keep))

    def worth_drafting(self, context: int | None, batch: int, batch_s: float | None) -> bool:
        """Whether this step should draft at all. Beside ``batch - 1`` others whose shared forward takes ``batch_s``,
        everything a step spends on speculation delays all of them: the host time of drafting and picking (the
        generations' Python runs one at a time) and the rows it verifies. So it drafts only while its measured
        accepted tokens per step beat the batch's own rate for that spend,

            accepted / (rows * row_cost + host_s) > batch / batch_s,

        which turns speculation off as the batch grows or its drafts stop landing, and a skipped step is a plain
        one. Alone (or before ``WARMUP`` drafting steps are measured) it always drafts (``select`` sizes the tree);
        a generation that stopped drafting probes again every ``explore_every`` steps, so a falling batch or a
        draft that starts landing turns it back on."""
        if batch <= 1 or batch_s is None or self.drafted < WARMUP:
            return True
        row = max(self.policy.cost(1, context) - self.policy.cost(0, context), 0.0)
        if self.draft_accepted * batch_s > batch * (self.draft_rows * row + self.draft_host_s):
            self.skipped = 0
            return True
        self.skipped += 1
        return self.skipped % self.policy.explore_every == 0

    def observe_drafting(self, host_s: float, rows: int, accepted: int) -> None:
        """One drafting step's spend and yield (``worth_drafting``'s moving means, the first WARMUP steps averaged)."""
        self.drafted += 1
        a = max(1.0 / self.drafted, DRAFT_EWMA)
        self.draft_host_s += a * (host_s - self.draft_host_s)
        self.draft_rows += a * (rows - self.draft_rows)
        self.draft_accepted += a * (accepted - self.draft_accepted)

    def drafter_on(self, name: str, context: int | None, batch: int = 1, batch_s: float | None = None) -> bool:
        """Whether drafter ``name`` proposes this step: always for its first ``DRAFTER_WARMUP`` proposals, then
        while its accepted tokens have saved more than it cost (its own time, measured, and its verified rows,

            accepted * step_s > host_s + rows * row_s,

        with step_s a plain step's share of the batch this step joins), so a drafter whose drafts do not pay
        for it drafts nothing (and so verifies nothing); one that stopped is probed again every
        ``explore_every`` steps."""
        ledger = self.ledgers.setdefault(name, DrafterLedger())
        if ledger.proposed < DRAFTER_WARMUP:
            return True
        step_s = self.policy.cost(0, context)
        if batch > 1 and batch_s is not None:
            step_s = batch_s / batch
        if ledger.pays(step_s):
            ledger.skipped = 0
            return True
        ledger.skipped += 1
        return ledger.skipped % self.policy.explore_every == 0

    def charge(self, name: str, host_s: float, accepted: int) -> None:
        """One proposal's spend and yield for drafter ``name`` (``drafter_on``'s ledger)."""
        self.ledgers.setdefault(name, DrafterLedger()).observe(host_s, accepted)

    def charge_time(self, name: str, host_s: float) -> None:
        """Time drafter ``name`` spent on a step it did not propose in (learning from the verdict)."""
        self.ledgers.setdefault(name, DrafterLedger()).host_s += host_s

    def plan_depth(self, kind: str, step_cost: float, gamma: int, context: int | None = None,
                   setup_s: float = 0.0, remaining: int = 0) -> int:
        """How many tokens (0..gamma) a drafter that costs ``step_cost`` seconds per drafted token should chain
        this step: the depth that maximises expected tokens per second, drafting time included,

            rate(g) = (1 + sum over d <= g of P(first d tokens accepted)) / (g * step_cost + cost(g)),

        against a plain step (g = 0). A drafter that must first spend ``setup_s`` seconds (an LM drafter's
        prefill of its own prompt, not run yet) drafts only once the time its best depth would save over the
        ``remaining`` tokens of the answer beats that setup. A kind never verified gets a short chain once (its
        prior alone would rarely pay for an LM's forwards) and every ``explore_every`` steps a skipped drafter is
        re-probed with one token (a drafter whose token costs a good part of a step less often: ``PROBE_SHARE``),
        so an estimate that fell low is re-measured; neither while a setup is pending that costs more than a tenth
        of the answer's remaining plain steps."""
        cost = self.policy.cost
        plain = 1.0 / cost(0, context)
        best_g, best_rate = 0, plain
        p = gain = 1.0
        for g in range(1, gamma + 1):
            p *= self.probability(f"{kind}@{min(g, 3)}")
            gain += p
            rate = gain / (g * step_cost + cost(g, context))
            if rate > best_rate:
                best_g, best_rate = g, rate
        if setup_s > 0.0:
            saved = remaining * (1.0 / plain - 1.0 / best_rate)
            if best_g and saved > setup_s:
                return best_g
            if setup_s > 0.1 * remaining / plain:
                return 0
        if best_g == 0:
            if self.policy.acceptance.rate(f"{kind}@1")[1] == 0:
                return min(gamma, 3)
            # a probe costs a drafted token: a dear drafter is probed rarely enough to spend ~1% of the time on it
            every = max(self.policy.explore_every, math.ceil(PROBE_SHARE * step_cost / cost(0, context)))
            if (self.step + 1) % every == 0:
                return 1
        return best_g

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
