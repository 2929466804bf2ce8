"""The working KV cache of one generation: preallocated, addressed by position.

``SlotCache`` is a transformers ``Cache`` whose layers write new keys/values into a preallocated buffer at
the current length (gpt-fast style). A verify pass appends the root and all tree nodes; ``compact`` then
moves only the accepted rows down next to the committed prefix and sets the length, so rejected nodes
are dropped without re-prefill and without copying the cache. Cached prompt prefixes (``PrefixCache``, in
``decoding.cache.prefix`` and importable from here too) are loaded into it row for row, or, for a runtime that
reads a prefix in place (the quantized CPU runtime), their leading whole blocks are shared: every generation on
one document then reads the same prefix tensors (``SharedPrefix``), and a batched forward reads them once.

A sliding-window layer (``windows``: a model whose layer attends only to its last ``window`` keys) keeps only the
rows its next queries can read: when its buffer is full it drops the rows below them, in whole ``WINDOW_BLOCK``s,
``WINDOW_MARGIN`` rows to spare (a cache cut back that far after a forward still has every row it needs), so its
memory is bounded by the window however long the sequence; its snapshots and shared prefixes hold the same tail.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from decoding.cache.prefix import PrefixEntry

WINDOW_BLOCK = 128  # a sliding-window layer drops rows in whole blocks of this many (a multiple of the kernels' 64)
WINDOW_MARGIN = 128  # rows it keeps beyond what the queries of its last forward could read


def window_floor(start: int, window: int) -> int:
    """The lowest row a sliding-window layer keeps while its next rows start at ``start``: the first of the
    ``WINDOW_BLOCK`` holding row ``start + 1 - window - WINDOW_MARGIN`` (0 without a window)."""
    if not window:
        return 0
    return max(0, start + 1 - window - WINDOW_MARGIN) // WINDOW_BLOCK * WINDOW_BLOCK


class SlotLayer(CacheLayerMixin):
    """One layer's keys/values in a ``[1, heads, capacity, head_dim]`` buffer; ``length`` rows are live.
    ``window`` > 0: a sliding-window layer, which drops the rows its queries no longer read (module docstring)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, capacity: int, window: int = 0) -> None:
        super().__init__()
        self.window = window
        if window:  # it holds about its window whatever the sequence's length
            capacity = min(capacity, window + 2 * WINDOW_MARGIN + 2 * WINDOW_BLOCK)
        self.capacity = capacity  # rows the buffers hold: cache rows base..base+capacity-1
        self.length = 0
        # rows pre0..split-1: a prefix read in place from ``shared`` (keys, values ``[1, heads, split - pre0,
        # head_dim]``, never written), not from the buffers; pre0 > 0: a sliding window's rows below it were dropped
        self.split = 0
        self.pre0 = 0
        self.base = 0  # the cache row at buffer row 0: split, or past the rows a sliding window dropped
        self.shared: tuple[torch.Tensor, torch.Tensor] | None = None
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        # A runtime's own layout of whole blocks of ``tile_keys`` rows (the CPU kernels' bf16 attention): of the blocks
        # of the buffers' rows (from ``split`` on), those below ``tiled[0]`` hold the rows as they are; every write
        # below that lowers it. ``shared_tiles``: the shared prefix's layout (its own count), held for every cache
        # reading the prefix (``SharedPrefix.laid_out``).
        self.tiles: torch.Tensor | None = None
        self.tiled = torch.zeros(1, dtype=torch.int32)
        self._tiled = self.tiled.numpy()  # the same int: read on every write, a tensor read costs microseconds
        self.tile_keys = 0
        self.shared_tiles: tuple[torch.Tensor, torch.Tensor] | None = None
        self.moved = 0  # counts the times a buffer was (re)allocated or a prefix shared: a runtime's view is stale

    def lazy_initialization(self, key_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self._kbuf = torch.empty(b, h, self.capacity, d, dtype=key_states.dtype, device=key_states.device)
        self._vbuf = torch.empty_like(self._kbuf)
        self.is_initialized = True
        self.moved += 1

    @property
    def first(self) -> int:
        """The lowest cache row this layer still holds (0 unless a sliding window dropped rows)."""
        return self.pre0 if self.base == self.split and self.pre0 < self.split else self.base

    def _ensure(self, needed: int, start: int | None = None) -> None:
        """Room for cache rows up to ``needed`` (new rows from ``start``, default the length): a sliding-window
        layer first drops the rows below ``window_floor(start)``."""
        assert self._kbuf is not None and self._vbuf is not None
        if self.window and needed - self.base > self.capacity:
            self._slide(window_floor(self.length if start is None else start, self.window))
        needed -= self.base
        if needed <= self.capacity:
            return
        new_cap = max(needed, self.capacity * 2)
        grow = (0, 0, 0, new_cap - self.capacity)  # pad the sequence dim
        self._kbuf = torch.nn.functional.pad(self._kbuf, grow)
        self._vbuf = torch.nn.functional.pad(self._vbuf, grow)
        self.capacity = new_cap
        self.moved += 1

    def _slide(self, lowest: int) -> None:
        """Drop the buffers' rows below ``lowest`` (whole blocks), moving the rest down to buffer row 0."""
        assert self._kbuf is not None and self._vbuf is not None and not self.tile_keys
        if lowest <= self.base or lowest < self.split:
            return  # nothing of the buffers' own is below it
        keep = max(0, self.length - lowest)
        drop = lowest - self.base
        if keep:
            self._kbuf[:, :, :keep] = self._kbuf[:, :, drop : drop + keep].clone()
            self._vbuf[:, :, :keep] = self._vbuf[:, :, drop : drop + keep].clone()
        self.base = lowest
        self.moved += 1

    def reserve(self, heads: int, head_dim: int, dtype: torch.dtype, rows: int) -> None:
        """Allocate (or grow) the buffers for ``rows`` rows, for a writer that fills them itself."""
        if not self.is_initialized:
            self.lazy_initialization(torch.empty(1, heads, 0, head_dim, dtype=dtype))
        elif self.dtype != dtype:
            raise ValueError(f"this cache holds {self.dtype} keys/values, not {dtype}")
        self._ensure(rows)

    def reserve_tiles(self, heads: int, block_elems: int, tile_keys: int) -> torch.Tensor:
        """The tiled blocks' buffer ``[heads, blocks, block_elems]`` covering the capacity (after ``reserve``);
        made anew (nothing tiled) when it grows. A shared prefix must come in whole blocks of ``tile_keys``."""
        if self.split % tile_keys or self.window:
            raise ValueError(f"a shared prefix of {self.split} rows is not in whole blocks of {tile_keys}, or the "
                             "layer slides a window (its blocks are not kept laid out)")
        blocks = -(-self.capacity // tile_keys)
        if self.tiles is None or self.tiles.shape[1] < blocks or self.tile_keys != tile_keys:
            self.tiles = torch.empty(heads, blocks, block_elems, dtype=torch.int16)
            self.tiled[0] = 0
            self.tile_keys = tile_keys
            self.moved += 1
        return self.tiles

    def share_tiles(self, tiles: torch.Tensor, tiled: torch.Tensor) -> None:
        """Read the shared prefix's blocks laid out in ``tiles`` (the first ``tiled[0]`` valid; a runtime lays out
        the others there as it reads them)."""
        if not self.split:
            raise ValueError("only a layer reading a shared prefix takes its laid-out blocks")
        self.shared_tiles = (tiles, tiled)
        self.moved += 1

    def _rewritten(self, row: int) -> None:
        """Cache rows from ``row`` on change: the buffers' blocks reaching them are no longer tiled."""
        if self.tile_keys:
            block = max(0, row - self.base) // self.tile_keys
            if self._tiled[0] > block:
                self._tiled[0] = block

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole ``[1, heads, capacity, head_dim]`` key and value buffers (after ``reserve``): cache row j at
        buffer row j - base."""
        assert self._kbuf is not None and self._vbuf is not None
        return self._kbuf, self._vbuf

    def advance(self, n: int) -> None:
        """``n`` rows after ``length`` were written into the buffers directly: make them live."""
        self._rewritten(self.length)
        self.length += n

    def share(self, keys: torch.Tensor, values: torch.Tensor, first: int = 0) -> None:
        """Make ``[1, h, n, d]`` rows first..first+n-1 (a sliding window's: rows below ``first`` dropped), read in
        place (never copied, never written); an empty layer only."""
        if self.length or self.split:
            raise ValueError("a shared prefix goes first into an empty cache layer")
        if keys.shape != values.shape or keys.stride() != values.stride() or keys.stride()[2:] != (keys.shape[3], 1):
            raise ValueError("a shared prefix's keys and values are alike, each row contiguous and next to the last")
        n = keys.shape[2]
        self.shared, self.pre0 = (keys, values), first
        self.split = self.length = self.base = first + n
        self.moved += 1
        if not self.is_initialized and not self.window:  # the buffers hold only the rows after it
            self.capacity = max(1, self.capacity - n)

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of cache rows start..end-1 ``[1, h, end - start, d]``, wherever they lie."""
        if start < self.first:
            raise ValueError(f"cache rows below {self.first} were dropped (a sliding window), not row {start}")
        parts = []
        if start < self.split:
            assert self.shared is not None
            lo, hi = start - self.pre0, min(end, self.split) - self.pre0
            parts.append((self.shared[0][:, :, lo:hi], self.shared[1][:, :, lo:hi]))
        if end > self.split:
            assert self._kbuf is not None and self._vbuf is not None
            lo, hi = max(start, self.split) - self.base, end - self.base
            parts.append((self._kbuf[:, :, lo:hi], self._vbuf[:, :, lo:hi]))
        return torch.cat([k for k, _ in parts], 2), torch.cat([v for _, v in parts], 2)

    def load(self, keys: torch.Tensor, values: torch.Tensor, at: int = 0) -> None:
        """Copy cached rows ``[1, h, n, d]`` into rows at..at+n-1; they become the last live rows. ``at`` past the
        length (a sliding window's tail, the rows before it dropped) only into a layer whose buffers hold no row."""
        if not self.is_initialized:
            self.lazy_initialization(keys)
        n = keys.shape[2]
        if at > self.length:
            if self.length != self.base:
                raise ValueError(f"rows {self.length}..{at - 1} would be missing between the cached rows")
            self.base = self.length = at
            self.moved += 1
        self._ensure(at + n, at)
        assert self._kbuf is not None and self._vbuf is not None
        self._writable(at)
        self._rewritten(at)
        b = at - self.base
        self._kbuf[:, :, b : b + n].copy_(keys)
        self._vbuf[:, :, b : b + n].copy_(values)
        self.length = at + n

    def _writable(self, row: int) -> None:
        if row < self.split:
            raise ValueError(f"cache row {row} lies in the shared prefix (rows below {self.split}): read only")

    # ``keys`` / ``values`` (what transformers reads) are views made when read: a step of the quantized runtime
    # never reads them, and two views per layer per step are a measurable share of its Python time.
    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor | None:
        if self.split:
            return self.rows(0, self.length)[0]
        return None if self._kbuf is None else self._kbuf[:, :, : self.length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        """The buffers are the truth (transformers' base class assigns None at construction)."""

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor | None:
        if self.split:
            return self.rows(0, self.length)[1]
        return None if self._vbuf is None else self._vbuf[:, :, : self.length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        """See ``keys``."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        n = key_states.shape[2]
        self._ensure(self.length + n)
        assert self._kbuf is not None and self._vbuf is not None
        self._rewritten(self.length)
        b = self.length - self.base
        self._kbuf[:, :, b : b + n].copy_(key_states)
        self._vbuf[:, :, b : b + n].copy_(value_states)
        self.length += n
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def compact(self, base: int, rows: torch.Tensor) -> None:
        """Keep rows ``base + rows[j]`` at ``base + j``; length becomes ``base + len(rows)``."""
        assert self._kbuf is not None and self._vbuf is not None
        self._writable(base)
        b = base - self.base
        src = rows + b
        k = self._kbuf.index_select(2, src)  # [1, h, m, d]: only the accepted rows
        v = self._vbuf.index_select(2, src)
        m = rows.numel()
        self._rewritten(base)
        self._kbuf[:, :, b : b + m].copy_(k)
        self._vbuf[:, :, b : b + m].copy_(v)
        self.length = base + m

    def truncate(self, length: int) -> None:
        if length < self.length:
            self._writable(length)
            if self.window and max(0, length + 1 - self.window) < self.first:  # the next query's oldest key
                raise ValueError(f"a sliding-window layer cut back to {length} rows would miss rows below "
                                 f"{self.first}: they were dropped")
        self.length = min(self.length, length)
        self._rewritten(self.length)

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.length + cache_position.shape[0], 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_cache_shape(self) -> int:
        return -1


class SlotCache(Cache):
    """Working KV cache of one generation (batch 1). ``windows``: each layer's sliding window (0 or none: the layer
    keeps every row), as the runtime that fills the cache gives them (``TargetRuntime.new_cache``)."""

    def __init__(self, num_layers: int, capacity: int, windows: Sequence[int] = ()) -> None:
        windows = tuple(windows) or (0,) * num_layers
        if len(windows) != num_layers:
            raise ValueError(f"{len(windows)} windows for {num_layers} layers")
        super().__init__(layers=[SlotLayer(capacity, w) for w in windows])
        self.shared_prefix: SharedPrefix | None = None
        # a runtime's own view of the buffers (the CPU kernels' pointers), with the ``moved`` it was made at
        self.runtime_view: tuple[int, Any] | None = None

    def moved(self) -> int:
        """Grows whenever a layer's buffers move (a runtime's view of them made before is stale)."""
        return sum(layer.moved for layer in self.slot_layers)

    @property
    def slot_layers(self) -> list[SlotLayer]:
        return self.layers  # type: ignore[return-value]

    @property
    def length(self) -> int:
        return self.slot_layers[0].length

    @property
    def floor(self) -> int:
        """The lowest row every layer still holds (0 unless a sliding window dropped rows): a query that reads
        rows below it (a drafter's chosen rows of the prompt) cannot run on this cache."""
        return max(layer.first for layer in self.slot_layers)

    def load_prefix(self, entries: Sequence[PrefixEntry], share_block: int = 0) -> None:
        """Rows 0.. from cached segments, one after the other (a prefix cache match). ``share_block`` > 0 (a runtime
        that reads a prefix in place, in blocks of that many rows): their leading whole blocks are shared (read from
        ``SharedPrefix.of(entries)``, as every cache loading the same entries does), only the rest is copied."""
        shared = sum(e.length for e in entries) // share_block * share_block if share_block else 0
        firsts = tail_firsts(entries)
        if shared:
            prefix = self.shared_prefix = SharedPrefix.of(entries)  # held while this cache lives
            for layer, k, v, f in zip(self.slot_layers, prefix.keys, prefix.values, firsts, strict=True):
                f = min(f, shared)
                layer.share(k[:, :, : shared - f], v[:, :, : shared - f], f)
        at = 0
        for entry in entries:
            for i, (layer, k, v) in enumerate(zip(self.slot_layers, entry.keys, entry.values, strict=True)):
                held = at + entry.dropped_rows(i)  # the entry's first row this layer holds
                lo = max(shared, firsts[i], held)
                if lo < at + entry.length:
                    layer.load(k[:, :, lo - held :], v[:, :, lo - held :], lo)
            at += entry.length

    def compact(self, base: int, rows: Sequence[int]) -> None:
        """After a verify pass that started at ``base``: keep only ``rows`` (root row 0 + accepted rows)."""
        if list(rows) == list(range(len(rows))):  # accepted path already contiguous: just cut
            if self.length == base + len(rows):
                return  # nothing past it (a plain step): every layer stays as it is
            for layer in self.slot_layers:
                layer.truncate(base + len(rows))
            return
        device = self.slot_layers[0].device
        idx = torch.tensor(list(rows), dtype=torch.long, device=device)
        for layer in self.slot_layers:
            layer.compact(base, idx)

    def truncate(self, length: int) -> None:
        for layer in self.slot_layers:
            layer.truncate(length)

    def snapshot(self, start: int, end: int, topk: torch.Tensor | None = None) -> PrefixEntry:
        """An immutable copy of rows start..end-1 (a prefix cache segment); a sliding-window layer's holds only the
        rows from ``window_floor(end)`` on (those the rows after ``end`` can read)."""
        lows = [max(start, window_floor(end, layer.window)) for layer in self.slot_layers]
        rows = [layer.rows(lo, end) for layer, lo in zip(self.slot_layers, lows, strict=True)]
        dropped = tuple(lo - start for lo in lows) if any(lo > start for lo in lows) else ()
        return PrefixEntry(keys=tuple(k for k, _ in rows), values=tuple(v for _, v in rows), topk=topk,
                           dropped=dropped)


def tail_firsts(entries: Sequence[PrefixEntry]) -> list[int]:
    """Per layer, the first row of the run of entries' rows that reaches their end without a gap: from the last
    entry that dropped rows of that layer (a sliding window's), 0 where none did."""
    if not entries:
        return []
    firsts, at = [0] * len(entries[0].keys), 0
    for entry in entries:
        for i in range(len(firsts)):
            if entry.dropped_rows(i):
                firsts[i] = at + entry.dropped_rows(i)
        at += entry.length
    return firsts


class SharedPrefix:
    """The keys and values of a run of prefix cache entries as one tensor per layer, for caches that read it in
    place: an entry's own tensors, or (several entries) their concatenation, made once while any cache holds it,
    so that every generation on one document reads the same rows. Entries are immutable, so evicting them from
    the prefix cache never changes it; it lives as long as a cache refers to it."""

    _live: ClassVar[weakref.WeakValueDictionary[tuple[int, ...], SharedPrefix]] = weakref.WeakValueDictionary()
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, entries: Sequence[PrefixEntry]) -> None:
        self.entries = tuple(entries)  # held: the key's ids stay theirs while this lives
        self._layout: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # per layer: its rows from firsts[i] on (a sliding window's tail), of the entries reaching that far
        self.firsts = tail_firsts(entries)
        if len(entries) == 1:
            self.keys, self.values = entries[0].keys, entries[0].values
        else:
            ends = list(itertools.accumulate(e.length for e in entries))
            self.keys = tuple(self._cat([e.keys[i] for e, end in zip(entries, ends, strict=True) if end > f])
                              for i, f in enumerate(self.firsts))
            self.values = tuple(self._cat([e.values[i] for e, end in zip(entries, ends, strict=True) if end > f])
                                for i, f in enumerate(self.firsts))

    @staticmethod
    def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else torch.cat(parts, 2)

    def laid_out(self, rows: int, heads: int, block_elems: int,
                 tile_keys: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A runtime's layout of the whole blocks of the first ``rows`` rows, per layer: a buffer ``[heads, rows /
        tile_keys, block_elems]`` and the count of blocks laid out in it (0 at first: the runtime fills it as it reads
        them), made once for every cache reading this prefix."""
        shape = (heads, rows // tile_keys, block_elems)
        with self._lock:
            if self._layout is None or self._layout[0][0].shape != shape:
                self._layout = [(torch.empty(shape, dtype=torch.int16), torch.zeros(1, dtype=torch.int32))
                                for _ in self.keys]
            return self._layout

    @classmethod
    def of(cls, entries: Sequence[PrefixEntry]) -> SharedPrefix:
        key = tuple(id(e) for e in entries)
        with cls._lock:
            prefix = cls._live.get(key)
            if prefix is None:
                prefix = cls._live[key] = cls(entries)
            return prefix


def fill_random(
    cache: SlotCache,
    config: Any,
    rows: int,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator | None = None,
) -> None:
    """Make ``rows`` more rows live in every layer of ``cache``, with normal random keys/values of the shape a
    model with this (transformers-style) ``config`` writes, as ``dtype`` on ``device``.

    Stands in for a prefill where only the cost of what runs on the cache is wanted (verify-cost calibration
    on a GPU, the GPU bench): a long prefill takes seconds, this a memory write, and attention's dense kernels
    cost the same whatever the rows hold. Not for the quantized CPU runtime, which writes its own layout.
    ``generator`` (one on ``device``) keeps the global random state untouched.
    """
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    for layer in cache.slot_layers:
        if not layer.is_initialized:  # reserve() alone would allocate on torch's default device
            layer.lazy_initialization(torch.empty(1, kv_heads, 0, head_dim, dtype=dtype, device=device))
        layer.reserve(kv_heads, head_dim, dtype, layer.length + rows)
        keys, values = layer.buffers()
        keys[:, :, layer.length : layer.length + rows].normal_(generator=generator)
        values[:, :, layer.length : layer.length + rows].normal_(generator=generator)
        layer.advance(rows)
