"""Per-request n-gram automaton: a trie of every window of up to ``max_ngram`` tokens, with suffix links.

Node ``s`` stands for a token string of length ``depth(s)`` (1..max_ngram); the root is the empty
string. ``count(s)`` is how many times ``s`` occurred in the text fed since the node was created;
``link(s)`` (the failure / suffix link) is the node of ``s`` without its first token.

Feeding a token ``t`` extends every suffix of the text of length 0..max_ngram-1 by ``t``. Those suffixes
are exactly the suffix-link chain of the current state, so an insertion walks that chain once
(``max_ngram`` steps at most, O(1) per token for a fixed window) and links every new node to the next
one on the chain: links are correct after every insertion, prompt or output, with no rebuild.

The set of nodes is closed under taking prefixes (parents) and suffixes (links). Eviction keeps it so:
only a node with no children *and* no incoming suffix link may go (a leaf of both trees), so no subtree
is ever orphaned and no link dangles. Past the node bound, each insertion evicts the least recently
touched such leaves, one per node over the bound (exact LRU through a lazily validated heap of
(stamp, node), O(log n) per eviction, no pauses). Nodes touched by the latest insertion (the current
suffix chain) are never evicted. Among evictable nodes stamps are unique, so the order is deterministic.

Storage is flat: ``array('i')`` columns indexed by node id and one dict ``(parent, token) -> child``,
so a copy (for a per-document snapshot) is a few memcpys and one dict copy. ``build`` fills an empty
automaton from a whole prompt with numpy (one ``np.unique`` per window length) instead of token by token.
"""

from __future__ import annotations

import heapq
import logging
from array import array
from collections.abc import Iterator, Sequence

import numpy as np

logger = logging.getLogger(__name__)

ROOT = 0
NONE = -1
_STRIDE = 1 << 32  # edge key = parent * _STRIDE + token
_MAX_TOKEN = (1 << 31) - 1
_COLUMNS = ("_token", "_parent", "_link", "_depth", "_count", "_stamp", "_refs", "_first", "_next", "_prev")


def _column(values: np.ndarray | None = None, size: int = 0, fill: int = 0) -> array[int]:
    col: array[int] = array("i")
    if values is not None:
        col.frombytes(np.ascontiguousarray(values, dtype=np.int32).tobytes())
    elif size:
        col.frombytes(np.full(size, fill, dtype=np.int32).tobytes())
    return col


class NgramAutomaton:
    """Trie of all windows of up to ``max_ngram`` tokens of the text fed so far (see the module doc)."""

    def __init__(self, max_ngram: int = 10, max_nodes: int = 262_144) -> None:
        if max_ngram < 2:
            raise ValueError(f"max_ngram must be >= 2, got {max_ngram}")
        floor = max_ngram * (max_ngram + 1) // 2 + 2  # the factors of the current suffix must fit
        if max_nodes < floor:
            raise ValueError(f"max_nodes must be >= {floor} for max_ngram={max_ngram}, got {max_nodes}")
        self.max_ngram = max_ngram
        self.max_nodes = max_nodes
        self._init_columns(1)
        self._link[ROOT] = NONE
        self._parent[ROOT] = NONE
        self._token[ROOT] = NONE
        self._edges: dict[int, int] = {}
        self._free: list[int] = []
        self._size = 1  # live nodes, root included
        self._pos = 0  # tokens fed so far; the next token is fed at position ``_pos``
        self._cur = ROOT  # node of the longest suffix of the text of length <= max_ngram - 1
        self._heap: list[tuple[int, int]] | None = None  # (stamp, node) ⊇ evictable nodes; made on first need
        self.evicted = 0  # nodes evicted over the automaton's life

    def _init_columns(self, n: int) -> None:
        self._token = _column(size=n)
        self._parent = _column(size=n)
        self._link = _column(size=n)
        self._depth = _column(size=n)
        self._count = _column(size=n)
        self._stamp = _column(size=n, fill=-1)
        self._refs = _column(size=n)  # children + incoming suffix links; 0 = evictable leaf
        self._first = _column(size=n, fill=NONE)  # first child
        self._next = _column(size=n, fill=NONE)  # next sibling
        self._prev = _column(size=n, fill=NONE)  # previous sibling

    # ---- read access -------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Live nodes, root included."""
        return self._size

    @property
    def position(self) -> int:
        """Tokens fed so far."""
        return self._pos

    @property
    def state(self) -> int:
        """Node of the longest suffix of the text of length <= max_ngram - 1 (the matched state)."""
        return self._cur

    def depth(self, node: int) -> int:
        return self._depth[node]

    def count(self, node: int) -> int:
        return self._count[node]

    def link(self, node: int) -> int:
        """Suffix (failure) link; NONE for the root."""
        return self._link[node]

    def parent(self, node: int) -> int:
        return self._parent[node]

    def token(self, node: int) -> int:
        return self._token[node]

    def stamp(self, node: int) -> int:
        """Position of the latest occurrence that touched the node."""
        return self._stamp[node]

    def alive(self, node: int) -> bool:
        return 0 <= node < len(self._depth) and (node == ROOT or self._depth[node] > 0)

    def child(self, node: int, token: int) -> int:
        """The child of ``node`` by ``token``, or NONE."""
        return self._edges.get(node * _STRIDE + token, NONE)

    def children(self, node: int) -> list[tuple[int, int]]:
        """``(token, child)`` pairs of ``node`` in storage order."""
        out = []
        c = self._first[node]
        nxt, tok = self._next, self._token
        while c != NONE:
            out.append((tok[c], c))
            c = nxt[c]
        return out

    def continuations(self, node: int) -> list[tuple[int, int, int]]:
        """``(token, count, child)`` of ``node``'s children, highest count first (ties: most recent)."""
        cnt, stamp = self._count, self._stamp
        kids = [(tok, cnt[c], c) for tok, c in self.children(node)]
        kids.sort(key=lambda x: (-x[1], -stamp[x[2]]))
        return kids

    def string(self, node: int) -> tuple[int, ...]:
        """The token string of ``node`` (walks parents; for tests and debugging)."""
        out = []
        while node != ROOT:
            out.append(self._token[node])
            node = self._parent[node]
        return tuple(reversed(out))

    def nodes(self) -> Iterator[int]:
        """Ids of live nodes, root first."""
        depth = self._depth
        yield ROOT
        for i in range(1, len(depth)):
            if depth[i] > 0:
                yield i

    def lookup(self, tokens: Sequence[int]) -> int:
        """The node of exactly ``tokens`` (length <= max_ngram), or NONE."""
        node = ROOT
        for t in tokens:
            node = self._edges.get(node * _STRIDE + int(t), NONE)
            if node == NONE:
                return NONE
        return node

    def advance(self, state: int, token: int) -> int:
        """Aho–Corasick step: the longest suffix of ``string(state) + token`` held as a node of depth
        <= max_ngram - 1 (amortized O(1) over a sequence). The trie is suffix-closed, so the links visit
        every candidate suffix."""
        edges = self._edges
        node = state
        while True:
            c = edges.get(node * _STRIDE + token)
            if c is not None:
                return c if self._depth[c] < self.max_ngram else self._link[c]
            if node == ROOT:
                return ROOT
            node = self._link[node]

    def match(self, tokens: Sequence[int], state: int = ROOT) -> int:
        """Run ``advance`` over ``tokens`` from ``state``."""
        for t in tokens:
            state = self.advance(state, int(t))
        return state

    # ---- insertion ---------------------------------------------------------------------------------

    def _new_node(self, parent: int, token: int) -> int:
        if self._free:
            node = self._free.pop()
            self._token[node] = token
            self._parent[node] = parent
            self._link[node] = NONE
            self._depth[node] = self._depth[parent] + 1
            self._count[node] = 0
            self._refs[node] = 0
            self._first[node] = NONE
            self._prev[node] = NONE
        else:
            node = len(self._depth)
            self._token.append(token)
            self._parent.append(parent)
            self._link.append(NONE)
            self._depth.append(self._depth[parent] + 1)
            self._count.append(0)
            self._stamp.append(-1)
            self._refs.append(0)
            self._first.append(NONE)
            self._prev.append(NONE)
            self._next.append(NONE)
        head = self._first[parent]
        self._next[node] = head
        if head != NONE:
            self._prev[head] = node
        self._first[parent] = node
        self._refs[parent] += 1
        self._edges[parent * _STRIDE + token] = node
        self._size += 1
        return node

    def feed(self, token: int) -> None:
        """Append one token to the text: every window ending at it gets counted (O(max_ngram))."""
        token = int(token)
        if not 0 <= token <= _MAX_TOKEN:
            raise ValueError(f"token id {token} out of range")
        now = self._pos
        edges, count, stamp, link, depth = self._edges, self._count, self._stamp, self._link, self._depth
        heap = self._heap
        limit = self.max_ngram - 1
        node = self._cur
        pending = NONE  # node created on the previous chain step, waiting for its suffix link
        new_cur = NONE
        while node != NONE:
            child = edges.get(node * _STRIDE + token)
            created = child is None
            if child is None:
                child = self._new_node(node, token)
                if heap is not None:
                    heapq.heappush(heap, (now, child))
            count[child] += 1
            stamp[child] = now
            if pending != NONE:
                link[pending] = child
                self._refs[child] += 1
            pending = child if created else NONE
            if new_cur == NONE and depth[child] <= limit:
                new_cur = child
            node = link[node]
        if pending != NONE:  # a new depth-1 node links to the root
            link[pending] = ROOT
            self._refs[ROOT] += 1
        self._cur = new_cur
        self._pos = now + 1
        if self._size > self.max_nodes:
            self._evict(now)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.feed(t)

    # ---- eviction ----------------------------------------------------------------------------------

    def _remove(self, node: int) -> None:
        parent = self._parent[node]
        del self._edges[parent * _STRIDE + self._token[node]]
        prev, nxt = self._prev[node], self._next[node]
        if prev != NONE:
            self._next[prev] = nxt
        else:
            self._first[parent] = nxt
        if nxt != NONE:
            self._prev[nxt] = prev
        link = self._link[node]
        refs = self._refs
        refs[parent] -= 1
        refs[link] -= 1
        if self._heap is not None:  # a parent or link target that just became a leaf is a candidate
            if parent != ROOT and refs[parent] == 0:
                heapq.heappush(self._heap, (self._stamp[parent], parent))
            if link != ROOT and link != parent and refs[link] == 0:
                heapq.heappush(self._heap, (self._stamp[link], link))
        self._depth[node] = 0  # marks the id free; ``_new_node`` sets every column when it is reused
        self._free.append(node)
        self._size -= 1
        self.evicted += 1

    def _rebuild_heap(self) -> list[tuple[int, int]]:
        refs = np.frombuffer(self._refs, dtype=np.int32)
        depth = np.frombuffer(self._depth, dtype=np.int32)
        stamp = np.frombuffer(self._stamp, dtype=np.int32)
        nodes = np.flatnonzero((refs == 0) & (depth > 0))
        stamps = stamp[nodes]
        del refs, depth, stamp  # release the buffers before the columns change
        order = np.argsort(stamps, kind="stable")
        self._heap = list(zip(stamps[order].tolist(), nodes[order].tolist(), strict=True))  # sorted = a heap
        return self._heap

    def _evict(self, now: int) -> None:
        """Evict least recently touched leaves (no children, no incoming links) until within the bound."""
        heap = self._heap if self._heap is not None else self._rebuild_heap()
        refs, depth, stamp = self._refs, self._depth, self._stamp
        while self._size > self.max_nodes:
            if not heap:
                heap = self._rebuild_heap()
                if not heap:
                    break
            s, node = heapq.heappop(heap)
            if depth[node] == 0 or refs[node] != 0:
                continue  # gone, or not a leaf any more (pushed again if it becomes one)
            current = stamp[node]
            if current != s:
                heapq.heappush(heap, (current, node))  # touched since: reconsider at its real age
                continue
            if s >= now:  # only the current suffix chain is left
                heapq.heappush(heap, (s, node))
                break
            self._remove(node)
        if self._size > self.max_nodes:
            logger.warning("n-gram automaton: nothing evictable, %d nodes over a bound of %d",
                           self._size, self.max_nodes)
        if len(heap) > 4 * self._size + 1024:
            self._rebuild_heap()

    # ---- bulk build and copy -----------------------------------------------------------------------

    @classmethod
    def build(cls, tokens: Sequence[int] | np.ndarray, max_ngram: int = 10, max_nodes: int = 262_144,
              ) -> NgramAutomaton:
        """The automaton of ``tokens`` fed one by one, computed with numpy (same nodes, counts, links;
        ``automaton_build``). If the bound is exceeded, least recently touched leaves are evicted afterwards.
        """
        from decoding.drafters.racer.automaton_build import bulk_columns

        auto = cls(max_ngram, max_nodes)
        text = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if text.size == 0:
            return auto
        if int(text.min()) < 0 or int(text.max()) > _MAX_TOKEN:
            raise ValueError("token id out of range")
        cols = bulk_columns(text, max_ngram, _STRIDE)
        for name in _COLUMNS:
            setattr(auto, name, _column(getattr(cols, name.lstrip("_"))))
        size = len(cols.token)
        auto._edges = dict(zip((cols.parent[1:] * _STRIDE + cols.token[1:]).tolist(), range(1, size), strict=True))
        auto._size = size
        auto._pos = int(text.size)
        auto._cur = cols.cur
        if size > max_nodes:
            auto._evict(int(text.size) - 1)
        return auto

    def copy(self) -> NgramAutomaton:
        """An independent copy (memcpy of the columns, one dict copy)."""
        other = NgramAutomaton.__new__(NgramAutomaton)
        other.__dict__.update(self.__dict__)
        for name in _COLUMNS:
            setattr(other, name, array("i", getattr(self, name)))
        other._edges = self._edges.copy()
        other._free = self._free.copy()
        other._heap = None if self._heap is None else self._heap.copy()
        return other

    def nbytes(self) -> int:
        """Approximate memory held (columns + edge dict), for logs and benchmarks."""
        import sys

        cols = 10 * 4 * len(self._depth)
        return cols + sys.getsizeof(self._edges) + 36 * len(self._edges)
