"""The torch runtime: a transformers causal LM behind ``TargetRuntime`` (GPUs, fp32 CPU models, every family
transformers has).

The wrapped model (``module``) runs as the engine has always called it: ids, positions, the additive tree mask
and the ``SlotCache`` as ``past_key_values``, ``cache_position`` from the cache's length. On CUDA the tree mask
is described to the grouped attention (``decoding.runtime.attention_cuda.describe_tree_mask``), which then splits
it into the cached prefix and the tree block without reading it. It does not batch sequences: ``forward_batch``
runs its items one after the other, and says so (``batches`` is False).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from decoding.cache.memory import kv_bytes_per_token
from decoding.cache.slot import SlotCache
from decoding.runtime.attention_cuda import describe_tree_mask
from decoding.runtime.interface import BatchItem, additive_tree_mask


class TorchRuntime:
    """A transformers causal LM (in eval mode, on its device) as a ``TargetRuntime``; ``rope_tag`` names a rope
    scaling the loader wrote into its config (it goes into ``runtime_tag``)."""

    batches = False
    share_block = 0  # prefixes are copied into each cache

    def __init__(self, module: Any, rope_tag: str = "") -> None:
        self.module = module  # a transformers PreTrainedModel
        self.rope_tag = rope_tag

    @property
    def runtime_tag(self) -> str:
        kind = f"torch+{self.rope_tag}" if self.rope_tag else "torch"
        return f"{kind}:{str(self.dtype).removeprefix('torch.')}"

    @property
    def config(self) -> Any:
        return self.module.config

    @property
    def device(self) -> torch.device:
        return torch.device(self.module.device)

    @property
    def dtype(self) -> torch.dtype:
        dtype: torch.dtype = self.module.dtype
        return dtype

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 0)

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())

    def kv_bytes_per_token(self) -> int:
        """Bytes one token's keys and values take in a cache of the model's dtype, over every layer."""
        return kv_bytes_per_token(self.config, self.dtype)

    def new_cache(self, capacity: int) -> SlotCache:
        """A cache whose every layer keeps every row (transformers' own masks apply any sliding window)."""
        return SlotCache(self.num_layers, capacity)

    def tree_mask(self, ancestors: torch.Tensor, past: int) -> torch.Tensor:
        mask = additive_tree_mask(ancestors, past, self.dtype)  # [1, 1, n, past + n]
        return describe_tree_mask(mask, past, ancestors)  # CUDA: split without reading it

    def validate(self, item: BatchItem) -> None:
        ids = item.input_ids.reshape(-1)
        rows = int(self.module.get_input_embeddings().num_embeddings)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= rows:
            raise ValueError(f"token ids must be in [0, {rows}), got {ids.numel()} ids")
        start = item.cache.length
        last = int(item.position_ids.max()) if item.position_ids is not None else start + ids.numel() - 1
        if self.max_positions and last >= self.max_positions:
            raise ValueError(f"position {last} beyond the model's {self.max_positions}")

    def forward(
        self,
        input_ids: torch.Tensor,  # [1, n]
        cache: SlotCache,
        position_ids: torch.Tensor | None = None,  # [1, n]
        attention_mask: torch.Tensor | None = None,  # [1, 1, n, L + n] additive
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        start = cache.length
        n = input_ids.shape[1]
        cache_position = torch.arange(start, start + n, device=input_ids.device)  # [n]
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        kwargs: dict[str, Any] = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
        out = self.module(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            cache_position=cache_position,
            use_cache=True,
            **kwargs,
        )
        return out.logits[0]  # type: ignore[no-any-return]  # [keep, vocab]

    def forward_batch(self, items: Sequence[BatchItem]) -> list[torch.Tensor]:
        """Each item's ``forward``, one after the other (this runtime does not batch: ``batches`` is False)."""
        return [
            self.forward(item.input_ids.reshape(1, -1), item.cache,
                         None if item.position_ids is None else item.position_ids.reshape(1, -1),
                         item.attention_mask, item.logits_to_keep)
            for item in items
        ]
