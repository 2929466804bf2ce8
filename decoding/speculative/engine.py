"""The engine: read the prompt (through the shared prefix cache), then autoregressive or speculative decoding.

gpt-fast style, a generation is the prompt read once and one short step function repeated:

    read prompt (speculative.prefill) -> first root -> [_step: draft -> pick -> verify -> accept and commit]* -> done

``_step`` drafts (every drafter's tree, merged), picks the part worth verifying (the budget policy), runs
one verify forward, keeps the accepted path's KV and tells the policy and the drafters what was accepted.
Measuring verify costs for the policy is not the engine's job (``decoding.speculative.calibration``).

Every step verifies ``root + draft tree`` in one target forward with a tree attention mask on top of the
cached prefix. With no drafters (or a budget of 0) the tree is empty and the step is one plain
autoregressive forward, so the baseline and speculative decoding share every line but the drafting.
The engine never branches on who drafted: it merges whatever trees the drafters return, and never asks which
runtime it has: the target is a ``decoding.runtime.interface.TargetRuntime`` (one forward, a batched forward, KV
sizing, shared prefix blocks, its tag), and each step's sampling state is one ``SamplingMetadata``.

Words, as the engine uses them (``decoding.speculative.verify`` defines the verifier's):

- **target**: the model whose output is the answer; every emitted token is the target's choice.
- **drafter**: anything that guesses the target's next tokens (n-gram lookup, a logits table, an LM over the
  retrieved chunks); it proposes, never decides.
- **draft tree**: one step's guesses, every drafter's merged: **nodes** (a token each) under the step's root, a
  path from the root being one guessed continuation; siblings are alternatives at the same position.
- **root**: the last emitted token, not yet in the KV cache; every step's forward starts with it.
- **verify**: one target forward over root + draft tree with a tree mask (each row sees the cached prefix and its
  own ancestors), then the verdict on the logits: which path the target agrees with.
- **accepted**: the nodes of the path the target agrees with (greedy: equal to its argmax; sampling: passed the
  rejection test), in path order; their KV rows are kept, every other node's dropped (``SlotCache.compact``).
- **bonus**: the target's own token after the last accepted node, emitted too; it becomes the next root. Where
  every child of that node was rejected under sampling it is the **recovered** token, drawn from what the
  rejections left of p; otherwise a draw from p (greedy: its argmax).
- **acceptance length**: tokens emitted per verify step, accepted + 1 bonus (``GenerationStats``): 1 for plain
  decoding, more when drafts land.
- **plain step**: a verify with an empty tree, the root alone: autoregressive decoding, sharing every line of
  the speculative step but the drafting.
- **budget**: the most draft nodes a step may verify; the policy picks the part of the tree worth its cost.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from decoding.cache.prefix import PrefixCache
from decoding.cache.slot import SlotCache
from decoding.errors import ContextTooLong
from decoding.runtime import host
from decoding.runtime.interface import CHUNK_ROWS, BatchItem, TargetRuntime
from decoding.speculative.batching import ForwardBatcher
from decoding.speculative.budget import BudgetPolicy, TreeSelector
from decoding.speculative.coupled import SeededNoise, verify_coupled
from decoding.speculative.detokenize import AnswerText
from decoding.speculative.drafter import Drafter, DraftRequest, PromptInfo, VerifyOutcome
from decoding.speculative.generation import (
    DoneEvent,
    GenerationConfig,
    GenerationEvent,
    Prompt,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
)
from decoding.speculative.metadata import SamplingMetadata
from decoding.speculative.prefill import PromptReader, default_prefill_chunk, segment_ends
from decoding.speculative.shaping import LogitShaper, row_paths, token_logprobs
from decoding.speculative.stats import GenerationStats
from decoding.speculative.tree import DraftTree, merge_trees, tree_layout
from decoding.speculative.verify import Verdict, greedy_path, target_probs, verify_sampling


class TargetModel(Protocol):
    """What the engine needs of a loaded target (``decoding.runtime.loader.LoadedModel`` satisfies it)."""

    @property
    def model(self) -> TargetRuntime: ...
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


class Judgement(NamedTuple):
    verdict: Verdict
    node_topk: torch.Tensor | None  # the target's top-k after every row, on the host (when asked for)
    logprobs: list[TokenLogprob] | None  # one per emitted token (accepted + bonus), when asked for
    topk_s: float = 0.0  # seconds the top-k took (work done for the drafters that read it)


@dataclass(frozen=True)
class EngineConfig:
    # tokens per prefill forward: bounds attention memory and how long a cancel waits (None: by device,
    # ``decoding.speculative.prefill.default_prefill_chunk``)
    prefill_chunk: int | None = None
    node_topk: int = 8  # target top-k recorded for every verified node (drafters' logit cues)
    prompt_topk: int = 0  # >0: also record the target's top-k at every prompt position (RACER)
    max_budget: int = 64  # most draft nodes per step
    # a prompt's rows per batched forward while other generations decode beside it (alone: CHUNK_ROWS)
    prefill_rows: int = 64

    def __post_init__(self) -> None:
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.prefill_rows < 1:
            raise ValueError(f"prefill_rows must be >= 1, got {self.prefill_rows}")


class Engine:
    """Runs generations. On a runtime that batches (``TargetRuntime.batches``: the CPU runtime) generations in
    several threads at once share each forward (``decoding.speculative.batching``), each answer as it would be
    alone; on others (torch) callers run one generation at a time."""

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
        self.num_layers = self.model.num_layers
        self.eos = set(target.eos_token_ids)
        self._vocab = self.model.vocab_size
        # prefix KV computed by another runtime (fp32 torch, fp16-KV quantized, another rope...) is never reused
        cache_model = f"{target.name}|{self.model.runtime_tag}"
        chunk = self.config.prefill_chunk
        self.batcher = (ForwardBatcher(self.model.forward_batch, CHUNK_ROWS, self.config.prefill_rows)
                        if self.model.batches else None)
        self.reader = PromptReader(self._forward, prefix_cache, cache_model, self.device,
                                   default_prefill_chunk(self.device) if chunk is None else chunk,
                                   self.config.prompt_topk, self._vocab, self.model.share_block, self._away)

    @property
    def max_context(self) -> int:
        return int(self.target.max_context)

    @property
    def device(self) -> torch.device:
        return torch.device(self.target.device)

    def kv_bytes(self, tokens: int) -> int:
        """Bytes a generation's KV cache of ``tokens`` rows takes (what admission counts against the pool)."""
        return self.model.kv_bytes_per_token() * tokens

    def cache_rows(self, prompt_tokens: int, config: GenerationConfig) -> int:
        """The rows a generation's cache holds at most: its prompt, the answer and one step's draft tree."""
        spare = (config.draft_budget if config.draft_budget is not None else self.policy.max_budget) + 2
        return min(prompt_tokens + config.max_new_tokens, self.max_context) + spare

    # ---- forwards ---------------------------------------------------------------------------------

    def _forward(
        self,
        input_ids: torch.Tensor,  # [1, n]
        cache: SlotCache,
        position_ids: torch.Tensor | None = None,  # [1, n]
        mask: torch.Tensor | None = None,  # [1, 1, n, L + n] additive
        all_logits: bool = True,
    ) -> torch.Tensor:
        keep = 0 if all_logits else 1
        if self.batcher is not None:
            item = BatchItem(input_ids, cache, position_ids, mask, keep)
            self.model.validate(item)  # a bad item fails its own request, not the batch it would join
            return self.batcher.forward(item)
        return self.model.forward(input_ids, cache, position_ids, mask, keep)

    def prefill(self, ids: Sequence[int], cache: SlotCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``ids`` into ``cache`` (no prefix cache); return the last logits ``[vocab]`` and top-k ``[n, k]``
        if configured."""
        return self.reader.prefill(ids, cache)

    def warm_prefix(self, prompt: Prompt, cancel: threading.Event | None = None) -> bool:
        """Compute and cache the KV of ``prompt``'s prefix segments ahead of the first question (stops between
        chunks when ``cancel`` is set; finished segments stay cached). True if anything was computed."""
        return self.reader.warm(prompt, self.model.new_cache, cancel)

    def _mask(self, layout_mask: torch.Tensor, past: int) -> torch.Tensor:
        """The runtime's tree mask ``[1, 1, n, past + n]``: the cached prefix is visible, the tree by ancestry."""
        return self.model.tree_mask(layout_mask, past)

    # ---- generation -------------------------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt,
        config: GenerationConfig | None = None,
        drafters: Sequence[Drafter] = (),
        cancel: threading.Event | None = None,
    ) -> Iterator[GenerationEvent]:
        """Yield ``PrefillEvent``s while the prompt is read, ``TokenEvent``s as text becomes final, then one
        ``DoneEvent``.

        Raises ``ContextTooLong`` (before yielding anything) when the prompt fills the window.
        """
        config = config or GenerationConfig()
        ids = prompt.ids
        room = self.max_context - len(ids)
        if room < 1:
            raise ContextTooLong.of_prompt(len(ids) + 1, self.max_context)
        max_new = max(1, min(config.max_new_tokens, room))
        with torch.inference_mode(), self._joined():
            for event in self._generate(prompt, config, max_new, list(drafters), cancel):
                with self._away():  # a slow reader never holds up the generations beside this one
                    yield event

    def _joined(self) -> contextlib.AbstractContextManager[None]:
        return self.batcher.joined() if self.batcher is not None else contextlib.nullcontext()

    def _away(self) -> contextlib.AbstractContextManager[None]:
        return self.batcher.away() if self.batcher is not None else contextlib.nullcontext()

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
        stats = GenerationStats(prompt_tokens=len(prompt.ids), context_truncated=prompt.context_truncated)
        cache = self.model.new_cache(self.cache_rows(len(prompt.ids), config))

        ids = prompt.ids
        prefix_len = len(prompt.prefix_ids) if prompt.suffix_ids else len(ids) - 1  # the last token runs
        read = yield from self.reader.read(ids, segment_ends(prompt, prefix_len), prompt.prefix_key, cache, cancel)
        stats.prefix_reused_tokens, stats.prefix_cache_hit = read.reused, read.reused > 0
        stats.prefill_tokens += cache.length - read.reused
        stats.prefill_s = time.perf_counter() - t0
        if read.last is None:  # cancelled during the prefill (a prompt always has rows left to run)
            stats.total_s, stats.finish_reason = stats.prefill_s, "cancelled"
            yield DoneEvent(text="", token_ids=[], finish_reason="cancelled", stats=stats)
            return
        generator = _generator(sampling)
        noise = None if sampling.greedy or sampling.seed is None else SeededNoise(sampling.seed, self._vocab)
        answer = AnswerText(self.target.tokenizer, self.eos, max_new, config.stop, config.channels)
        shaper = LogitShaper(sampling, ids, self._vocab, self.device) if LogitShaper.needed(sampling) else None
        first = self._judge(DraftTree(), read.last[None], SamplingMetadata(sampling, generator, noise, (), None,
                                                                           shaper, config.logprobs))
        root = first.verdict.bonus
        run = _Run(config, sampling, generator, noise, cache, drafters, TreeSelector(self.policy), stats, max_new,
                   root, output=answer.ids, shaper=shaper, logprobs=first.logprobs)

        text = answer.add([root])
        stats.ttft_s = t_first = time.perf_counter() - t0
        yield from _token_event(text, answer, run)
        if not answer.done and drafters:
            info = PromptInfo(prompt_ids=ids, prompt_topk=read.topk, draft_ids=prompt.draft_ids,
                              draft_rows=prompt.draft_rows, target_cache=cache, scope=prompt.prefix_key)
            for d in drafters:
                self.policy.acceptance.seed(d.priors)
                d.begin(info)
        while not answer.done:
            if cancel is not None and cancel.is_set():
                answer.finish = "cancelled"
                break
            yield from _token_event(answer.add(self._step(run)), answer, run)
        yield from _token_event(answer.close(), answer, run)
        for d in drafters:
            d.end(answer.ids)
        now = time.perf_counter()
        stats.completion_tokens = len(answer.ids)
        stats.total_s = now - t0
        stats.decode_s = now - t0 - t_first
        stats.finish_reason = answer.finish
        logprobs = None if run.logprobs is None else answer.answer_part(run.logprobs)
        yield DoneEvent(text=answer.text, token_ids=answer.ids, finish_reason=answer.finish, stats=stats,
                        logprobs=logprobs, reasoning=answer.reasoning)

    # ---- one decoding step: draft -> pick -> verify -> accept and commit ---------------------------------

    def _step(self, run: _Run) -> list[int]:
        """One step after ``run.root``: the drafters' tree, the part of it worth verifying, one target forward
        over root + that part, the accepted path's KV kept; returns the new tokens (accepted + bonus)."""
        batch, batch_s = self._batch_now()
        run.proposals, run.node_topk = [], None
        drafting = run.config.draft_budget is not None or run.selector.worth_drafting(run.cache.length, batch, batch_s)
        t = time.perf_counter()
        tree = self._pick_tree(run, self._draft(run, batch, batch_s), batch, batch_s) if drafting else DraftTree()
        host_s = time.perf_counter() - t
        base, t = run.cache.length, time.perf_counter()
        verdict, node_topk, logprobs, topk_s = self.verify(run.root, tree, run.cache, run.metadata())
        if run.logprobs is not None and logprobs is not None:
            run.logprobs.extend(logprobs)
        run.cache.compact(base, [0, *(i + 1 for i in verdict.accepted_nodes)])
        if self.batcher is None or self.batcher.last_batch_size() == 1:  # a batch's time is not this tree's cost
            self.policy.observe_cost(len(tree), time.perf_counter() - t, base)
        accepted = [tree.tokens[i] for i in verdict.accepted_nodes]
        if drafting and run.drafters:
            run.selector.observe_drafting(host_s, len(tree), len(accepted))
        observe_s = self._observe(run, tree, verdict, node_topk, accepted)
        self._charge(run, tree, verdict, observe_s, topk_s)
        run.root = verdict.bonus
        return [*accepted, verdict.bonus]

    def _draft(self, run: _Run, batch: int = 1, batch_s: float | None = None) -> DraftTree:
        """Every drafter's tree, merged, from the drafters whose drafts pay (``TreeSelector.drafter_on``: each
        one's time is measured and charged). A drafter that pays per drafted token (an LM) is told how deep to
        go (planned from its measured cost and pending setup, the verify-cost curve and its learned acceptance,
        unless the request fixed the budget). The target's top-k at every verified row is computed this step
        only if a drafter that proposed reads it."""
        budget = run.config.draft_budget if run.config.draft_budget is not None else self.policy.max_budget
        budget = min(budget, run.max_new - len(run.output))
        if not run.drafters or budget <= 0:
            return DraftTree()
        context = run.cache.length
        fixed = run.config.draft_budget is not None
        trees = []
        for d in run.drafters:
            if not fixed and not run.selector.drafter_on(d.name, context, batch, batch_s):
                continue
            depth = None
            if not fixed and d.max_depth > 0:
                step = d.step_cost_s or d.relative_cost * self.policy.cost(0, context)  # unmeasured: its guess
                setup = self._setup_s(d, context)
                depth = run.selector.plan_depth(d.name, step, d.max_depth, context, setup,
                                                run.max_new - len(run.output))
            t = time.perf_counter()
            tree = d.propose(DraftRequest(root=run.root, generated=run.output, budget=budget, max_depth=depth))
            spent = time.perf_counter() - t
            run.stats.add_draft_time(d.name, spent)
            run.proposals.append(_Proposal(d.name, spent, frozenset(tree.sources), d.uses_node_topk))
            if d.uses_node_topk:
                run.node_topk = self.config.node_topk
            trees.append(tree)
        return merge_trees(trees, budget)

    def _setup_s(self, drafter: Drafter, context: int) -> float:
        """Seconds the prompt ``drafter`` must still read would take: at the target's cost per row of its
        largest calibrated verify (a prefill's rows cost about that), scaled by the drafter's own measured
        cost per token against a target step, or its guess before it has one (a smaller drafter LM reads faster)."""
        if not drafter.setup_tokens:
            return 0.0
        widest = self.policy.buckets[-1]
        per_row = self.policy.cost(widest, context) / (widest + 1)
        scale = drafter.step_cost_s / self.policy.cost(0, context) if drafter.step_cost_s else drafter.relative_cost
        return drafter.setup_tokens * per_row * scale

    def _charge(self, run: _Run, tree: DraftTree, verdict: Verdict, observe_s: dict[str, float],
                topk_s: float) -> None:
        """Each drafter's time this step to its ledger and stats: proposing (already in the stats), learning from
        the verdict (``observe_s``) and its share of the top-k computed for the drafters that read it (``topk_s``);
        for one that proposed, its nodes accepted (by source)."""
        readers = sum(1 for p in run.proposals if p.reads_topk)
        for p in run.proposals:
            extra = observe_s.pop(p.drafter, 0.0) + (topk_s / readers if p.reads_topk else 0.0)
            run.stats.add_draft_time(p.drafter, extra)
            accepted = sum(1 for i in verdict.accepted_nodes if tree.sources[i] in p.sources)
            run.selector.charge(p.drafter, p.seconds + extra, accepted)
        for name, seconds in observe_s.items():  # skipped this step, still learning from it
            run.stats.add_draft_time(name, seconds)
            run.selector.charge_time(name, seconds)

    def _batch_now(self) -> tuple[int, float | None]:
        """The batch this step's forward will likely join: the generations present now, at the last batched
        forward's time (1, None: alone)."""
        if self.batcher is not None and self.batcher.present > 1:
            return self.batcher.present, self.batcher.stats.last_s
        return 1, None

    def _pick_tree(self, run: _Run, tree: DraftTree, batch: int, batch_s: float | None) -> DraftTree:
        """The part of the drafted tree worth verifying at this cache length (maybe nothing), for the batch this
        step's forward will likely join; all of it when the request fixed the budget."""
        if run.config.draft_budget is not None:
            return tree
        return run.selector.select(tree, run.cache.length, batch, batch_s)

    def _observe(
        self, run: _Run, tree: DraftTree, verdict: Verdict, node_topk: torch.Tensor | None, accepted: list[int]
    ) -> dict[str, float]:
        """Count the step and tell the budget policy and the drafters what the target accepted (``node_topk``:
        the target's top-k at every verified row, on the host, when a drafter that proposed reads it); returns
        each drafter's seconds spent learning from it."""
        run.stats.steps += 1
        for source in tree.sources:
            run.stats.add_drafted(source, 1)
        for i in verdict.accepted_nodes:
            run.stats.add_accepted(tree.sources[i], 1)
        if not run.drafters:
            return {}
        run.selector.observe(tree, verdict.accepted_nodes)
        outcome = VerifyOutcome(
            root=run.root,
            tree=tree,
            accepted_nodes=verdict.accepted_nodes,
            new_tokens=[*accepted, verdict.bonus],
            node_topk=node_topk,
            generated=run.output,
        )
        spent = {}
        for d in run.drafters:
            t = time.perf_counter()
            d.observe(outcome)
            spent[d.name] = time.perf_counter() - t
        return spent

    def verify(self, root: int, tree: DraftTree, cache: SlotCache, sampling: SamplingMetadata) -> Judgement:
        """One target forward over root + tree; returns the verdict, given ``sampling.topk`` the target's top-k
        after every row ``[n + 1, topk]`` (on the host), and the log-probabilities ``sampling`` asks for."""
        base = cache.length
        layout = tree_layout(root, tree, base, self.device)
        mask = self._mask(layout.ancestor_mask, base) if len(tree) else None
        logits = self._forward(layout.input_ids, cache, layout.position_ids, mask)
        return self._judge(tree, logits, sampling)

    def _judge(self, tree: DraftTree, logits: torch.Tensor, sampling: SamplingMetadata) -> Judgement:
        """The verdict on a verify forward's ``logits`` ``[n + 1, vocab]`` (the prefill's last row for the first
        token: an empty tree), each row shaped with its own path first, and the rows' top-k, with ONE
        device-to-host transfer (``host.fetch``; log-probabilities, when asked for, take a second). What the host
        needs is computed where the logits are: greedy, every row's argmax (the greedy token stays ``argmax``: its
        ties may break unlike ``topk``'s); sampling, every row's p. Rejection sampling (with the request's CPU
        generator) and coupled sampling then run on the host copy, so a CPU generator never meets a device
        tensor."""
        params, topk = sampling.params, sampling.topk
        if sampling.shaper is not None:
            logits = sampling.shaper.shape_(logits, sampling.output, row_paths(tree))
        t = time.perf_counter()
        cues = [torch.topk(logits, min(topk, logits.shape[-1]), dim=-1).indices] if topk is not None else []
        topk_s = time.perf_counter() - t if cues else 0.0
        node_topk: torch.Tensor | None
        if params.greedy:
            best, *got = host.fetch(host.argmax(logits), *cues)
            verdict, node_topk = greedy_path(tree, best.tolist()), (got[0] if got else None)
        else:
            probs, *got = host.fetch(target_probs(logits, params), *cues)
            node_topk = got[0] if got else None
            if sampling.noise is not None:  # seeded: coupled, so the answer does not depend on what was drafted
                verdict = verify_coupled(tree, probs, sampling.noise, sampling.position)
            else:
                verdict = verify_sampling(tree, probs, sampling.generator, params.eta)
        if sampling.logprobs is None:
            return Judgement(verdict, node_topk, None, topk_s)
        path = [0, *(i + 1 for i in verdict.accepted_nodes)]  # row r predicts the token emitted after it
        emitted = [*(tree.tokens[i] for i in verdict.accepted_nodes), verdict.bonus]
        return Judgement(verdict, node_topk, token_logprobs(logits[path], emitted, sampling.logprobs), topk_s)


class _Proposal(NamedTuple):
    """One drafter's tree of one step: who, how long it took, the node sources it labels its nodes with."""

    drafter: str
    seconds: float
    sources: frozenset[str]
    reads_topk: bool  # it reads the target's top-k at every verified row (computed for it: charged to it)


@dataclass
class _Run:
    """One generation's state between decoding steps."""

    config: GenerationConfig
    sampling: SamplingParams
    generator: torch.Generator | None
    noise: SeededNoise | None
    cache: SlotCache
    drafters: list[Drafter]
    selector: TreeSelector
    stats: GenerationStats
    max_new: int
    root: int  # the last token, not yet in the cache: every step's forward starts with it
    output: list[int]  # the answer's tokens so far (``AnswerText.ids``, the same list)
    node_topk: int | None = None  # this step: the target's top-k kept at every verified row, for drafters that read it
    shaper: LogitShaper | None = None
    logprobs: list[TokenLogprob] | None = None  # one per emitted token (may run past ``output``), when asked for
    sent: int = 0  # logprobs already handed out in events
    proposals: list[_Proposal] = field(default_factory=list)  # this step's drafters (``Engine._charge``)

    def metadata(self) -> SamplingMetadata:
        """This step's sampling state (made afresh each step: the output grows between steps)."""
        return SamplingMetadata(self.sampling, self.generator, self.noise, self.output, self.node_topk, self.shaper,
                                self.config.logprobs)

    def new_logprobs(self, answer: AnswerText) -> list[TokenLogprob]:
        """The log-probabilities of the answer's tokens not yet in an event (a harmony answer's: its final
        channel's, ``AnswerText.answer_part``)."""
        if self.logprobs is None:
            return []
        lo, self.sent = self.sent, len(self.output)
        return answer.answer_part(self.logprobs, lo, self.sent)


def _token_event(text: str, answer: AnswerText, run: _Run) -> Iterator[TokenEvent]:
    """The event of a step's new answer text and reasoning, if either is new; the log-probabilities go with the
    answer's text (held-back tokens' with the text that releases them)."""
    reasoning = answer.take_reasoning()
    if text or reasoning:
        yield TokenEvent(text, answer.ids[:], run.new_logprobs(answer) if text else [], reasoning)


def _generator(sampling: SamplingParams) -> torch.Generator | None:
    if sampling.greedy:
        return None
    gen = torch.Generator()
    gen.manual_seed(sampling.seed if sampling.seed is not None else int(time.time_ns() % (2**63)))
    return gen
