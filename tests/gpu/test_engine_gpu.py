"""The engine's device bookkeeping on the device: speculative greedy == autoregressive, unseeded sampling runs
(a CPU generator never meets a device tensor), seeded sampling does not depend on drafting, a prefix cache
read back from disk after a restart feeds prompt top-k, and one device-to-host transfer per decoding step
(counted at ``decoding.runtime.host.fetch``, and on CUDA as synchronizations with ``set_sync_debug_mode``)."""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from decoding.cache.prefix import PrefixCache
from decoding.drafters.prompt_lookup import PromptLookupDrafter
from decoding.drafters.rapid import DraftLM, RapidDrafter
from decoding.runtime import host
from decoding.runtime.torch_runtime import TorchRuntime
from decoding.speculative.drafter import BaseDrafter, Drafter, PromptInfo
from decoding.speculative.engine import Engine, EngineConfig
from decoding.speculative.generation import DoneEvent, GenerationConfig, Prompt, SamplingParams
from tests.gpu.conftest import VOCAB, device_target, tiny_llama

pytestmark = pytest.mark.gpu  # (tests/gpu/conftest.py also marks and skips everything here without CUDA)

N = 32
_rng = random.Random(3)
_BASE = [_rng.randrange(VOCAB) for _ in range(40)]
DOC = _BASE + _BASE[5:35] + [_rng.randrange(VOCAB) for _ in range(10)]  # a repeat: prompt lookup drafts
QUESTION = [7, 11, 13]
UNSEEDED = SamplingParams(temperature=0.9, top_p=0.95)
SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=11)


def _prompt(prefix_key: str | None = None) -> Prompt:
    return Prompt(DOC, QUESTION, prefix_key=prefix_key, segment_ends=[40, 70, len(DOC)] if prefix_key else ())


def _generate(engine: Engine, sampling: SamplingParams = SamplingParams(), drafters: Sequence[Drafter] = (),
              prefix_key: str | None = None, budget: int | None = 8) -> DoneEvent:  # fmt: skip
    cfg = GenerationConfig(max_new_tokens=N, sampling=sampling, draft_budget=budget)
    done = list(engine.generate(_prompt(prefix_key), cfg, drafters))[-1]
    assert isinstance(done, DoneEvent)
    return done


def _tree_drafters(model: Any, device: torch.device, sampling: SamplingParams) -> list[Drafter]:
    """Prompt lookup with branches, and an LM drafter whose nodes carry their q under sampling."""
    return [PromptLookupDrafter(branches=3), RapidDrafter(DraftLM(TorchRuntime(model), device), sampling,
                                                          threshold=0.0)]


@pytest.fixture(scope="module")
def model(device: torch.device) -> Any:
    m = tiny_llama(device, torch.float32, seed=1)
    with torch.no_grad():
        m.lm_head.weight.mul_(4.0)  # peaked enough that drafts get accepted
    return m


def test_speculative_greedy_equals_autoregressive(model: Any, device: torch.device) -> None:
    engine = Engine(device_target(model, device))
    plain = _generate(engine)
    spec = _generate(engine, drafters=_tree_drafters(model, device, SamplingParams()))
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == N
    assert spec.stats.accepted > 0


def test_unseeded_sampling_runs_on_the_device(model: Any, device: torch.device) -> None:
    """Temperature > 0 without a seed, plain and with sampled and point-mass drafts (it used to raise: a CPU
    generator drew from the device's probabilities)."""
    engine = Engine(device_target(model, device))
    plain = _generate(engine, UNSEEDED)
    spec = _generate(engine, UNSEEDED, _tree_drafters(model, device, UNSEEDED))
    assert len(plain.token_ids) == len(spec.token_ids) == N
    assert spec.stats.drafted > 0


def test_seeded_sampling_does_not_depend_on_drafting(model: Any, device: torch.device) -> None:
    engine = Engine(device_target(model, device))
    plain = _generate(engine, SEEDED)
    assert len(set(plain.token_ids)) > 3
    for budget in (2, 8, None):
        assert _generate(engine, SEEDED, _tree_drafters(model, device, SEEDED), budget=budget).token_ids == \
            plain.token_ids  # fmt: skip


class _PromptTopk(BaseDrafter):
    name = "prompt_topk"

    def __init__(self) -> None:
        self.seen: list[torch.Tensor | None] = []

    def begin(self, prompt: PromptInfo) -> None:
        self.seen.append(prompt.prompt_topk)


def test_prefix_cache_from_disk_after_a_restart_with_prompt_topk(
    model: Any, device: torch.device, tmp_path: Path
) -> None:
    """A prefix cache persisted to disk, read by a new cache and engine on the same directory (a restart):
    the prompt's top-k comes from the disk entries and the fresh rows, on the host, the answer is the same."""
    config = EngineConfig(prompt_topk=8)
    first_cache = PrefixCache(1 << 30, persist_dir=tmp_path)
    first, seen_first = Engine(device_target(model, device), first_cache, config=config), _PromptTopk()
    if device.type != "cpu":
        assert first.reader.prefill_chunk == 4096
    before = _generate(first, drafters=[PromptLookupDrafter(), seen_first], prefix_key="doc")
    first_cache.flush()
    assert before.stats.prefix_reused_tokens == 0

    cache = PrefixCache(1 << 30, persist_dir=tmp_path)
    engine, seen = Engine(device_target(model, device), cache, config=config), _PromptTopk()
    after = _generate(engine, drafters=[PromptLookupDrafter(), seen], prefix_key="doc")
    assert cache.disk_hits == 3 and after.stats.prefix_reused_tokens == len(DOC)
    assert after.token_ids == before.token_ids
    got, want = seen.seen[0], seen_first.seen[0]
    assert got is not None and want is not None and got.device.type == want.device.type == "cpu"
    assert torch.equal(got, want) and got.shape == (len(DOC) + len(QUESTION), 8)


class CountingEngine(Engine):
    """Counts ``host.fetch`` calls per decoding step, and on CUDA the synchronizations of the step's work after
    its forward (``_judge``: what the host needs, computed on the device and brought over)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.fetches: list[tuple[str, ...]] = []  # devices of each fetch's tensors
        self.per_step: list[int] = []
        self.syncs: list[int] = []

    def _step(self, run: Any) -> list[int]:
        before = len(self.fetches)
        out = super()._step(run)
        self.per_step.append(len(self.fetches) - before)
        return out

    def _judge(self, *args: Any) -> Any:
        if self.device.type != "cuda":
            return super()._judge(*args)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = super()._judge(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        self.syncs.append(sum("synchroniz" in str(w.message) for w in caught))
        return out


@pytest.mark.parametrize("sampling", [SamplingParams(), UNSEEDED, SEEDED], ids=["greedy", "unseeded", "seeded"])
def test_one_transfer_per_step(
    model: Any, device: torch.device, sampling: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = CountingEngine(device_target(model, device))
    real = host.fetch

    def fetch(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        engine.fetches.append(tuple(t.device.type for t in tensors))
        got = real(*tensors)
        assert all(t.device.type == "cpu" for t in got)
        return got

    monkeypatch.setattr(host, "fetch", fetch)
    done = _generate(engine, sampling, _tree_drafters(model, device, sampling))
    assert done.stats.drafted > 0
    assert engine.per_step == [1] * done.stats.steps
    assert all(d == device.type for devices in engine.fetches for d in devices)
    if device.type == "cuda":
        assert engine.syncs == [1] * done.stats.steps
