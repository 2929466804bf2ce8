"""A RAPID drafter LM whose logits are wider or narrower than the target's, with the same tokenizer (Qwen2.5-7B
pads its head to 152064 rows, Qwen2.5-0.5B-3B to 151936): the vocabulary check admits it when both widths
cover the tokenizer, its distributions are fitted to the target's width, and decoding stays exact (greedy and
sampled)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from decoding.drafters.rapid import fit_width
from decoding.drafters.registry import DraftingKit, DraftLM, RapidDrafter, build_drafters
from decoding.errors import VocabularyMismatch
from decoding.runtime import kernels
from decoding.runtime.loader import check_same_vocab, load_model
from decoding.runtime.quant import WeightType
from decoding.runtime.quantized import QuantizedModel
from decoding.runtime.torch_runtime import TorchRuntime
from decoding.runtime.weights import weights_from_hf
from decoding.speculative.drafter import DraftRequest, PromptInfo
from decoding.speculative.engine import Engine
from decoding.speculative.generation import DoneEvent, GenerationConfig, Prompt, SamplingParams
from decoding.speculative.tree import DraftTree
from decoding.speculative.verify import target_probs
from tests.decoding.conftest import (
    PROMPT,
    VOCAB,
    make_tiny_llama,
    make_tokenizer,
    naive_greedy,
    next_token_probs,
    run,
    save_tiny_model,
    tiny_target,
    tv,
)

N = 40
DRAFT_IDS = [5, 17, 3, 3, 42, 9]


def _pad_rows(model: Any, real: int, scale: float = 0.0) -> Any:
    """Rows ``real..`` of the head of a torch-runtime ``model`` become padding: zero (logit 0, as a padded row that
    nothing trained), or ``scale`` times the first real rows (a padded column that would often win an unfitted
    argmax)."""
    with torch.no_grad():
        w = model.module.lm_head.weight
        extra = w.shape[0] - real
        w[real:] = scale * w[:extra] if scale else 0.0
    return model


class Recording(RapidDrafter):
    """Keeps every tree it proposed."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.trees: list[DraftTree] = []

    def propose(self, request: DraftRequest) -> DraftTree:
        tree = super().propose(request)
        self.trees.append(tree)
        return tree


# --- the vocabulary check -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """HF dirs sharing one tokenizer (``size`` ids) at several logits widths, and one with another tokenizer."""
    torch.set_num_threads(1)
    tok = make_tokenizer()
    size = len(tok)
    dirs: dict[str, Path] = {}
    for name, width in {"exact": size, "wide": size + 16, "short": size - 1}.items():
        dirs[name] = tmp_path_factory.mktemp(name)
        save_tiny_model(dirs[name], tok, seed=len(dirs), vocab=width)
    other = make_tokenizer(["zebra yak xylophone wombat vortex " * 3, "umbrella tundra sierra quokka"] * 4)
    dirs["other"] = tmp_path_factory.mktemp("other")
    save_tiny_model(dirs["other"], other, vocab=size + 16)
    return dirs


def test_same_tokenizer_at_other_widths_passes(saved: dict[str, Path]) -> None:
    exact, wide = load_model(str(saved["exact"])), load_model(str(saved["wide"]))
    assert wide.vocab_size == exact.vocab_size + 16 == len(exact.tokenizer) + 16
    check_same_vocab(exact, wide)  # drafter wider than the target
    check_same_vocab(wide, exact)  # drafter narrower (the Qwen2.5-7B target, a 0.5B drafter)


def test_a_width_short_of_the_tokenizer_or_another_tokenizer_is_refused(saved: dict[str, Path]) -> None:
    exact, wide, short = (load_model(str(saved[k])) for k in ("exact", "wide", "short"))
    for target, drafter in ((exact, short), (short, exact), (wide, short)):
        with pytest.raises(VocabularyMismatch, match=f"not both covering the tokenizer's {len(exact.tokenizer)} ids"):
            check_same_vocab(target, drafter)
    with pytest.raises(VocabularyMismatch, match="tokenizers differ on"):
        check_same_vocab(exact, load_model(str(saved["other"])))  # its width covers the target's ids


# --- fitting a drafter's logits to the target's width -------------------------------------------------------


def test_fit_width_cuts_or_pads_with_probability_zero() -> None:
    logits = torch.tensor([0.5, 2.0, -1.0, 9.0])
    assert fit_width(logits, None) is logits and fit_width(logits, 4) is logits
    assert fit_width(logits, 3).tolist() == [0.5, 2.0, -1.0]
    padded = fit_width(logits, 6)
    assert padded[:4].tolist() == logits.tolist() and torch.isneginf(padded[4:]).all()
    q = target_probs(padded, SamplingParams(temperature=0.7, top_k=5, top_p=0.9))
    assert q.shape == (6,) and q[4:].sum() == 0 and abs(float(q.sum()) - 1.0) < 1e-6


def _kit(target: Any, drafter: Any, sampling: SamplingParams | None = None) -> DraftingKit:
    return DraftingKit(draft_lm=lambda: DraftLM(drafter), target_model=target, sampling=sampling or SamplingParams())


def _rapid(kit: DraftingKit, **kw: Any) -> Recording:
    """The registry's RAPID drafter (its width from the kit's target), rebuilt as a recording one."""
    built = build_drafters("rapid", kit)[0]
    assert isinstance(built, RapidDrafter)
    return Recording(built.lm, built.sampling, width=built.width, **kw)


def test_greedy_with_a_wider_drafter_is_exact_and_never_drafts_a_padded_column() -> None:
    torch.set_num_threads(1)
    target = tiny_target(0)
    # padded rows 97.. are 3x rows 0..15: the drafter's unfitted argmax is often a padded id
    drafter = _pad_rows(TorchRuntime(make_tiny_llama(7, vocab=VOCAB + 16)), VOCAB, scale=3.0)
    raw = DraftLM(drafter)
    raw.start(64)
    assert any(int(raw.feed([t]).argmax()) >= VOCAB for t in [*PROMPT.ids, *DRAFT_IDS])
    rapid = _rapid(_kit(target.model, drafter), gamma=4, threshold=0.0)
    assert rapid.width == VOCAB
    done = run(Engine(target), Prompt(PROMPT.prefix_ids, PROMPT.suffix_ids, draft_ids=DRAFT_IDS), N, [rapid], 8)
    assert done.token_ids == naive_greedy(target.model, PROMPT.ids, N)
    drafted = [t for tree in rapid.trees for t in tree.tokens]
    assert drafted and max(drafted) < VOCAB


def test_greedy_with_a_narrower_drafter_is_exact() -> None:
    """The target has 16 padded rows (logit 0) past the tokenizer's 97 ids; the drafter has just the 97."""
    torch.set_num_threads(1)
    target = tiny_target(0, vocab=VOCAB + 16)
    _pad_rows(target.model, VOCAB)
    rapid = _rapid(_kit(target.model, TorchRuntime(make_tiny_llama(7, vocab=VOCAB))), gamma=4, threshold=0.0)
    assert rapid.width == VOCAB + 16
    done = run(Engine(target), Prompt(PROMPT.prefix_ids, PROMPT.suffix_ids, draft_ids=DRAFT_IDS), N, [rapid], 8)
    assert done.token_ids == naive_greedy(target.model, PROMPT.ids, N)
    assert done.stats.drafted_by_source.get("rapid", 0) > 0 and rapid.active


# --- sampling ---------------------------------------------------------------------------------------------------

IDS = 6  # the tokenizer's ids in the sampling tests
SAMPLED = Prompt(prefix_ids=[1, 2, 3], suffix_ids=[4, 5], draft_ids=[2, 4, 5])


def _sampling_pair(target_width: int, drafter_width: int) -> tuple[Any, Any]:
    """On the quantized runtime where the kernels load (thousands of generations, several times faster; zero
    padded rows quantize to exact zeros), else on transformers."""
    target = tiny_target(seed=3, vocab=target_width, peaked=5.0)
    _pad_rows(target.model, IDS)  # padded rows (if any) have logit 0: the target samples them now and then
    drafter = _pad_rows(TorchRuntime(make_tiny_llama(4, vocab=drafter_width, peaked=8.0)), IDS)  # sure, often wrong
    if kernels.load() is not None:
        quantized = QuantizedModel(weights_from_hf(target.model.module, WeightType.Q4_1))
        target = dataclasses.replace(target, model=quantized)
        drafter = QuantizedModel(weights_from_hf(drafter.module, WeightType.Q4_1))
    return target, drafter


@pytest.mark.parametrize("widths", [(IDS, IDS + 2), (IDS + 2, IDS)], ids=["wider_drafter", "narrower_drafter"])
def test_sampled_drafts_from_another_width_keep_the_target_distribution(widths: tuple[int, int]) -> None:
    """Two sampled tokens (recursive rejection sampling over the drafter's q) vs. the exact two-token
    distribution of the target over its whole width; every node's q has the target's width."""
    torch.set_num_threads(1)
    target, drafter = _sampling_pair(*widths)
    width = widths[0]
    params = SamplingParams(temperature=1.0)
    p1, p2 = next_token_probs(target.model, SAMPLED, params)
    exact = {(a, b): float(p1[a] * p2[a, b]) for a in range(width) for b in range(width)}
    engine, kit = Engine(target), _kit(target.model, drafter, params)
    trials, counts, nodes = 2000, Counter[object](), 0
    for _ in range(trials):
        rapid = _rapid(kit, gamma=3, threshold=0.0, branches=0)
        cfg = GenerationConfig(max_new_tokens=2, sampling=params, draft_budget=4)
        done = list(engine.generate(SAMPLED, cfg, [rapid]))[-1]
        assert isinstance(done, DoneEvent)
        counts[tuple(done.token_ids)] += 1
        for tree in rapid.trees:
            assert all(q is not None and q.shape == (width,) for q in tree.probs)
            nodes += len(tree)
    assert nodes > trials // 2  # the drafter drafted (one step before the last token, mostly one node)
    if width > IDS:  # the target sampled a padded id, which the narrower drafter cannot read: it stopped
        assert sum(c for k, c in counts.items() if isinstance(k, tuple) and k[0] >= IDS) > 0
    # an exact sampler's distance over 36 / 64 outcomes at 2000 draws: mean 0.05 / 0.06, max of 20000 runs 0.08 / 0.09
    assert tv(counts, exact, trials) < 0.1, tv(counts, exact, trials)


@pytest.mark.parametrize("widths", [(IDS, IDS + 2), (IDS + 2, IDS)], ids=["wider_drafter", "narrower_drafter"])
def test_seeded_sampling_is_the_same_with_and_without_the_drafter(widths: tuple[int, int]) -> None:
    torch.set_num_threads(1)
    target, drafter = _sampling_pair(*widths)
    engine = Engine(target)
    for seed in range(8):
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
        cfg = GenerationConfig(max_new_tokens=12, sampling=params, draft_budget=4)
        plain = list(engine.generate(SAMPLED, cfg, []))[-1]
        rapid = _rapid(_kit(target.model, drafter, params), gamma=3, threshold=0.0)
        drafted = list(engine.generate(SAMPLED, cfg, [rapid]))[-1]
        assert isinstance(plain, DoneEvent) and isinstance(drafted, DoneEvent)
        assert drafted.token_ids == plain.token_ids
        assert all(q is None or q.shape == (widths[0],) for tree in rapid.trees for q in tree.probs)


def test_an_output_id_past_the_drafters_rows_stops_it() -> None:
    """A padded id the target sampled has no row in a narrower drafter: it drafts nothing more (no crash)."""
    torch.set_num_threads(1)
    rapid = RapidDrafter(DraftLM(TorchRuntime(make_tiny_llama(4, vocab=IDS))), width=IDS + 2, threshold=0.0)
    rapid.begin(PromptInfo(prompt_ids=SAMPLED.ids))
    assert len(rapid.propose(DraftRequest(root=3, generated=[3], budget=4))) > 0
    assert len(rapid.propose(DraftRequest(root=IDS + 1, generated=[3, IDS + 1], budget=4))) == 0
    assert not rapid.active
    assert len(rapid.propose(DraftRequest(root=2, generated=[3, IDS + 1, 2], budget=4))) == 0
