"""Generation statistics: data only. Where they are reported (logs, Prometheus, API) lives elsewhere."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    """Per-generation counters. Acceptance length = (accepted + bonus) / verify steps."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0  # target forwards after prefill (one per emitted root)
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    draft_s_by_drafter: dict[str, float] = field(default_factory=dict)  # wall time of each drafter's proposals
    prefill_s: float = 0.0
    prefill_tokens: int = 0  # prompt tokens actually run through the target (after prefix-cache reuse)
    prefix_cache_hit: bool = False  # some of the prompt's KV came from the prefix cache
    prefix_reused_tokens: int = 0  # how many prompt tokens' KV came from the prefix cache
    ttft_s: float = 0.0
    decode_s: float = 0.0  # time after the first token
    total_s: float = 0.0
    context_truncated: bool = False
    finish_reason: str = ""

    @property
    def drafted(self) -> int:
        return sum(self.drafted_by_source.values())

    @property
    def accepted(self) -> int:
        return sum(self.accepted_by_source.values())

    @property
    def draft_s(self) -> float:
        """Seconds spent drafting (every drafter's proposals, an LM drafter's prefill and forwards included)."""
        return sum(self.draft_s_by_drafter.values())

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verify step (accepted + 1 bonus); 1.0 for plain decoding."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens after the first over the time after the first token."""
        if self.completion_tokens <= 1 or self.decode_s <= 0:
            return 0.0
        return (self.completion_tokens - 1) / self.decode_s

    def add_drafted(self, source: str, n: int) -> None:
        self.drafted_by_source[source] = self.drafted_by_source.get(source, 0) + n

    def add_accepted(self, source: str, n: int) -> None:
        self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + n

    def add_draft_time(self, drafter: str, seconds: float) -> None:
        self.draft_s_by_drafter[drafter] = self.draft_s_by_drafter.get(drafter, 0.0) + seconds

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            drafted=self.drafted,
            accepted=self.accepted,
            draft_s=self.draft_s,
            acceptance_length=self.acceptance_length,
            tokens_per_second=self.tokens_per_second,
        )
        return out
