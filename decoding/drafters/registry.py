"""The drafter registry: every drafter by name, and the drafters each decoding mode runs.

The service (``app``) and the benchmark (``bench``) both build a request's drafters here, so a mode the
service ships is exactly a benchmark method. Adding a drafter is one module with a ``BaseDrafter`` subclass
plus one line in ``DRAFTERS`` (and its name in the modes that use it).

Order in a mode is merge priority (``decoding.speculative.tree.merge_trees``): earlier drafters' nodes are kept
first when the step's budget is short.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from decoding.drafters.prompt_lookup import PromptLookupDrafter
from decoding.drafters.racer import RacerFactory
from decoding.drafters.rapid import DraftLM, RapidDrafter, RapidKVDrafter
from decoding.drafters.suffix import SuffixDrafter
from decoding.errors import DecodingError
from decoding.runtime.interface import TargetRuntime
from decoding.speculative.drafter import Drafter
from decoding.speculative.generation import SamplingParams


class ModeUnavailable(DecodingError):  # noqa: N818  (what the caller is told)
    """A decoding mode that does not exist, or whose drafters this process cannot build."""


@dataclass(frozen=True)
class DraftingKit:
    """What the drafter factories may draw on for one request (parts a process lacks are None)."""

    racer: RacerFactory | None = None  # RACER's process-wide state (logits table, cross-session tier)
    tenant: str = ""  # keys RACER's cross-session tier
    draft_lm: Callable[[], DraftLM] | None = None  # a fresh KV cache on the RAG drafter's LM
    target_model: TargetRuntime | None = None  # the target (the KV-subset drafter drafts with it over its own cache)
    sampling: SamplingParams = field(default_factory=SamplingParams)


def _racer(kit: DraftingKit) -> Drafter:
    if kit.racer is None:
        raise ModeUnavailable("RACER is not set up in this process")
    return kit.racer.drafter(kit.tenant)


def _rapid(kit: DraftingKit) -> Drafter:
    if kit.draft_lm is None:
        raise ModeUnavailable("the RAG drafter LM (RAPID) is not loaded in this process")
    # the drafter LM's logits may be wider or narrower than the target's (same tokenizer, padded heads)
    lm = kit.draft_lm()
    if kit.target_model is None:
        return RapidDrafter(lm, kit.sampling)
    relative = min(1.0, lm.model.weight_bytes / max(1, kit.target_model.weight_bytes))  # a step reads the weights
    return RapidDrafter(lm, kit.sampling, width=kit.target_model.vocab_size, relative_cost=relative)


def _rapid_kv(kit: DraftingKit) -> Drafter:
    if kit.target_model is None:
        raise ModeUnavailable("the target model is not given to the KV-subset drafter (RAPID-KV)")
    return RapidKVDrafter(kit.target_model, kit.sampling)


DRAFTERS: dict[str, Callable[[DraftingKit], Drafter]] = {
    "prompt_lookup": lambda kit: PromptLookupDrafter(),
    # the longest exact match of the text's end in prompt + answer so far, and in the tenant's earlier answers
    "suffix": lambda kit: SuffixDrafter(kit.racer.tier_cache(kit.tenant) if kit.racer is not None else None),
    "racer": _racer,
    "rapid": _rapid,
    "rapid_kv": _rapid_kv,
}

MODES: dict[str, tuple[str, ...]] = {
    "autoregressive": (),
    "racer": ("racer",),
    "rapid": ("rapid",),
    "rapid_kv": ("rapid_kv",),
    "suffix": ("suffix",),
    "prompt_lookup": ("prompt_lookup",),
    # the free drafters first: where they draft what the KV-subset LM would, the nodes are theirs, so the LM's ledger
    # shows only what it adds, and it stops drafting (and paying its forwards) where that is not worth it
    "combined": ("suffix", "racer", "rapid_kv"),
    # the longest exact match of the text's end in the prompt, the answer so far and the tenant's earlier answers
    # over the same documents (docs/benchmarks.md#decoding)
    "auto": ("suffix",),
}


def build_drafters(mode: str, kit: DraftingKit) -> list[Drafter]:
    """Fresh drafters for one request in ``mode``; ``ModeUnavailable`` when the mode is unknown or a drafter
    it needs cannot be built here."""
    names = MODES.get(mode)
    if names is None:
        raise ModeUnavailable(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    try:
        return [DRAFTERS[name](kit) for name in names]
    except ModeUnavailable as exc:
        raise ModeUnavailable(f"mode {mode!r} is not available: {exc}") from exc


__all__ = [
    "DRAFTERS", "MODES", "DraftLM", "DraftingKit", "ModeUnavailable", "RapidDrafter", "RapidKVDrafter",
    "build_drafters",
]  # fmt: skip
