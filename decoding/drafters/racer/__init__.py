"""RACER: retrieval (the longest exact match of prompt + output) + logit cues (logits table) + a cross-session
tier, one draft tree.

Typical wiring (``app`` does this once per process and target model)::

    table = LogitsTable(vocab_size, k=8, model_id=model_id)  # in memory, shared by the process's requests
    tier = open_shared_tier(CrossSessionConfig(redis_url=settings.redis_url, ttl_s=...))
    racer = RacerFactory(RacerConfig(), table, tier, model_id=model_id, tokenizer_hash=tok_hash)
    ...
    drafter = racer.drafter(tenant)          # per request: RacerDrafter(config, table, tier.cache(...))
    engine.generate(prompt, config, [drafter])   # EngineConfig(prompt_topk=8) feeds the table at prefill
    ...
    racer.close()                            # at shutdown: stops the Redis worker

Node sources in the engine's stats: ``racer.retrieval``, ``racer.cross_session``, ``racer.logits``.
"""

from decoding.drafters.racer.cross_session import (
    CrossSessionCache,
    CrossSessionConfig,
    InProcessSharedTier,
    Namespace,
    SharedTier,
)
from decoding.drafters.racer.logits_table import LogitsTable
from decoding.drafters.racer.paths import (
    SOURCE_CROSS_SESSION,
    SOURCE_LOGITS,
    SOURCE_RETRIEVAL,
    logits_paths,
    shared_paths,
)
from decoding.drafters.racer.racer import RacerConfig, RacerDrafter, RacerFactory
from decoding.drafters.racer.redis_tier import RedisSharedTier, open_shared_tier

__all__ = [
    "SOURCE_CROSS_SESSION",
    "SOURCE_LOGITS",
    "SOURCE_RETRIEVAL",
    "CrossSessionCache",
    "CrossSessionConfig",
    "InProcessSharedTier",
    "LogitsTable",
    "Namespace",
    "RacerConfig",
    "RacerDrafter",
    "RacerFactory",
    "RedisSharedTier",
    "SharedTier",
    "logits_paths",
    "open_shared_tier",
    "shared_paths",
]
