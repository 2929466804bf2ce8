"""Routing replicas by document: a simulated cluster of 10 to 1000 replicas, document-affine routing (consistent
hashing with bounded loads, ``app.cluster.routing``) against random, least-loaded and unbounded consistent
hashing. ``affine_slots`` is the served router's rule: the same, but a replica with a free batch slot keeps its
documents whatever the others hold.

The model, a discrete-event simulation. Requests arrive as a Poisson stream; each asks about one of ``docs_per_replica
x replicas`` documents drawn with Zipf popularity (exponent ``--zipf``). A replica runs ``--slots`` generations at once
(its batch) and keeps the KV of ``--cache-docs`` documents (least recently used goes). A request whose document is
cached (or being read by an earlier request there: it waits for that, as the engine does) starts after ``--hit-s``,
else after reading the document, ``--prefill-s``; then it decodes for ``--decode-s``. Offered load ``rho``: the arrival
rate as a share of what the cluster serves when every request reads its document (rho 1.5: more than it
serves unless most requests find their document cached). Measured after a warm-up (the first quarter of the
arrivals): the prefix hit rate, the queue wait, time to first token (wait + hit or prefill) p50 / p95, and how uneven
the replicas' work is (busiest replica's requests over the mean), and whether the queues stay bounded (``stable``: the
last quarter's mean wait under twice the first quarter's plus a second; an unstable policy's waits grow with the run,
so its figures are a lower bound).

The defaults model the bundled model on the benchmark box (``--prefill-s``, ``--hit-s``, ``--decode-s``; where
they come from: docs/benchmarks.md#routing-replicas-by-document).

    python -m bench.routing [--replicas 10 100 1000] [--rho 0.5 0.9 1.5] [--seed 0]

Writes ``bench/results/routing.json``: every policy's figures per (replicas, rho), and the load-factor / vnode sweep
the defaults were chosen from (best mean time to first token, 100 replicas at rho 1.5 unless told otherwise).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import random
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.cluster.routing import DEFAULT_LOAD_FACTOR, DEFAULT_VNODES, AffinityRouter
from bench.common import machine_info, out, write_json

RESULT = Path(__file__).parent / "results" / "routing.json"
POLICIES = ("affine", "affine_slots", "hash", "least_loaded", "random")


@dataclass(frozen=True)
class Workload:
    replicas: int
    rho: float
    slots: int = 4
    cache_docs: int = 8
    docs_per_replica: int = 20
    zipf: float = 1.0
    prefill_s: float = 7.8
    hit_s: float = 0.3
    decode_s: float = 1.8
    requests_per_replica: int = 120
    seed: int = 0

    @property
    def docs(self) -> int:
        return self.docs_per_replica * self.replicas

    @property
    def rate(self) -> float:
        """Arrivals per second: ``rho`` of the cluster's rate when every request reads its document (misses)."""
        return self.rho * self.replicas * self.slots / (self.prefill_s + self.decode_s)


@dataclass
class Outcome:
    policy: str
    hit_rate: float
    wait_mean_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    busiest_over_mean: float
    stable: bool  # the queues do not grow: the last quarter's mean wait is under twice the first's plus a second
    requests: int
    sim_s: float = field(default=0.0)


class _Replica:
    def __init__(self, cache_docs: int) -> None:
        self.running = 0
        self.load = 0  # requests in flight: running and queued
        self.queue: deque[tuple[float, int, int]] = deque()  # (arrival, doc, request id)
        self.cache: OrderedDict[int, float] = OrderedDict()  # doc -> time its KV is ready
        self.cache_docs = cache_docs
        self.served = 0

    def ready_at(self, doc: int, now: float, prefill_s: float) -> tuple[float, bool]:
        """When the request can read ``doc``'s KV here, and whether it was there (or on its way) already."""
        if doc in self.cache:
            self.cache.move_to_end(doc)
            return max(now, self.cache[doc]), True
        self.cache[doc] = now + prefill_s
        if len(self.cache) > self.cache_docs:
            self.cache.popitem(last=False)
        return now + prefill_s, False


class _Loads:
    """Every replica's load, with the least-loaded ones at hand (loads move by one): buckets of replicas by load."""

    def __init__(self, n: int) -> None:
        self.of = [0] * n
        self.total = 0
        self.buckets: dict[int, list[int]] = {0: list(range(n))}
        self.where = list(range(n))  # position of replica i in its bucket
        self.low = 0

    def move(self, i: int, delta: int) -> None:
        old = self.of[i]
        bucket = self.buckets[old]
        last = bucket.pop()
        if last != i:  # swap-remove
            bucket[self.where[i]] = last
            self.where[last] = self.where[i]
        new = old + delta
        self.of[i] = new
        self.total += delta
        dest = self.buckets.setdefault(new, [])
        self.where[i] = len(dest)
        dest.append(i)
        if new < self.low:
            self.low = new
        while not self.buckets.get(self.low):
            self.low += 1

    def least(self, rng: random.Random) -> int:
        return rng.choice(self.buckets[self.low])


def _zipf_sampler(n: int, s: float, rng: random.Random) -> Callable[[], int]:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    cum, total = [], 0.0
    for w in weights:
        total += w
        cum.append(total)
    ids = list(range(n))
    rng.shuffle(ids)  # popularity unrelated to the id (and so to its hash)
    return lambda: ids[min(bisect.bisect_left(cum, rng.random() * total), n - 1)]


def _chooser(policy: str, w: Workload, loads: _Loads, rng: random.Random, load_factor: float,
             vnodes: int) -> Callable[[int], int]:
    names = [f"replica-{i}" for i in range(w.replicas)]
    index = {name: i for i, name in enumerate(names)}
    if policy == "random":
        return lambda doc: rng.randrange(w.replicas)
    if policy == "least_loaded":
        return lambda doc: loads.least(rng)
    router = AffinityRouter(names, load_factor=load_factor, vnodes=vnodes,
                            floor=w.slots if policy == "affine_slots" else 0)
    if policy == "hash":
        return lambda doc: index[router.owner(f"doc-{doc}")]
    if policy in ("affine", "affine_slots"):
        by_name = _ByName(loads, index)
        return lambda doc: index[router.route(f"doc-{doc}", by_name, loads.total)]
    raise ValueError(f"unknown policy {policy}")


class _ByName(Mapping[str, int]):
    """The loads by replica name, as the router reads them."""

    def __init__(self, loads: _Loads, index: dict[str, int]) -> None:
        self.loads, self.index = loads, index

    def __getitem__(self, name: str) -> int:
        return self.loads.of[self.index[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


def simulate(w: Workload, policy: str, load_factor: float = DEFAULT_LOAD_FACTOR,
             vnodes: int = DEFAULT_VNODES) -> Outcome:
    """One run of ``policy`` on workload ``w`` (the same arrivals and documents for every policy: same seed)."""
    t0 = time.perf_counter()
    rng = random.Random(w.seed)
    draw = _zipf_sampler(w.docs, w.zipf, rng)
    n = w.requests_per_replica * w.replicas
    arrivals, now = [], 0.0
    for _ in range(n):
        now += rng.expovariate(w.rate)
        arrivals.append((now, draw()))
    replicas = [_Replica(w.cache_docs) for _ in range(w.replicas)]
    loads = _Loads(w.replicas)
    choose = _chooser(policy, w, loads, random.Random(w.seed + 1), load_factor, vnodes)
    warm = n // 4
    ttfts: list[float] = []
    waits: list[float] = []
    hits = 0
    events: list[tuple[float, int, int]] = []  # (time, replica, request id): a generation ends

    def start(r: int, arrived: float, doc: int, rid: int, at: float) -> None:
        nonlocal hits
        rep = replicas[r]
        rep.running += 1
        ready, hit = rep.ready_at(doc, at, w.prefill_s)
        first = ready + w.hit_s if hit else ready
        if rid >= warm:
            hits += hit
            waits.append(at - arrived)
            ttfts.append(first - arrived)
            rep.served += 1
        heapq.heappush(events, (first + w.decode_s, r, rid))

    def finish() -> None:
        done, r, _ = heapq.heappop(events)
        rep = replicas[r]
        rep.running -= 1
        loads.move(r, -1)
        if rep.queue:
            arrived, qdoc, qid = rep.queue.popleft()
            start(r, arrived, qdoc, qid, done)

    for rid, (t, doc) in enumerate(arrivals):
        while events and events[0][0] <= t:
            finish()
        r = choose(doc)
        loads.move(r, +1)
        if replicas[r].running < w.slots:
            start(r, t, doc, rid, t)
        else:
            replicas[r].queue.append((t, doc, rid))
    while events:  # drain: the queued requests still start
        finish()
    quarter = len(waits) // 4
    stable = statistics.fmean(waits[-quarter:]) < 2 * statistics.fmean(waits[:quarter]) + 1.0
    ttfts.sort()
    served = [rep.served for rep in replicas]
    return Outcome(
        policy=policy,
        hit_rate=round(hits / len(ttfts), 4),
        wait_mean_s=round(statistics.fmean(waits), 3),
        ttft_mean_s=round(statistics.fmean(ttfts), 3),
        ttft_p50_s=round(ttfts[len(ttfts) // 2], 3),
        ttft_p95_s=round(ttfts[int(0.95 * (len(ttfts) - 1))], 3),
        busiest_over_mean=round(max(served) / statistics.fmean(served), 2),
        stable=stable,
        requests=len(ttfts),
        sim_s=round(time.perf_counter() - t0, 2),
    )


def sweep(w: Workload, factors: Sequence[float], vnodes: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for c in factors:
        for v in vnodes:
            o = simulate(w, "affine", load_factor=c, vnodes=v)
            rows.append({"load_factor": c, "vnodes": v, **asdict(o)})
            out(f"  sweep c={c:<5} vnodes={v:<4} hit {o.hit_rate:.3f}  ttft mean {o.ttft_mean_s:6.2f} s  "
                f"p50 {o.ttft_p50_s:6.2f} s  "
                f"p95 {o.ttft_p95_s:7.2f} s  busiest/mean {o.busiest_over_mean}")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--rho", type=float, nargs="+", default=[0.5, 0.9, 1.5])
    ap.add_argument("--requests-per-replica", type=int, default=120)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep-replicas", type=int, default=100, help="cluster size of the load-factor / vnode sweep")
    ap.add_argument("--no-sweep", action="store_true", help="skip the sweep")
    ap.add_argument("--json", type=Path, default=RESULT)
    args = ap.parse_args(argv)
    results = []
    for replicas in args.replicas:
        for rho in args.rho:
            w = Workload(replicas, rho, zipf=args.zipf, seed=args.seed,
                         requests_per_replica=args.requests_per_replica)
            out(f"replicas {replicas}, rho {rho}: {w.docs} documents, {w.rate:.1f} requests/s")
            row: dict[str, Any] = {"replicas": replicas, "rho": rho, "policies": {}}
            for policy in POLICIES:
                o = simulate(w, policy)
                row["policies"][policy] = asdict(o)
                flag = "" if o.stable else "  UNSTABLE"
                out(f"  {policy:<13} hit {o.hit_rate:.3f}  wait {o.wait_mean_s:7.2f} s"
                    f"  ttft mean {o.ttft_mean_s:7.2f} s  p50 {o.ttft_p50_s:7.2f} s  p95 {o.ttft_p95_s:7.2f} s"
                    f"  busiest/mean {o.busiest_over_mean}{flag}")
            results.append(row)
    chosen = None
    sweep_rows: list[dict[str, Any]] = []
    if not args.no_sweep:
        w = Workload(args.sweep_replicas, 1.5, zipf=args.zipf, seed=args.seed,
                     requests_per_replica=args.requests_per_replica)
        out(f"sweep at {args.sweep_replicas} replicas, rho 1.5")
        sweep_rows = sweep(w, (1.1, 1.25, 1.5, 2.0, 3.0), (16, 64, 256))
        best = min(sweep_rows, key=lambda r: r["ttft_mean_s"])
        chosen = {"load_factor": best["load_factor"], "vnodes": best["vnodes"]}
        out(f"best mean time to first token: load_factor {best['load_factor']}, vnodes {best['vnodes']} "
            f"(defaults: {DEFAULT_LOAD_FACTOR}, {DEFAULT_VNODES})")
    write_json(args.json, {
        "bench": "routing",
        "command": "python -m bench.routing " + " ".join(argv or []),
        "machine": machine_info(),
        "workload": {k: v for k, v in asdict(Workload(0, 0.0, zipf=args.zipf, seed=args.seed,
                                                         requests_per_replica=args.requests_per_replica)).items()
                     if k not in ("replicas", "rho")},
        "defaults": {"load_factor": DEFAULT_LOAD_FACTOR, "vnodes": DEFAULT_VNODES},
        "best_in_sweep": chosen,
        "results": results,
        "sweep": sweep_rows,
    })


if __name__ == "__main__":
    main()
