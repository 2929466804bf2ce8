"""The working KV cache of one generation: preallocated, addressed by position.

``SlotCache`` is a transformers ``Cache`` whose layers write new keys/values into a preallocated buffer at
the current length (gpt-fast style). A verify pass appends the root and all tree nodes; ``compact`` then
moves only the accepted rows down next to the committed prefix and sets the length, so rejected nodes
are dropped without re-prefill and without copying the cache. Cached prompt prefixes (``PrefixCache``, in
``decoding.cache.prefix`` and importable from here too) are loaded into it row for row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from decoding.cache.prefix import PrefixEntry


class SlotLayer(CacheLayerMixin):
    """One layer's keys/values in a ``[1, heads, capacity, head_dim]`` buffer; ``length`` rows are live."""

    is_sliding = False
    is_compileable = False

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        # A runtime's own layout of whole blocks of ``tile_keys`` rows (the CPU kernels' attention on the tiles):
        # blocks below ``tiled[0]`` hold the rows as they are; every write below that lowers it.
        self.tiles: torch.Tensor | None = None
        self.tiled = torch.zeros(1, dtype=torch.int32)
        self.tile_keys = 0

    def lazy_initialization(self, key_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self._kbuf = torch.empty(b, h, self.capacity, d, dtype=key_states.dtype, device=key_states.device)
        self._vbuf = torch.empty_like(self._kbuf)
        self.is_initialized = True

    def _ensure(self, needed: int) -> None:
        assert self._kbuf is not None and self._vbuf is not None
        if needed <= self.capacity:
            return
        new_cap = max(needed, self.capacity * 2)
        grow = (0, 0, 0, new_cap - self.capacity)  # pad the sequence dim
        self._kbuf = torch.nn.functional.pad(self._kbuf, grow)
        self._vbuf = torch.nn.functional.pad(self._vbuf, grow)
        self.capacity = new_cap

    def reserve(self, heads: int, head_dim: int, dtype: torch.dtype, rows: int) -> None:
        """Allocate (or grow) the buffers for ``rows`` rows, for a writer that fills them itself."""
        if not self.is_initialized:
            self.lazy_initialization(torch.empty(1, heads, 0, head_dim, dtype=dtype))
        elif self.dtype != dtype:
            raise ValueError(f"this cache holds {self.dtype} keys/values, not {dtype}")
        self._ensure(rows)

    def reserve_tiles(self, heads: int, block_elems: int, tile_keys: int) -> torch.Tensor:
        """The tiled blocks' buffer ``[heads, blocks, block_elems]`` covering the capacity (after ``reserve``);
        made anew (nothing tiled) when it grows."""
        blocks = -(-self.capacity // tile_keys)
        if self.tiles is None or self.tiles.shape[1] < blocks or self.tile_keys != tile_keys:
            self.tiles = torch.empty(heads, blocks, block_elems, dtype=torch.int16)
            self.tiled[0] = 0
            self.tile_keys = tile_keys
        return self.tiles

    def _rewritten(self, row: int) -> None:
        """Rows from ``row`` on change: blocks reaching them are no longer tiled."""
        if self.tile_keys and int(self.tiled[0]) > row // self.tile_keys:
            self.tiled[0] = row // self.tile_keys

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole ``[1, heads, capacity, head_dim]`` key and value buffers (after ``reserve``)."""
        assert self._kbuf is not None and self._vbuf is not None
        return self._kbuf, self._vbuf

    def advance(self, n: int) -> None:
        """``n`` rows after ``length`` were written into the buffers directly: make them live."""
        self._rewritten(self.length)
        self.length += n

    def load(self, keys: torch.Tensor, values: torch.Tensor, at: int = 0) -> None:
        """Copy cached rows ``[1, h, n, d]`` into rows at..at+n-1; they become the last live rows."""
        if not self.is_initialized:
            self.lazy_initialization(keys)
        n = keys.shape[2]
        self._ensure(at + n)
        assert self._kbuf is not None and self._vbuf is not None
        self._rewritten(at)
        self._kbuf[:, :, at : at + n].copy_(keys)
        self._vbuf[:, :, at : at + n].copy_(values)
        self.length = at + n

    # ``keys`` / ``values`` (what transformers reads) are views made when read: a step of the quantized runtime
    # never reads them, and two views per layer per step are a measurable share of its Python time.
    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor | None:
        return None if self._kbuf is None else self._kbuf[:, :, : self.length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        """The buffers are the truth (transformers' base class assigns None at construction)."""

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor | None:
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
        self._kbuf[:, :, self.length : self.length + n].copy_(key_states)
        self._vbuf[:, :, self.length : self.length + n].copy_(value_states)
        self.length += n
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def compact(self, base: int, rows: torch.Tensor) -> None:
        """Keep rows ``base + rows[j]`` at ``base + j``; length becomes ``base + len(rows)``."""
        assert self._kbuf is not None and self._vbuf is not None
        src = rows + base
        k = self._kbuf.index_select(2, src)  # [1, h, m, d]: only the accepted rows
        v = self._vbuf.index_select(2, src)
        m = rows.numel()
        self._rewritten(base)
        self._kbuf[:, :, base : base + m].copy_(k)
        self._vbuf[:, :, base : base + m].copy_(v)
        self.length = base + m

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)
        self._rewritten(self.length)

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.length + cache_position.shape[0], 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_cache_shape(self) -> int:
        return -1


class SlotCache(Cache):
    """Working KV cache of one generation (batch 1)."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        super().__init__(layers=[SlotLayer(capacity) for _ in range(num_layers)])

    @property
    def slot_layers(self) -> list[SlotLayer]:
        return self.layers  # type: ignore[return-value]

    @property
    def length(self) -> int:
        return self.slot_layers[0].length

    def load_prefix(self, entries: Sequence[PrefixEntry]) -> None:
        """Rows 0.. from cached segments, one after the other (a prefix cache match)."""
        at = 0
        for entry in entries:
            for layer, k, v in zip(self.slot_layers, entry.keys, entry.values, strict=True):
                layer.load(k, v, at)
            at += entry.length

    def compact(self, base: int, rows: Sequence[int]) -> None:
        """After a verify pass that started at ``base``: keep only ``rows`` (root row 0 + accepted rows)."""
        if list(rows) == list(range(len(rows))):  # accepted path already contiguous: just cut
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
        """An immutable copy of rows start..end-1 (a prefix cache segment)."""
        keys = tuple(layer.keys[:, :, start:end].clone() for layer in self.slot_layers)  # type: ignore[index]
        values = tuple(layer.values[:, :, start:end].clone() for layer in self.slot_layers)  # type: ignore[index]
        return PrefixEntry(keys=keys, values=values, topk=topk)


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
