"""RAPID's RAG drafter: an LM that reads only the retrieved chunks drafts the long-context target's next tokens.

The drafter LM (the target's own weights by default, or any model with the target's vocabulary) prefills its
own prompt, ``[system][retrieved chunks][question]`` with the target's chat template (``PromptInfo.draft_ids``),
once per request, into its own KV cache. Each step it

1. catches up with the output: its cache keeps the longest prefix of what it has fed that still agrees with
   the generated tokens (drafted tokens the target rejected are cut off), then the missing tokens, root last,
   go through in one forward;
2. drafts a chain of up to ``max_depth`` tokens (gamma), one forward each, stopping early once its own
   probability of its token falls below ``threshold`` (0.1 in the paper);
3. adds its next ``branches`` most likely tokens at the first ``branch_depth`` positions as point-mass
   siblings, so a near miss at the top of the chain still gets a chance.

Greedy requests draft the argmax (point masses: the verifier compares tokens). Sampling requests draw each
chain token from the drafter's own distribution under the request's temperature / top-k / top-p and keep that
distribution q on the node, so recursive rejection sampling stays exact. Every forward is timed: the drafter
reports its seconds per drafted token (``step_cost_s``), and the engine rations its depth by that cost.

A drafter LM may have more or fewer logits than the target while sharing its tokenizer (Qwen2.5-7B pads its
head to 152064 rows, the 0.5B-3B models to 151936; ``decoding.runtime.loader.check_same_vocab`` admits that when both
cover every token id): ``width`` (the target's) fits each drafter distribution to the target's columns, cut
off or padded with probability 0, so q meets p column for column. Should the target ever emit an id past the
drafter's own rows (a padding row it sampled), the drafter cannot read it and stops drafting for the request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from decoding.cache.slot import SlotCache
from decoding.runtime.interface import TargetRuntime
from decoding.speculative.drafter import BaseDrafter, DraftRequest, PromptInfo
from decoding.speculative.generation import SamplingParams
from decoding.speculative.tree import ROOT, DraftTree
from decoding.speculative.verify import target_probs

PREFILL_CHUNK = 1024  # tokens per prefill forward (bounds attention memory on the torch path)


def fit_width(logits: torch.Tensor, width: int | None) -> torch.Tensor:
    """``logits`` ``[..., vocab]`` with exactly ``width`` columns (None: as they are): columns past it cut
    off, missing ones added as -inf (probability 0), so a drafter's q lines up with the target's p."""
    have = logits.shape[-1]
    if width is None or have == width:
        return logits
    if have > width:
        return logits[..., :width]
    return torch.cat([logits, logits.new_full((*logits.shape[:-1], width - have), float("-inf"))], dim=-1)


class DraftLM:
    """A causal LM with its own KV cache: forwards tokens and returns the last position's logits.

    ``model`` is a target runtime (``decoding.runtime.interface.TargetRuntime``: the target's own, or a smaller
    model's); ``vocab`` is its logits' width: ids at or past it cannot be fed.
    """

    def __init__(self, model: TargetRuntime, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.device = torch.device(device)
        self.num_layers = model.num_layers
        self.window = model.max_positions or 1 << 30
        self.vocab = model.vocab_size
        self.cache = model.new_cache(256)

    @property
    def length(self) -> int:
        return self.cache.length

    def start(self, capacity: int) -> None:
        self.cache = self.model.new_cache(max(capacity, 16))

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    def feed(self, ids: Sequence[int]) -> torch.Tensor:
        """Run ``ids`` after the cached rows; the logits ``[vocab]`` after the last one (float32, CPU)."""
        last: torch.Tensor | None = None
        for i in range(0, len(ids), PREFILL_CHUNK):
            part = list(ids[i : i + PREFILL_CHUNK])
            start = self.cache.length
            pos = torch.arange(start, start + len(part), device=self.device)  # [n]
            ids_t = torch.tensor([part], dtype=torch.long, device=self.device)  # [1, n]
            last = self.model.forward(ids_t, self.cache, pos.unsqueeze(0), None, logits_to_keep=1)[-1]
        assert last is not None, "nothing to feed"
        return last.detach().float().cpu()


class RapidDrafter(BaseDrafter):
    """The RAG drafter (``rapid``): a chain from an LM over the retrieved context, plus near-miss branches.

    ``width``: the target's logits width, when the drafter LM's may differ (None: the same); ``relative_cost``: its
    expected cost per drafted token against a target step before it has measured one (the registry passes its
    model's weight bytes over the target's).
    """

    name = "rapid"

    def __init__(
        self,
        lm: DraftLM,
        sampling: SamplingParams | None = None,
        *,
        gamma: int = 10,
        threshold: float = 0.1,
        branches: int = 1,
        branch_depth: int = 2,
        cost_ema: float = 0.3,
        width: int | None = None,
        relative_cost: float = 1.0,
    ) -> None:
        if gamma < 1:
            raise ValueError("gamma must be >= 1")
        if not 0.0 <= threshold < 1.0:
            raise ValueError("threshold must be in [0, 1)")
        self.lm = lm
        self.sampling = sampling or SamplingParams()
        self.max_depth = gamma
        self.threshold = threshold
        self.branches = branches
        self.branch_depth = branch_depth
        self.cost_ema = cost_ema
        self.width = width
        self.relative_cost = relative_cost  # its cost per token against a target step until measured
        self.step_cost_s = 0.0  # measured per request: the first chain sets it
        self.prefill_s = 0.0
        self.forwards = 0
        self.draft_s = 0.0  # seconds in its drafting forwards (catch-up and chain), over the request
        self._generator: torch.Generator | None = None
        self.reset()

    def reset(self) -> None:
        self._pending: list[int] | None = None  # the drafter's prompt, until its first draft reads it
        self.setup_tokens = 0
        self._prompt_len = 0
        self._fed: list[int] = []  # generated (and drafted) tokens whose KV follows the prompt in the cache
        self.active = False  # False: the prompt did not fit the drafter's window; nothing is drafted

    def begin(self, prompt: PromptInfo) -> None:
        """Note the drafter's prompt; it is read at the first draft the engine grants (``setup_tokens`` until
        then): a drafter that never pays back its prefill never runs it."""
        self.reset()
        ids = list(prompt.draft_ids if prompt.draft_ids is not None else prompt.prompt_ids)
        if len(ids) + 2 * self.max_depth >= self.lm.window:
            return
        self.active = True
        self._pending = ids
        self.setup_tokens = len(ids)
        self._seed()

    def _prefill(self) -> None:
        t = time.perf_counter()
        ids, self._pending, self.setup_tokens = self._pending or [], None, 0
        self.lm.start(len(ids) + 512)
        if ids:
            self.lm.feed(ids)
        self.prefill_s = time.perf_counter() - t
        self._prompt_len = self.lm.length

    def _seed(self) -> None:
        """A sampling request's drafts come from their own generator (seeded from the request's seed)."""
        if not self.sampling.greedy:
            self._generator = torch.Generator()
            seed = self.sampling.seed if self.sampling.seed is not None else time.time_ns() % (2**63)
            self._generator.manual_seed(int(seed) ^ 0x5EED)

    def propose(self, request: DraftRequest) -> DraftTree:
        depth = min(self.max_depth, request.budget)
        if request.max_depth is not None:
            depth = min(depth, request.max_depth)
        depth = min(depth, self.lm.window - self._prompt_len - len(request.generated) - 1)
        tree = DraftTree()
        if not self.active or depth <= 0 or not request.generated:
            return tree
        if self._pending is not None:
            self._prefill()
        t = time.perf_counter()
        forwards = 1
        logits = self._first(list(request.generated))
        if logits is None:
            return tree
        try:
            parent = ROOT
            for d in range(depth):
                q = self._distribution(logits)
                tok = self._pick(q)
                if float(q[tok]) < self.threshold:
                    break
                node = tree.add(parent, tok, self.name, prob=None if self.sampling.greedy else q, kind=self.name)
                if d < self.branch_depth and self.branches > 0 and len(tree) < request.budget:
                    self._add_branches(tree, parent, q, tok, request.budget)
                parent = node
                if d + 1 >= depth or len(tree) >= request.budget:
                    break
                logits = self._next(tok)
                forwards += 1
        finally:
            self._done()
        self._time(time.perf_counter() - t, forwards)
        return tree

    # The three steps of a chain; RapidKVDrafter reads the target's own KV instead.

    def _first(self, generated: list[int]) -> torch.Tensor | None:
        """The logits after the root: the drafter's cache brought in step with the output (None: it cannot
        be, and the drafter has stopped for this request)."""
        return self._catch_up(generated)

    def _next(self, token: int) -> torch.Tensor:
        """The logits after the drafted ``token``."""
        self._fed.append(token)
        return self.lm.feed([token])

    def _done(self) -> None:
        """After the chain (its own cache is rolled back lazily, at the next catch-up)."""

    def _catch_up(self, generated: list[int]) -> torch.Tensor | None:
        """Cut the cache back to what still agrees with the output, feed the rest (root last); None, and no
        more drafts this request, when the output holds an id the drafter LM has no row for or its cache cannot be
        cut back that far."""
        keep = 0
        limit = min(len(self._fed), len(generated) - 1)  # the root is fed again: its logits are needed
        while keep < limit and self._fed[keep] == generated[keep]:
            keep += 1
        if self.lm.vocab and max(generated[keep:]) >= self.lm.vocab:
            self.active = False
            return None
        try:
            self.lm.truncate(self._prompt_len + keep)
        except ValueError:  # a sliding-window drafter dropped rows that far back (a chain past its cache's margin)
            self.active = False
            return None
        self._fed = generated[:]
        return self.lm.feed(generated[keep:])

    def _pick(self, q: torch.Tensor) -> int:
        return int(q.argmax()) if self.sampling.greedy else int(torch.multinomial(q, 1, generator=self._generator))

    def _distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """q over the target's columns (greedy: the plain softmax, whose argmax is the chain's token)."""
        logits = fit_width(logits, self.width)
        if self.sampling.greedy:
            return torch.softmax(logits, dim=-1)
        return target_probs(logits, self.sampling)

    def _add_branches(self, tree: DraftTree, parent: int, q: torch.Tensor, chosen: int, budget: int) -> None:
        """The next most likely tokens as point-mass siblings of the chain's node (deterministic drafts); none
        the drafter gives probability 0 (a padded column: the drafter could not read it back)."""
        alts = [a for a in torch.topk(q, min(self.branches + 1, q.numel())).indices.tolist() if a != chosen]
        for alt in alts[: self.branches]:
            if len(tree) >= budget or float(q[alt]) < self.threshold or float(q[alt]) <= 0.0:
                return
            tree.add(parent, int(alt), self.name, kind=f"{self.name}/alt")

    def _time(self, seconds: float, forwards: int) -> None:
        per = seconds / max(1, forwards)
        self.forwards += forwards
        self.draft_s += seconds
        old = self.step_cost_s
        self.step_cost_s = per if old == 0.0 else (1 - self.cost_ema) * old + self.cost_ema * per


class RapidKVDrafter(RapidDrafter):
    """``rapid_kv``: the target drafts with its own weights while attending only to its already-cached KV rows
    of the system prompt, the retrieved chunks, the question (``PromptInfo.draft_rows``) and the generated
    tokens. No drafter prefill and no second cache: the chunk rows were computed with the whole document as
    their left context, positions are the true ones. The drafted tokens' rows are written after the target's
    cached rows and cut off again after the chain (the verify pass writes its own there)."""

    name = "rapid_kv"

    def __init__(self, model: TargetRuntime, sampling: SamplingParams | None = None, **kw: Any) -> None:
        # its inputs and mask go where the target is (a GPU target's own device, not the CPU)
        super().__init__(DraftLM(model, model.device), sampling, **kw)
        self.model = model
        self._cache: SlotCache | None = None
        self._seen = torch.zeros(0, dtype=torch.bool)  # prompt rows the drafter reads
        self._dtype: torch.dtype = model.dtype

    def begin(self, prompt: PromptInfo) -> None:
        self.reset()
        self.prefill_s = 0.0
        if prompt.target_cache is None or prompt.draft_rows is None:
            return
        n = len(prompt.prompt_ids)
        seen = torch.zeros(n, dtype=torch.bool)
        for a, b in prompt.draft_rows:
            seen[max(0, a) : min(n, b)] = True
        self._cache, self._seen, self.active = prompt.target_cache, seen, True
        self._prompt_len = n
        self._seed()

    def _first(self, generated: list[int]) -> torch.Tensor:
        assert self._cache is not None
        self._base = self._cache.length  # prompt + accepted output; the root is not cached yet
        return self._forward(generated[-1])

    def _next(self, token: int) -> torch.Tensor:
        return self._forward(token)

    def _done(self) -> None:
        if self._cache is not None:
            self._cache.truncate(self._base)

    def _forward(self, token: int) -> torch.Tensor:
        """One token after the rows cached so far, seeing the prompt subset and every row after the prompt (of the
        rows every layer still holds: a sliding-window layer's cache drops the rows far behind)."""
        assert self._cache is not None
        length = self._cache.length
        visible = torch.ones(length + 1, dtype=torch.bool)
        visible[: len(self._seen)] = self._seen
        visible[: self._cache.floor] = False
        mask = torch.zeros(1, 1, 1, length + 1, dtype=self._dtype, device=self.lm.device)
        mask[0, 0, 0].masked_fill_(~visible.to(self.lm.device), torch.finfo(self._dtype).min)
        pos = torch.tensor([[length]], device=self.lm.device)  # [1, 1]
        ids = torch.tensor([[token]], dtype=torch.long, device=self.lm.device)  # [1, 1]
        return self.model.forward(ids, self._cache, pos, mask, logits_to_keep=1)[-1].detach().float().cpu()
