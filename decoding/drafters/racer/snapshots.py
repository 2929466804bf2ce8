"""Per-document automaton snapshots: the prompt's document part is built once and copied per question.

Prompts are laid out ``[system][document][question]``, so questions on one document share a long
prefix. The cache does not need to be told where the document ends: when a prompt shares at least
``min_prefix`` leading tokens with a recent prompt, the automaton of that common prefix (less a
``margin``, since two questions often share their first words too) is built once, kept as a snapshot,
and every later prompt starting with it gets a copy (memcpy of the columns) fed with its own remaining
tokens. A copy holds exactly what feeding the whole prompt would hold (unless the
node bound forced evictions, which may then differ in which leaves went).

Snapshots are keyed by a ``scope`` too (the drafter passes its tenant namespace): a snapshot only ever
serves prompts whose prefix is token-for-token identical, so it reveals nothing, but scoping keeps
tenants' timings apart as well.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from decoding.drafters.racer.automaton import NgramAutomaton

Params = tuple[str, int, int]  # scope, max_ngram, max_nodes


@dataclass
class _Snapshot:
    params: Params
    tokens: np.ndarray  # [n] int64
    automaton: NgramAutomaton


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class AutomatonCache:
    """Builds prompt automata, reusing snapshots of shared prompt prefixes (one per process and model)."""

    def __init__(self, max_snapshots: int = 4, min_prefix: int = 256, margin: int = 32,
                 recent_prompts: int = 16) -> None:
        self.max_snapshots = max_snapshots
        self.min_prefix = min_prefix
        self.margin = margin
        self._snaps: OrderedDict[int, _Snapshot] = OrderedDict()
        self._recent: deque[tuple[Params, np.ndarray]] = deque(maxlen=recent_prompts)
        self._lock = threading.Lock()
        self._next_id = 0
        self.hits = 0
        self.builds = 0

    def __len__(self) -> int:
        return len(self._snaps)

    def automaton(
        self, prompt_ids: Sequence[int] | np.ndarray, *, max_ngram: int = 10, max_nodes: int = 262_144,
        scope: str = "",
    ) -> NgramAutomaton:
        """A fresh automaton of ``prompt_ids`` (the caller owns it and may feed it)."""
        ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        params: Params = (scope, max_ngram, max_nodes)
        with self._lock:
            best: tuple[int, _Snapshot] | None = None
            for sid, snap in self._snaps.items():
                n = snap.tokens.size
                if snap.params == params and n <= ids.size and (best is None or n > best[1].tokens.size) \
                        and np.array_equal(ids[:n], snap.tokens):
                    best = (sid, snap)
            lcp = 0
            if best is None:
                for p, prev in self._recent:
                    if p == params:
                        lcp = max(lcp, common_prefix(ids, prev))
                lcp -= self.margin
            self._recent.append((params, ids.copy()))
            if best is not None:
                self._snaps.move_to_end(best[0])
                self.hits += 1
                base = best[1].automaton
        if best is not None:
            auto = base.copy()
            auto.extend(ids[best[1].tokens.size :].tolist())
            return auto
        self.builds += 1
        if lcp < self.min_prefix:
            return NgramAutomaton.build(ids, max_ngram, max_nodes)
        base = NgramAutomaton.build(ids[:lcp], max_ngram, max_nodes)
        with self._lock:
            self._snaps[self._next_id] = _Snapshot(params, ids[:lcp].copy(), base)
            self._next_id += 1
            while len(self._snaps) > self.max_snapshots:
                self._snaps.popitem(last=False)
        auto = base.copy()
        auto.extend(ids[lcp:].tolist())
        return auto
