"""The GPU check's correctness section: speculative decoding through the engine equals autoregressive greedy on
the device (fp32), and how often they agree in bf16, where rounding may flip a near tie.

Draft trees are random but hold the right tokens (the autoregressive answer) along a random-length path, so
every verify pass mixes accepted and rejected nodes, branches and cut paths.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from typing import Any

import torch

from bench.gpu_models import build_model, target_of
from decoding.speculative.drafter import BaseDrafter, DraftRequest
from decoding.speculative.engine import Engine, EngineConfig
from decoding.speculative.generation import DoneEvent, GenerationConfig, Prompt
from decoding.speculative.tree import ROOT, DraftTree


class ForcedTrees(BaseDrafter):
    """Random draft trees around a known answer: at each level ``width - 1`` random siblings and the answer's
    token at a random place among them, for a random number of levels, then random tokens below; so verify
    passes hold accepted and rejected nodes, branches, and right paths cut at every depth."""

    name = "forced"

    def __init__(self, answer: Sequence[int], vocab: int, seed: int, width: int = 3, depth: int = 6) -> None:
        self.answer, self.vocab, self.width, self.depth = list(answer), vocab, width, depth
        self.rng = random.Random(seed)

    def propose(self, request: DraftRequest) -> DraftTree:
        pos, tree, parent = len(request.generated), DraftTree(), ROOT  # answer[pos]: the token after the root
        right = self.rng.randint(0, self.depth)
        for level in range(self.depth):
            good = self.answer[pos + level] if level < right and pos + level < len(self.answer) else None
            slot, nxt = self.rng.randrange(self.width), parent
            for i in range(self.width):
                if len(tree) >= request.budget:
                    return tree
                tok = good if good is not None and i == slot else self.rng.randrange(self.vocab)
                node = tree.add(parent, tok, self.name)
                nxt = node if (good is not None and i == slot) or (good is None and i == 0) else nxt
            parent = nxt
        return tree


def generate(
    engine: Engine, ids: list[int], n: int, drafters: Sequence[BaseDrafter] = (), budget: int = 16
) -> DoneEvent:
    """``n`` greedy tokens after ``ids`` (the last four are the question, the rest a prefix); a fixed draft
    budget with drafters, so every step verifies what they drafted."""
    config = GenerationConfig(max_new_tokens=n, draft_budget=budget if drafters else None)
    events = list(engine.generate(Prompt(ids[:-4], ids[-4:]), config, drafters))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return done


def nocache_greedy(model: Any, ids: list[int], n: int, device: torch.device) -> list[int]:
    """Reference: every token from a full forward over the whole sequence, no KV cache."""
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq], device=device)).logits[0, -1].argmax()))
    return seq[len(ids) :]


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))  # fmt: skip


def correctness(device: torch.device, n_prompts: int, new_tokens: int, shape: str = "tiny") -> dict[str, Any]:
    """fp32: speculative (forced random trees) == autoregressive == no-cache greedy, per prompt; bf16: how
    many tokens speculative and autoregressive agree on (up to the first difference, per prompt)."""
    torch.manual_seed(0)
    model: Any = build_model(shape, device, torch.float32)
    with torch.no_grad():  # sharper logits: fewer near ties that fp32 kernels of different shapes may round apart
        model.lm_head.weight.mul_(8.0)
    vocab = int(model.config.vocab_size)
    rng = random.Random(0)
    prompts = []
    for _ in range(n_prompts):
        base = [rng.randrange(vocab) for _ in range(48)]
        prompts.append(base + base[8:40] + [rng.randrange(vocab) for _ in range(16)])  # repeats: long accepts
    result: dict[str, Any] = {"model": shape, "prompts": len(prompts), "new_tokens": new_tokens}
    rows: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        engine = Engine(target_of(model if dtype == torch.float32 else copy.deepcopy(model).to(dtype), device,
                                  f"tiny-{dtype}"), config=EngineConfig(max_budget=32))  # fmt: skip
        per: list[dict[str, Any]] = []
        for k, ids in enumerate(prompts):
            ar = generate(engine, ids, new_tokens)
            spec = generate(engine, ids, new_tokens, [ForcedTrees(ar.token_ids, vocab, seed=k)])
            entry: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "spec_first_mismatch":
                     first_mismatch(spec.token_ids, ar.token_ids), "steps": spec.stats.steps,
                     "accepted": spec.stats.accepted, "tokens": len(ar.token_ids)}  # fmt: skip
            if dtype == torch.float32:  # the fp32 engine runs ``model`` itself
                entry["nocache_first_mismatch"] = first_mismatch(nocache_greedy(model, ids, new_tokens, device),
                                                               ar.token_ids)  # fmt: skip
            per.append(entry)
        rows += per
        agreed = sum(e["tokens"] if e["spec_first_mismatch"] is None else e["spec_first_mismatch"] for e in per)
        result[str(dtype).removeprefix("torch.")] = {
            "identical": sum(e["spec_first_mismatch"] is None for e in per),
            "accepted": sum(e["accepted"] for e in per),
            "agreement_rate": round(agreed / max(1, sum(e["tokens"] for e in per)), 4)}  # fmt: skip
    fp32 = [r for r in rows if r["dtype"] == "float32"]
    result["rows"] = rows
    result["fp32_exact"] = all(r["spec_first_mismatch"] is None and r["nocache_first_mismatch"] is None for r in fp32)
    result["passed"] = result["fp32_exact"] and result["float32"]["accepted"] > 0
    return result
