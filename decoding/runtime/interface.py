"""The one interface between the engine and a target runtime: ``TargetRuntime``, and a batched forward's items.

The engine, the prompt reader, the batcher, the calibration and the drafters that run the target call a runtime
only through this protocol (TGI's one ``Model`` interface): they never ask which runtime they have. Two runtimes
implement it, the quantized CPU runtime (``decoding.runtime.quantized.QuantizedModel``) and transformers models
(``decoding.runtime.torch_runtime.TorchRuntime``); a new model family or weight format lands behind it without the
engine changing.

What a forward takes is what the engine has always passed: token ids, the sequence's ``SlotCache`` (its rows so far;
the forward appends the new rows' keys and values after them), the new rows' positions, and for a draft tree an
additive visibility mask the runtime made itself (``tree_mask``). A forward returns logits, never a model output
object. Rows the caller does not keep are not projected onto the vocabulary (``logits_to_keep``).

``CHUNK_ROWS`` bounds one causal forward's rows wherever they are batched (a prompt runs in chunks of it), and
``BatchItem`` is one sequence's share of a batched forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from decoding.cache.slot import SlotCache

CHUNK_ROWS = 128  # rows per causal forward of a batched runtime: longer causal inputs (prefill) run in chunks


@dataclass(frozen=True)
class BatchItem:
    """One sequence's rows in a batched forward (``TargetRuntime.forward_batch``): as the arguments of one call."""

    input_ids: torch.Tensor  # [n] or [1, n]
    cache: SlotCache
    position_ids: torch.Tensor | None = None  # [n] or [1, n]; None: the cache's next n positions
    attention_mask: torch.Tensor | None = None  # a tree's 0 / -inf visibility [1, 1, n, L + n]; None: causal
    logits_to_keep: int = 0  # 0: every row's


def additive_tree_mask(ancestors: torch.Tensor, past: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask ``[1, 1, n, past + n]`` of a draft tree's ``n`` rows after ``past`` cached rows: every
    cached row visible (0), each tree row seeing the tree rows ``ancestors`` (bool ``[n, n]``) marks, the others at
    ``dtype``'s lowest value. Made where ``ancestors`` is."""
    n = ancestors.shape[0]
    mask = torch.zeros(n, past + n, dtype=dtype, device=ancestors.device)  # [n, past + n]
    mask[:, past:].masked_fill_(~ancestors, torch.finfo(dtype).min)
    return mask.view(1, 1, n, past + n)


Visibility = tuple[int, torch.Tensor, torch.Tensor]  # (past, path rows int32, path offsets int32)


def visibility(mask: torch.Tensor | None, n: int, length: int) -> Visibility | None:
    """Which cache rows each of the ``n`` new queries sees: all of ``[0, past)``, then its own rows (its
    tree path, or any subset of the cached rows when part of the prefix is hidden: e.g. a drafter reading only
    the retrieved chunks' rows). ``past`` is the longest prefix every query sees whole.

    None when the mask is not 0 / -inf (an additive bias): the caller falls back.
    """
    past = length - n
    if mask is None:
        rows = torch.arange(past, length, dtype=torch.int32)
        path = torch.cat([rows[: i + 1] for i in range(n)]) if n > 1 else rows
        off = torch.tensor([i * (i + 1) // 2 for i in range(n + 1)], dtype=torch.int32)
        return past, path, off
    if mask.ndim != 4 or mask.shape[0] != 1 or mask.shape[1] != 1 or mask.shape[2] != n or mask.shape[3] < length:
        return None
    full = mask[0, 0, :, :length]
    if full.dtype == torch.bool:
        visible = full
    else:
        visible = full == 0
        if not bool((visible | (full <= torch.finfo(full.dtype).min / 2)).all()):
            return None  # a real additive bias: not what the kernel computes
    if past and not bool(visible[:, :past].all()):
        hidden = (~visible[:, :past].all(dim=0)).nonzero()
        past = int(hidden[0]) if len(hidden) else past
    block = visible[:, past:]
    counts = block.sum(dim=1)
    off = torch.zeros(n + 1, dtype=torch.int32)
    off[1:] = torch.cumsum(counts, 0).to(torch.int32)
    path = (block.nonzero()[:, 1] + past).to(torch.int32)  # row-major: per query, ascending
    return past, path.contiguous(), off



@runtime_checkable
class TargetRuntime(Protocol):
    """What the engine and the drafters call on a target model.

    Facts: ``runtime_tag`` names the runtime, its weights and KV storage (the string the service reports, e.g.
    ``cpu-quantized:gguf:Q4_1+Q8_0/kv-float16`` or ``torch:bfloat16``, with ``+rope-...`` after the first word when
    the loader rewrote the rope scaling); prefix KV is keyed on it, so rows another runtime wrote are never read.
    ``device`` / ``dtype``: where the logits are and their float type (masks are made in it). ``config``: the
    architecture as a transformers config (heads and head size for KV sizing, the rope a family module reads).
    ``num_layers``, ``vocab_size`` (the logits' width), ``max_positions`` (positions the model supports: the
    loader's window never goes past it), ``weight_bytes`` (the served weights).

    Capabilities: ``batches``: whether ``forward_batch`` runs its items in one forward, each row bit for bit what it
    is alone (False: it runs them one after the other, and the engine runs one generation at a time).
    ``share_block``: rows per block of a cached prefix the attention reads in place, shared by every sequence
    reading it (0: prefixes are copied into each cache). ``kv_bytes_per_token()``: what each further cached token
    costs. ``new_cache(capacity)``: an empty cache for this runtime's forwards (sliding-window layers in it keep only
    their window's rows, so they do not count in ``kv_bytes_per_token``).
    """

    @property
    def runtime_tag(self) -> str: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def config(self) -> Any: ...  # a transformers PretrainedConfig
    @property
    def num_layers(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_positions(self) -> int: ...
    @property
    def weight_bytes(self) -> int: ...
    @property
    def batches(self) -> bool: ...
    @property
    def share_block(self) -> int: ...

    def kv_bytes_per_token(self) -> int:
        """Bytes one more token's keys and values take in a cache, over the layers that keep every row."""
        ...

    def new_cache(self, capacity: int) -> SlotCache:
        """An empty cache for about ``capacity`` rows (it grows past them), laid out for this runtime."""
        ...

    def tree_mask(self, ancestors: torch.Tensor, past: int) -> torch.Tensor:
        """The mask ``forward`` takes for a draft tree's rows after ``past`` cached rows (``ancestors``: bool
        ``[n, n]``, row i sees row j): additive, ``[1, 1, n, past + n]``, where ``ancestors`` is."""
        ...

    def validate(self, item: BatchItem) -> None:
        """Raise ``ValueError`` for an item this runtime cannot run (ids or positions out of range, too many rows),
        so a bad item fails its own request before it joins a batch."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [1, n]
        cache: SlotCache,
        position_ids: torch.Tensor | None = None,  # [1, n]; None: the cache's next n positions
        attention_mask: torch.Tensor | None = None,  # [1, 1, n, L + n] additive (tree_mask's) or None (causal)
        logits_to_keep: int = 0,  # 0: every row's
    ) -> torch.Tensor:
        """One sequence's rows after its cached ones; their keys and values are appended to ``cache``. Returns the
        kept rows' logits ``[keep, vocab]`` (the last ``logits_to_keep`` rows; all of them for 0)."""
        ...

    def forward_batch(self, items: Sequence[BatchItem]) -> list[torch.Tensor]:
        """Several sequences, each on a cache of its own: each item's kept logits ``[keep, vocab]``, equal to what
        ``forward`` returns for it alone (a causal item takes at most ``CHUNK_ROWS`` rows)."""
        ...


@runtime_checkable
class RowKernels(Protocol):
    """A runtime whose matrix products have two interchangeable kernels (the same bits, each faster on some CPUs and
    row counts): ``row_kernels(choice)`` sets the choice per count of a forward's rows where given and returns it
    (entry ``m`` for ``m`` rows, the last for that many or more; empty: no choice here). The calibration measures
    it (``decoding.speculative.calibration.choose_row_kernels``)."""

    def row_kernels(self, choice: list[bool] | None = None) -> list[bool]: ...
