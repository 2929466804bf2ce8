"""The prefix cache's tiers on the device: a prefix read back from disk after a restart (its KV on the device,
its top-k on the host, where a prefill's fresh top-k is), entries evicted to host memory and brought back,
and the device tier sized from the device's free memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.serving.kv_tuning import free_device_bytes, kv_budgets
from decoding.cache.prefix import PrefixCache, PrefixEntry
from decoding.runtime.loader import LoadedModel
from decoding.runtime.torch_runtime import TorchRuntime
from decoding.speculative.engine import Engine, EngineConfig
from decoding.speculative.generation import DoneEvent, GenerationConfig, Prompt
from tests.gpu.conftest import VOCAB, device_target, tiny_llama

PROMPT = Prompt(prefix_ids=[(7 * i + 3) % VOCAB for i in range(300)], suffix_ids=[5, 17, 42], prefix_key="doc")


def generate(engine: Engine) -> DoneEvent:
    done = list(engine.generate(PROMPT, GenerationConfig(max_new_tokens=12)))[-1]
    assert isinstance(done, DoneEvent)
    return done


def test_a_restart_reads_cached_prefixes_back_onto_the_device(device: torch.device, tmp_path: Path) -> None:
    target = device_target(tiny_llama(device), device)
    config = EngineConfig(prompt_topk=4)  # the engine records the prompt's top-k (RACER's cues)
    first = Engine(target, PrefixCache(1 << 30, tmp_path, device=device), config=config)
    assert first.warm_prefix(Prompt(PROMPT.prefix_ids, [], prefix_key="doc"))
    before = generate(first)
    assert first.prefix_cache is not None
    first.prefix_cache.flush()
    restarted = PrefixCache(1 << 30, tmp_path, device=device)
    [loaded] = restarted.match([next(tmp_path.glob("*.safetensors")).stem])
    assert loaded.device.type == device.type and loaded.topk is not None and loaded.topk.device.type == "cpu"
    after = generate(Engine(target, restarted, config=config))  # concatenates cached and fresh top-k
    assert after.stats.prefix_reused_tokens == len(PROMPT.prefix_ids) and restarted.disk_hits == 1
    assert after.token_ids == before.token_ids


def test_evicted_entries_go_to_host_memory_and_come_back(device: torch.device) -> None:
    if device.type == "cpu":
        pytest.skip("on a CPU the device is the host: there is no host tier")

    def entry(fill: float) -> PrefixEntry:
        kv = tuple(torch.full((1, 2, 64, 16), fill + i, device=device) for i in range(3))
        return PrefixEntry(kv, tuple(-t for t in kv), topk=torch.zeros(64, 4, dtype=torch.long))

    one = entry(0.0).nbytes
    cache = PrefixCache(2 * one, host_budget=2 * one, device=device)
    for i, key in enumerate("abc"):
        cache.put(key, entry(float(i)))
    assert cache.host_bytes == one and cache.bytes_used == 2 * one
    back = cache.get("a")
    assert back is not None and back.device.type == device.type and cache.host_hits == 1
    assert all(torch.equal(k, e) for k, e in zip(back.values, entry(0.0).values, strict=True))
    assert cache.get("b", device=torch.device("cpu")) is not None  # evicted in a's place, read on the host


def test_the_device_tier_is_sized_from_free_device_memory(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("free device memory is measured on CUDA only")
    model = tiny_llama(device, torch.bfloat16)
    target = LoadedModel(model=TorchRuntime(model), tokenizer=None, name="tiny", device=device, dtype=torch.bfloat16,
                         eos_token_ids=(), max_context=1024, vocab_size=VOCAB)
    free = free_device_bytes(device)
    device_bytes, host_bytes = kv_budgets(target, "auto", "auto")
    assert 0 < device_bytes < free and host_bytes > 0
