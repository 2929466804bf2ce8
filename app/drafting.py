"""Which drafters a request gets, by mode. Modes whose drafter is not in this build answer 'not available
yet' (a 4xx) rather than silently falling back to something else."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app.errors import NotAvailableYet
from decoding.drafter import Drafter
from decoding.drafters.prompt_lookup import PromptLookupDrafter
from decoding.drafters.racer import (
    CrossSessionConfig,
    LogitsTable,
    RacerConfig,
    RacerFactory,
    SharedTier,
    open_shared_tier,
)

logger = logging.getLogger(__name__)

MODES = ("auto", "autoregressive", "racer", "rapid", "combined")
NOT_BUILT = {
    "rapid": "mode 'rapid' (the RAG drafter LM) is not available yet; use 'auto', 'racer' or "
    "'autoregressive'",
    "combined": "mode 'combined' (RAPID + RACER in one tree) is not available yet; use 'auto' or 'racer'",
}


@dataclass(frozen=True)
class DraftingConfig:
    racer_dir: Path | None  # where the logits table is saved (None: in memory only)
    redis_url: str | None  # cross-session tier in Redis when set, in process otherwise
    draft_cache_ttl_s: float
    model_id: str
    tokenizer_hash: str
    vocab_size: int


class Drafters:
    """Process-wide drafting state (RACER's logits table and cross-session tier); per-request drafters."""

    def __init__(self, config: DraftingConfig) -> None:
        self.racer_config = RacerConfig()
        table = LogitsTable.open(
            config.racer_dir, config.model_id, config.vocab_size, k=self.racer_config.topk
        )
        self.shared_tier: SharedTier = open_shared_tier(
            CrossSessionConfig(redis_url=config.redis_url, ttl_s=float(config.draft_cache_ttl_s))
        )
        self.racer = RacerFactory(
            self.racer_config,
            table,
            self.shared_tier,
            model_id=config.model_id,
            tokenizer_hash=config.tokenizer_hash,
        )

    @property
    def prompt_topk(self) -> int:
        """The target's top-k per prompt position that RACER's logits table learns from."""
        return self.racer_config.topk

    def for_mode(self, mode: str, tenant: str) -> list[Drafter]:
        """Fresh drafters for one request. The tenant keys the cross-session tier (never shared)."""
        if mode == "autoregressive":
            return []
        if mode == "racer":
            return [self.racer.drafter(tenant)]
        if mode == "auto":
            return [PromptLookupDrafter(), self.racer.drafter(tenant)]
        raise NotAvailableYet(NOT_BUILT.get(mode, f"unknown mode {mode!r}"))

    def learn(self, tenant: str, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Feed an answer drafted without RACER to the tenant's cross-session tier (RACER's ``end`` does it
        for its own requests)."""
        if not output_ids:
            return
        cache = self.shared_tier.cache(self.racer.model_id, self.racer.tokenizer_hash, tenant)
        tail = list(prompt_ids[-cache.context_len :])
        cache.learn([*tail, *output_ids], len(tail))

    def close(self) -> None:
        self.racer.close()
