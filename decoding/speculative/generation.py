"""Public request/response types of the engine: what to generate, and the events it yields."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from decoding.speculative.channels import Harmony
from decoding.speculative.stats import GenerationStats


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy. top_k 0 = off. A seed makes sampling reproducible. ``min_p`` drops tokens less
    likely than ``min_p`` times the most likely one (after temperature and top-k).

    The penalties and ``logit_bias`` (token id, bias) shape the logits before everything else, greedy included
    (``decoding.speculative.shaping``: their semantics, and how each verified row gets its own path's counts).

    ``eta`` > 0 turns on RAPID's knowledge transfer, which is NOT lossless: a sampled LM draft is tested
    against the target's distribution shifted towards the drafter's (``decoding.speculative.verify.transfer``), so the
    answer no longer follows the target's distribution. 0 (the default) is exact speculative sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    eta: float = 0.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    draft_budget: int | None = None  # most draft nodes per step; None = the engine's budget policy
    logprobs: int | None = None  # None: off; k >= 0: each token's log-probability and the k most likely tokens'
    # a harmony model's markup (``decoding.speculative.channels``): the answer is its final channel alone
    channels: Harmony | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target's shaped logits, and the ``top`` most likely tokens'
    (token id, log-probability), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Prompt:
    """Token ids laid out ``[system][document] + [question...]``.

    ``prefix_ids`` (system + document) is the stable, cacheable part: its target KV is computed once per
    ``prefix_key`` and reused by every question and session. ``prefix_key`` None disables the cache.

    ``segment_ends`` cuts the prefix into cacheable segments (ascending row ends, the last one
    ``len(prefix_ids)``; empty: the whole prefix is one segment). The KV of a segment is cached under its own
    tokens and everything before it, so a prompt that shares its first segments with an earlier one (the
    same retrieved chunks, in the same order, before a different one) reuses their KV: a radix tree over
    segments.
    """

    prefix_ids: Sequence[int]
    suffix_ids: Sequence[int]
    prefix_key: str | None = None
    segment_ends: Sequence[int] = ()
    context_truncated: bool = False  # set by the caller when the document was cut to fit the window
    draft_ids: Sequence[int] | None = None  # the RAG drafter's prompt: [system][retrieved chunks][question]
    draft_rows: Sequence[tuple[int, int]] | None = None  # the rows of this prompt the KV drafter reads

    @property
    def ids(self) -> list[int]:
        return [*self.prefix_ids, *self.suffix_ids]


@dataclass
class TokenEvent:
    """Newly decoded answer text (may be empty while a multi-byte character is incomplete, or where only reasoning
    is new). ``logprobs`` (when asked for): the answer's tokens added to ``token_ids`` since the previous event
    with text. ``reasoning``: new reasoning text (a harmony model's analysis channel; ``GenerationConfig.channels``)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reasoning: str = ""


@dataclass
class PrefillEvent:
    """Progress of the prompt's prefill, sent between its chunks: ``done`` of ``total`` prompt tokens hold
    their KV (``reused`` of them came from the prefix cache)."""

    done: int
    total: int
    reused: int


@dataclass
class DoneEvent:
    """Last event of every generation, also after cancellation (finish_reason 'cancelled')."""

    text: str
    token_ids: list[int]
    finish_reason: str  # 'stop' (EOS or stop string), 'length', 'cancelled'
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per answer token of ``token_ids`` when asked for
    reasoning: str | None = None  # with channels: the analysis channel's text ("" if none); else None


GenerationEvent = TokenEvent | PrefillEvent | DoneEvent
