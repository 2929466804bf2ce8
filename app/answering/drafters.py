"""Which drafters a request gets, by mode (``decoding.drafters.registry``' registry, shared with the benchmark). A mode
whose drafter this process cannot build answers 'not available' (a 4xx) rather than silently falling back
to something else."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from app.errors import NotAvailableYet
from decoding.drafters.racer import (
    CrossSessionConfig,
    LogitsTable,
    RacerConfig,
    RacerFactory,
    SharedTier,
    open_shared_tier,
)
from decoding.drafters.registry import MODES, DraftingKit, DraftLM, ModeUnavailable, build_drafters
from decoding.speculative.drafter import Drafter
from decoding.speculative.generation import SamplingParams

logger = logging.getLogger(__name__)


def needs_draft_prompt(mode: str) -> bool:
    """Whether ``mode`` runs the RAPID drafter LM (it prefills its own prompt over the retrieved chunks)."""
    return "rapid" in MODES.get(mode, ())


def needs_draft_rows(mode: str) -> bool:
    """Whether ``mode`` runs the KV-subset drafter (it reads the retrieved chunks' rows of the target's cache)."""
    return "rapid_kv" in MODES.get(mode, ())


@dataclass(frozen=True)
class DraftingConfig:
    redis_url: str | None  # cross-session tier in Redis when set, in process otherwise
    draft_cache_ttl_s: float
    model_id: str
    tokenizer_hash: str
    vocab_size: int
    draft_model: Any = None  # the RAG drafter's LM (the target's own by default); None: no RAPID modes
    target_model: Any = None  # the target (RAPID-KV drafts with it over its own cache)
    device: str = "cpu"


class Drafters:
    """Process-wide drafting state (RACER's logits table and cross-session tier); per-request drafters."""

    def __init__(self, config: DraftingConfig) -> None:
        self.config = config
        self.racer_config = RacerConfig()
        table = LogitsTable(config.vocab_size, k=self.racer_config.topk, model_id=config.model_id)
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

    def for_mode(self, mode: str, tenant: str, sampling: SamplingParams | None = None) -> list[Drafter]:
        """Fresh drafters for one request. The tenant keys the cross-session tier (never shared)."""
        model, device = self.config.draft_model, torch.device(self.config.device)
        kit = DraftingKit(
            racer=self.racer,
            tenant=tenant,
            draft_lm=None if model is None else (lambda: DraftLM(model, device)),
            target_model=self.config.target_model,
            sampling=sampling or SamplingParams(),
        )
        try:
            return build_drafters(mode, kit)
        except ModeUnavailable as exc:
            raise NotAvailableYet(str(exc)) from exc

    def learn(self, tenant: str, prompt_ids: Sequence[int], output_ids: Sequence[int], scope: str | None,
              counts: bool = True) -> None:
        """Keep an answer for the tenant's later sessions in the cross-session tier: whole, in the answers over
        the same documents (``scope``: the prompt's prefix key; the suffix drafter matches them), and as
        continuation counts unless RACER's drafter counted it itself (``counts`` False: its ``end`` did)."""
        cache = self.shared_tier.cache(self.racer.model_id, self.racer.tokenizer_hash, tenant)
        cache.remember(prompt_ids, output_ids, scope or "", counts)

    def close(self) -> None:
        self.racer.close()
