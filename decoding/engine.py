"""The engine: prefill (with the shared document prefix cache), then autoregressive or speculative decoding.

A ladder of small steps, gpt-fast style:

    prefill -> first root -> [propose -> merge -> verify forward -> accept -> compact KV -> observe]* -> done

Every step verifies ``root + draft tree`` in one target forward with a tree attention mask on top of the
cached prefix. With no drafters (or a budget of 0) the tree is empty and the step is one plain
autoregressive forward, so the baseline and speculative decoding share every line but the drafting.
The engine never branches on who drafted: it merges whatever trees the drafters return.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from decoding.budget import BudgetPolicy, TreeSelector
from decoding.coupled import SeededNoise, sample_coupled, verify_coupled
from decoding.detokenize import IncrementalDetokenizer, StopMatcher
from decoding.drafter import Drafter, DraftRequest, PromptInfo, VerifyOutcome
from decoding.errors import ContextTooLong
from decoding.generation import (
    DoneEvent,
    GenerationConfig,
    GenerationEvent,
    PrefillEvent,
    Prompt,
    SamplingParams,
    TokenEvent,
)
from decoding.kv_cache import PrefixCache, PrefixEntry, SlotCache, segment_keys
from decoding.stats import GenerationStats
from decoding.tree import DraftTree, merge_trees, tree_layout
from decoding.verify import Verdict, target_probs, verify_greedy, verify_sampling

logger = logging.getLogger(__name__)


class TargetModel(Protocol):
    """What the engine needs of a loaded target (``decoding.models.LoadedModel`` satisfies it)."""

    @property
    def model(self) -> Any: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def name(self) -> str: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def max_context(self) -> int: ...


@dataclass(frozen=True)
class EngineConfig:
    prefill_chunk: int = 256  # tokens per prefill forward: bounds attention memory and how long a cancel waits
    node_topk: int = 8  # target top-k recorded for every verified node (drafters' logit cues)
    prompt_topk: int = 0  # >0: also record the target's top-k at every prompt position (RACER)
    max_budget: int = 64  # most draft nodes per step


class Engine:
    """Runs one generation at a time (callers serialise access; the app queues requests)."""

    def __init__(
        self,
        target: TargetModel,
        prefix_cache: PrefixCache | None = None,
        policy: BudgetPolicy | None = None,
        config: EngineConfig | None = None,
    ) -> None:
        self.target = target
        self.model = target.model
        self.prefix_cache = prefix_cache
        self.config = config or EngineConfig()
        self.policy = policy or BudgetPolicy(max_budget=self.config.max_budget)
        self.num_layers = int(self.model.config.num_hidden_layers)
        self.eos = set(target.eos_token_ids)
        self._float_dtype: torch.dtype = self.model.dtype
        # prefix KV computed by another runtime (fp32 torch, fp16-KV quantized...) is never reused
        self._cache_model = f"{target.name}|{getattr(target, 'runtime', 'torch')}"
        self._vocab = int(self.model.config.vocab_size)

    @property
    def max_context(self) -> int:
        return int(self.target.max_context)

    @property
    def device(self) -> torch.device:
        return torch.device(self.target.device)

    # ---- forwards ---------------------------------------------------------------------------------

    def _forward(
        self,
        input_ids: torch.Tensor,  # [1, n]
        cache: SlotCache,
        position_ids: torch.Tensor | None = None,  # [1, n]
        mask: torch.Tensor | None = None,  # [1, 1, n, L + n] additive
        all_logits: bool = True,
    ) -> torch.Tensor:
        start = cache.length
        n = input_ids.shape[1]
        cache_position = torch.arange(start, start + n, device=self.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        kwargs: dict[str, Any] = {}
        if not all_logits:
            kwargs["logits_to_keep"] = 1
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            past_key_values=cache,
            cache_position=cache_position,
            use_cache=True,
            **kwargs,
        )
        return out.logits[0]  # type: ignore[no-any-return]

    def _prefill(self, ids: Sequence[int], cache: SlotCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``ids`` into ``cache``; return the last logits ``[vocab]`` and top-k ``[n, k]`` if configured."""
        run = self._fill(ids, [(0, len(ids), None)], cache, None, None)
        while True:
            try:
                next(run)
            except StopIteration as end:
                assert end.value is not None
                return end.value  # type: ignore[no-any-return]

    def _fill(
        self,
        ids: Sequence[int],
        pieces: Sequence[tuple[int, int, str | None]],
        cache: SlotCache,
        cancel: threading.Event | None,
        tag: str | None,
    ) -> Generator[int, None, tuple[torch.Tensor, torch.Tensor | None] | None]:
        """Run ``ids[start:end]`` of each piece into ``cache`` (which holds the rows before the first piece),
        in chunks of ``prefill_chunk``; a piece with a key goes into the prefix cache as soon as it is done.

        Yields the rows done after every chunk but the last; stops between chunks when ``cancel`` is set
        (returns None). Returns the last logits ``[vocab]`` and the run rows' top-k ``[n, k]`` if configured.
        """
        k = self.config.prompt_topk
        chunk = min(self.config.prefill_chunk, 256) if k else self.config.prefill_chunk
        topks: list[torch.Tensor] = []
        last: torch.Tensor | None = None
        for start, end, key in pieces:
            for i in range(start, end, chunk):
                if cancel is not None and cancel.is_set():
                    return None
                part = torch.tensor([list(ids[i : min(end, i + chunk)])], dtype=torch.long, device=self.device)
                logits = self._forward(part, cache, all_logits=bool(k))  # [c or 1, vocab]
                if k:
                    topks.append(torch.topk(logits, k, dim=-1).indices.to("cpu"))
                last = logits[-1]
                if cache.length < pieces[-1][1]:
                    yield cache.length
            if key is not None and self.prefix_cache is not None:
                topk = torch.cat(topks)[start - pieces[0][0] :] if k else None
                self.prefix_cache.put(key, cache.snapshot(start, end, topk), tag=tag)
        assert last is not None
        return last, (torch.cat(topks) if k else None)

    def _mask(self, layout_mask: torch.Tensor, past: int) -> torch.Tensor:
        """Additive 4D mask ``[1, 1, n, past + n]``: the cached prefix is visible, the tree by ancestry."""
        n = layout_mask.shape[0]
        neg = torch.finfo(self._float_dtype).min
        mask = torch.zeros(n, past + n, dtype=self._float_dtype, device=self.device)
        mask[:, past:].masked_fill_(~layout_mask, neg)
        return mask.view(1, 1, n, past + n)

    # ---- prompt -----------------------------------------------------------------------------------

    def _start(
        self, prompt: Prompt, cache: SlotCache, stats: GenerationStats, cancel: threading.Event | None
    ) -> Generator[PrefillEvent, None, tuple[torch.Tensor, torch.Tensor | None] | None]:
        """Load the longest cached run of the prompt's prefix segments, prefill the rest (caching each new
        segment as it completes), yielding progress; returns the last logits and the prompt's top-k (None:
        cancelled)."""
        ids = prompt.ids
        prefix_len = len(prompt.prefix_ids) if prompt.suffix_ids else len(ids) - 1  # the last token runs
        ends = [e for e in (prompt.segment_ends or [len(prompt.prefix_ids)]) if 0 < e <= prefix_len]
        keys, entries = self._cached_run(prompt.prefix_key, ids, ends)
        reused = ends[len(entries) - 1] if entries else 0
        cache.load_prefix(entries)
        stats.prefix_reused_tokens, stats.prefix_cache_hit = reused, reused > 0
        yield PrefillEvent(done=reused, total=len(ids), reused=reused)
        pieces = [*_missing(ends, keys, len(entries)), (ends[-1] if ends else 0, len(ids), None)]  # + the rest
        run = self._fill(ids, pieces, cache, cancel, prompt.prefix_key)
        try:
            while True:
                yield PrefillEvent(done=next(run), total=len(ids), reused=reused)
        except StopIteration as end:
            result = end.value
        stats.prefill_tokens += cache.length - reused
        if result is None or not self.config.prompt_topk:
            return result
        last, topk = result
        cached = [e.topk for e in entries if e.topk is not None]  # every entry has one here
        return last, torch.cat([*cached, topk]) if topk is not None else None

    def warm_prefix(self, prompt: Prompt, cancel: threading.Event | None = None) -> bool:
        """Compute and cache the KV of ``prompt``'s prefix segments ahead of the first question (stops between
        chunks when ``cancel`` is set; finished segments stay cached). True if anything was computed."""
        if self.prefix_cache is None or not prompt.prefix_key or not prompt.prefix_ids:
            return False
        ids = list(prompt.prefix_ids)
        ends = list(prompt.segment_ends or [len(ids)])
        keys, entries = self._cached_run(prompt.prefix_key, ids, ends)
        if len(entries) == len(ends):
            return False
        cache = SlotCache(self.num_layers, len(ids) + 1)
        with torch.inference_mode():
            cache.load_prefix(entries)
            for _ in self._fill(ids, _missing(ends, keys, len(entries)), cache, cancel, prompt.prefix_key):
                pass
        return True

    def _cached_run(
        self, prefix_key: str | None, ids: Sequence[int], ends: Sequence[int]
    ) -> tuple[list[str | None], list[PrefixEntry]]:
        """The cache keys of the segments ending at ``ends`` (None: not cacheable) and the entries of their
        longest cached leading run (cut where an entry lacks the top-k this engine records)."""
        if self.prefix_cache is None or not prefix_key or not ends:
            return [None] * len(ends), []
        keys = segment_keys(self._cache_model, prefix_key, ids, ends)
        entries = self.prefix_cache.match(keys, self.device)
        if self.config.prompt_topk:  # cached without the top-k this engine needs: recompute from there
            entries = entries[: next((i for i, e in enumerate(entries) if e.topk is None), len(entries))]
        return list(keys), entries

    # ---- generation -------------------------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt,
        config: GenerationConfig | None = None,
        drafters: Sequence[Drafter] = (),
        cancel: threading.Event | None = None,
    ) -> Iterator[GenerationEvent]:
        """Yield ``TokenEvent``s as text becomes final, then one ``DoneEvent``.

        Raises ``ContextTooLong`` (before yielding anything) when the prompt fills the window.
        """
        config = config or GenerationConfig()
        ids = prompt.ids
        room = self.max_context - len(ids)
        if room < 1:
            raise ContextTooLong(len(ids) + 1, self.max_context)
        max_new = max(1, min(config.max_new_tokens, room))
        with torch.inference_mode():
            yield from self._generate(prompt, config, max_new, list(drafters), cancel)

    def _generate(
        self,
        prompt: Prompt,
        config: GenerationConfig,
        max_new: int,
        drafters: list[Drafter],
        cancel: threading.Event | None,
    ) -> Iterator[GenerationEvent]:
        t0 = time.perf_counter()
        sampling = config.sampling
        generator = _generator(sampling)
        noise = None if sampling.greedy or sampling.seed is None else SeededNoise(sampling.seed, self._vocab)
        stats = GenerationStats(prompt_tokens=len(prompt.ids), context_truncated=prompt.context_truncated)
        spare = (config.draft_budget if config.draft_budget is not None else self.policy.max_budget) + 2
        cache = SlotCache(self.num_layers, len(prompt.ids) + max_new + spare)

        started = yield from self._start(prompt, cache, stats, cancel)
        stats.prefill_s = time.perf_counter() - t0
        if started is None:  # cancelled during the prefill
            stats.total_s, stats.finish_reason = stats.prefill_s, "cancelled"
            yield DoneEvent(text="", token_ids=[], finish_reason="cancelled", stats=stats)
            return
        last_logits, prompt_topk = started
        root = self._pick(last_logits, sampling, generator, noise)

        detok = IncrementalDetokenizer(self.target.tokenizer)
        stops = StopMatcher(config.stop)
        output: list[int] = []
        selector = TreeSelector(self.policy)
        finish = ""
        t_first = 0.0

        def emit(tokens: list[int]) -> tuple[str, bool]:
            """Append ``tokens`` up to EOS / the limit; return (released text, finished)."""
            nonlocal finish
            kept: list[int] = []
            for tok in tokens:
                if tok in self.eos:
                    finish = "stop"
                    break
                kept.append(tok)
                if len(output) + len(kept) >= max_new:
                    finish = "length"
                    break
            output.extend(kept)
            text = stops.feed(detok.push(kept)) if kept else ""
            if stops.stopped:
                finish = "stop"
            return text, bool(finish)

        text, done = emit([root])
        stats.ttft_s = t_first = time.perf_counter() - t0
        if text:
            yield TokenEvent(text, output[:])
        if not done and drafters:
            info = PromptInfo(prompt_ids=prompt.ids, prompt_topk=prompt_topk, prefix_len=len(prompt.prefix_ids),
                              draft_ids=prompt.draft_ids, draft_rows=prompt.draft_rows, target_cache=cache)
            for d in drafters:
                d.begin(info)

        while not done:
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
            budget = 0
            if drafters:
                budget = config.draft_budget if config.draft_budget is not None else self.policy.max_budget
                budget = min(budget, max_new - len(output))
            tree = DraftTree()
            if budget > 0:
                plan = selector if config.draft_budget is None else None
                tree = self._draft(drafters, root, output, budget, plan, cache.length)
            if config.draft_budget is None:
                tree = selector.select(tree, cache.length)  # the part worth verifying here (maybe nothing)

            tv = time.perf_counter()
            base = cache.length
            verdict, logits = self._verify(root, tree, cache, sampling, generator, noise, len(output))
            rows = [0, *(i + 1 for i in verdict.accepted_nodes)]
            cache.compact(base, rows)
            self.policy.observe_cost(len(tree), time.perf_counter() - tv, base)

            stats.steps += 1
            accepted_tokens = [tree.tokens[i] for i in verdict.accepted_nodes]
            for i in range(len(tree)):
                stats.add_drafted(tree.sources[i], 1)
            for i in verdict.accepted_nodes:
                stats.add_accepted(tree.sources[i], 1)
            if drafters:
                selector.observe(tree, verdict.accepted_nodes)
                outcome = VerifyOutcome(
                    root=root,
                    tree=tree,
                    accepted_nodes=verdict.accepted_nodes,
                    new_tokens=[*accepted_tokens, verdict.bonus],
                    node_topk=torch.topk(logits, min(self.config.node_topk, logits.shape[-1]), dim=-1).indices.cpu(),
                    generated=output,
                )
                for d in drafters:
                    d.observe(outcome)
            root = verdict.bonus
            text, done = emit([*accepted_tokens, root])
            if text:
                yield TokenEvent(text, output[:])

        tail = ""
        if not stops.stopped:  # release held-back text: a dangling partial character, a partial stop string
            tail = stops.feed(detok.flush())
            tail += "" if stops.stopped else stops.finish()
            finish = "stop" if stops.stopped else finish
        if tail:
            yield TokenEvent(tail, output[:])
        for d in drafters:
            d.end(output)
        now = time.perf_counter()
        stats.completion_tokens = len(output)
        stats.total_s = now - t0
        stats.decode_s = now - t0 - t_first
        stats.finish_reason = finish
        yield DoneEvent(text=stops.text, token_ids=output, finish_reason=finish, stats=stats)

    def _draft(
        self,
        drafters: list[Drafter],
        root: int,
        output: list[int],
        budget: int,
        plan: TreeSelector | None,
        context: int,
    ) -> DraftTree:
        """Every drafter's tree, merged. A drafter that pays per drafted token (an LM) is told how deep to go
        (``plan``: from its measured cost, the verify-cost curve and its learned acceptance; None: its own
        limit)."""
        trees = []
        for d in drafters:
            depth = None
            gamma = int(getattr(d, "max_depth", 0))
            if plan is not None and gamma > 0:
                step = float(getattr(d, "step_cost_s", 0.0)) or self.policy.cost(0, context)  # unmeasured: a step
                depth = plan.plan_depth(d.name, step, gamma, context)
            trees.append(d.propose(DraftRequest(root=root, generated=output, budget=budget, max_depth=depth)))
        return merge_trees(trees, budget)

    def _verify(
        self,
        root: int,
        tree: DraftTree,
        cache: SlotCache,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        noise: SeededNoise | None = None,
        position: int = 0,
    ) -> tuple[Verdict, torch.Tensor]:
        """One target forward over root + tree; returns the verdict and the logits ``[n + 1, vocab]``."""
        base = cache.length
        layout = tree_layout(root, tree, base, self.device)
        mask = self._mask(layout.ancestor_mask, base) if len(tree) else None
        logits = self._forward(layout.input_ids, cache, layout.position_ids, mask)
        if sampling.greedy:
            return verify_greedy(tree, logits), logits
        probs = target_probs(logits, sampling)
        if noise is not None:  # seeded: coupled, so the answer does not depend on what was drafted
            return verify_coupled(tree, probs, noise, position), logits
        return verify_sampling(tree, probs, generator, sampling.eta), logits

    def _pick(
        self,
        logits: torch.Tensor,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        noise: SeededNoise | None = None,
    ) -> int:
        """The first output token (position 0), from the prefill's last logits."""
        if sampling.greedy:
            return int(logits.argmax())
        probs = target_probs(logits, sampling)
        if noise is not None:
            return sample_coupled(probs, noise, 0)
        return int(torch.multinomial(probs, 1, generator=generator).item())

    # ---- calibration ------------------------------------------------------------------------------

    def calibrate(self, contexts: Sequence[int] = (256, 2048), repeats: int = 3) -> dict[int, float]:
        """Measure the verify cost per budget bucket on this hardware, on random caches of each length in
        ``contexts`` (the policy then follows a request's cache length between and beyond them).

        On a CPU, attention makes a verify's cost relative to a plain step grow with the context. Buckets
        are measured round-robin, ``repeats`` times each, and the median kept, so a burst of load from
        elsewhere on the machine hits every bucket alike instead of skewing one. Returns the costs at the
        longest context.
        """
        costs: dict[int, float] = {}
        for context_tokens in contexts:
            base, medians = self.verify_costs(context_tokens, self.policy.buckets, repeats)
            costs = self.policy.calibrate(medians.__getitem__, context=base)
            logger.info("verify cost by draft nodes at a %d-token cache (s): %s", base,
                        {k: round(v, 4) for k, v in medians.items()})
        return costs

    def verify_costs(
        self, context_tokens: int, sizes: Sequence[int], repeats: int = 3
    ) -> tuple[int, dict[int, float]]:
        """Median seconds of a verify forward over a chain of each size in ``sizes`` (0: a plain decoding
        step) on a random ``context_tokens``-token cache (clamped to the window), sizes measured
        round-robin. Returns (the cache length used, {size: seconds})."""
        vocab = int(self.model.config.vocab_size)
        longest = self.max_context - max(sizes) - 2
        context_tokens = max(1, min(context_tokens, longest))
        gen = torch.Generator().manual_seed(context_tokens)
        ctx = torch.randint(0, vocab, (context_tokens,), generator=gen).tolist()
        times: dict[int, list[float]] = {b: [] for b in sizes}
        with torch.inference_mode():
            cache = SlotCache(self.num_layers, context_tokens + max(sizes) + 2)
            self._prefill(ctx, cache)
            base = cache.length
            for _ in range(repeats):
                for nodes, seen in times.items():
                    chain = DraftTree.chain(torch.randint(0, vocab, (nodes,), generator=gen).tolist(), "calibration")
                    t = time.perf_counter()
                    self._verify(int(ctx[-1]), chain, cache, SamplingParams(), None)
                    seen.append(time.perf_counter() - t)
                    cache.truncate(base)
        return base, {b: statistics.median(v) for b, v in times.items()}


def _missing(ends: Sequence[int], keys: Sequence[str | None], cached: int) -> list[tuple[int, int, str | None]]:
    """(start, end, key) of the segments after the first ``cached`` ones: what a prefill still has to run."""
    starts = [0, *ends]
    return [(starts[i], ends[i], keys[i]) for i in range(cached, len(ends))]


def _generator(sampling: SamplingParams) -> torch.Generator | None:
    if sampling.greedy:
        return None
    gen = torch.Generator()
    gen.manual_seed(sampling.seed if sampling.seed is not None else int(time.time_ns() % (2**63)))
    return gen
