"""Prefix cache tiers: where loaded entries live, the host tier below the device, quotas for huge entries,
and the tier sizing arithmetic (``decoding.cache.memory``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, Qwen2Config

import decoding.cache.prefix as prefix_cache
from decoding.cache.memory import device_kv_budget, host_kv_budget, kv_bytes_per_token, largest_window
from decoding.cache.prefix import PrefixCache, PrefixEntry
from tests.decoding.conftest import make_tiny_llama

META = torch.device("meta")
CPU = torch.device("cpu")


def entry(n: int, fill: float, layers: int = 2, device: torch.device = CPU) -> PrefixEntry:
    keys = tuple(torch.full((1, 2, n, 4), fill + i, device=device) for i in range(layers))
    values = tuple(torch.full((1, 2, n, 4), -fill - i, device=device) for i in range(layers))
    return PrefixEntry(keys, values, topk=torch.arange(n * 3).view(n, 3))


@pytest.fixture
def host_copies(monkeypatch: pytest.MonkeyPatch) -> list[PrefixEntry]:
    """Every entry the cache copies to host memory (host tier or disk write), in order."""
    copied: list[PrefixEntry] = []
    real = prefix_cache._to_host

    def counting(e: PrefixEntry) -> PrefixEntry:
        copied.append(e)
        return real(e)

    monkeypatch.setattr(prefix_cache, "_to_host", counting)
    return copied


def test_an_entry_read_back_from_disk_has_its_kv_on_the_device_asked_and_its_topk_on_the_host(
    tmp_path: Path,
) -> None:
    e = entry(5, 1.0)
    writer = PrefixCache(byte_budget=1 << 20, persist_dir=tmp_path)
    writer.put("k", e, tag="doc")
    writer.flush()
    restarted = PrefixCache(byte_budget=1 << 20, persist_dir=tmp_path, device=META)  # a restart on a "GPU"
    [got] = restarted.match(["k"])
    assert {t.device for t in (*got.keys, *got.values)} == {META}
    assert got.topk is not None and got.topk.device == CPU and torch.equal(got.topk, e.topk)  # type: ignore[arg-type]
    assert torch.cat([got.topk, torch.zeros(2, 3, dtype=got.topk.dtype)]).shape == (7, 3)  # what a prefill does
    assert restarted.disk_hits == 1 and len(restarted) == 1
    assert restarted.get("k") is got  # now kept in the device tier
    on_cpu = PrefixCache(byte_budget=1 << 20, persist_dir=tmp_path).get("k")  # the default device: the CPU
    assert on_cpu is not None and torch.equal(on_cpu.keys[1], e.keys[1]) and torch.equal(on_cpu.values[0], e.values[0])


def test_an_entry_keeps_its_topk_on_the_host() -> None:
    kv = (torch.zeros(1, 1, 2, 4, device=META),)
    assert PrefixEntry(kv, kv, topk=torch.zeros(2, 3, dtype=torch.long)).device == META
    with pytest.raises(ValueError, match="host"):
        PrefixEntry(kv, kv, topk=torch.zeros(2, 3, dtype=torch.long, device=META))


def test_evicted_entries_move_to_the_host_tier_and_come_back_to_the_device(host_copies: list[PrefixEntry]) -> None:
    one = entry(4, 1.0).nbytes
    # the device tier of a "GPU" cache (its entries stand on the CPU here: meta tensors have no data to copy)
    cache = PrefixCache(byte_budget=2 * one, host_budget=2 * one, device=META)
    for i, key in enumerate("abc"):
        cache.put(key, entry(4, float(i)), tag="doc" if key == "a" else None)
    assert len(cache) == 2 and cache.bytes_used == 2 * one and cache.host_bytes == one  # a went to the host
    assert [c.keys[0][0, 0, 0, 0].item() for c in host_copies] == [0.0]
    a = cache.get("a", device=CPU)
    assert a is not None and a.keys[1][0, 0, 0, 0].item() == 1.0 and a.values[0][0, 0, 0, 0].item() == 0.0
    assert (cache.hits, cache.host_hits, cache.disk_hits, cache.misses) == (1, 1, 0, 0)
    assert cache.host_bytes == one and len(cache) == 2  # a is back in the device tier, whose LRU (b) went down
    cache.put("d", entry(4, 3.0))
    cache.put("e", entry(4, 4.0))  # c then a go down; the host tier is an LRU too: its oldest (b) goes for good
    assert cache.get("b") is None and cache.misses == 1
    assert cache.host_bytes == 2 * one and cache.bytes_used == 2 * one
    assert cache.drop("doc") == 1 and cache.host_bytes == one  # a drop reaches every tier
    c = cache.get("c")  # to the cache's device by default
    assert c is not None and c.device == META and c.topk is not None and c.topk.device == CPU
    assert cache.host_hits == 2 and cache.host_bytes == one and len(cache) == 2  # d went down in its place


def test_on_a_cpu_the_host_tier_is_off(host_copies: list[PrefixEntry]) -> None:
    one = entry(4, 1.0).nbytes
    cache = PrefixCache(byte_budget=2 * one, host_budget=10 * one)  # the device is the host
    assert cache.host_budget == 0
    for i, key in enumerate("abc"):
        cache.put(key, entry(4, float(i)))
    assert cache.get("a") is None and cache.host_bytes == 0 and cache.host_hits == 0
    assert host_copies == []  # no second copy of anything


def test_an_entry_too_big_for_the_device_tier_is_kept_on_the_host() -> None:
    small, big = entry(2, 1.0), entry(8, 2.0)
    cache = PrefixCache(byte_budget=small.nbytes, host_budget=big.nbytes, device=META)
    cache.put("big", big)
    assert len(cache) == 0 and cache.host_bytes == big.nbytes
    assert cache.get("big", device=CPU) is not None and cache.host_bytes == big.nbytes  # stays: too big to move


def test_an_entry_over_the_disk_quota_is_not_written_and_evicts_nothing(tmp_path: Path) -> None:
    small, big = entry(2, 1.0), entry(64, 2.0)
    cache = PrefixCache(byte_budget=1 << 20, persist_dir=tmp_path, disk_budget=big.nbytes // 2)
    cache.put("small", small)
    cache.flush()
    cache.put("big", big)
    cache.flush()
    assert [p.stem for p in tmp_path.glob("*.safetensors")] == ["small"]
    assert cache.get("big") is big  # still kept in memory, where it fits
    # an entry whose bytes fit the quota but whose file (with its header) does not: that file alone goes
    exact = PrefixCache(byte_budget=1 << 20, persist_dir=tmp_path, disk_budget=big.nbytes)
    exact.put("big", big)
    exact.flush()
    assert [p.stem for p in tmp_path.glob("*.safetensors")] == ["small"] and exact.disk_bytes == cache.disk_bytes


def test_an_entry_larger_than_every_tier_is_not_copied_to_the_host(
    tmp_path: Path, host_copies: list[PrefixEntry]
) -> None:
    huge = entry(64, 1.0, device=META)  # meta tensors: any copy to the host would raise
    budget = huge.nbytes // 2
    cache = PrefixCache(byte_budget=budget, persist_dir=tmp_path, disk_budget=budget, host_budget=budget,
                        device=META)
    cache.put("huge", huge, tag="doc")
    cache.flush()
    assert host_copies == [] and len(cache) == 0 and cache.host_bytes == 0
    assert not list(tmp_path.iterdir()) and cache.get("huge") is None


def test_disk_writers_hold_one_host_copy_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several puts at once (a long document's segments) must not each copy their entry to host memory."""
    live, peak, guard = [0], [0], threading.Lock()
    real_to_host, real_save = prefix_cache._to_host, prefix_cache.save_file

    def copying(e: PrefixEntry) -> PrefixEntry:
        with guard:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        return real_to_host(e)

    def slow_save(*args: object, **kwargs: object) -> None:
        time.sleep(0.05)  # a disk write of gigabytes: the other writers are started meanwhile
        real_save(*args, **kwargs)  # type: ignore[arg-type]
        with guard:
            live[0] -= 1

    monkeypatch.setattr(prefix_cache, "_to_host", copying)
    monkeypatch.setattr(prefix_cache, "save_file", slow_save)
    cache = PrefixCache(byte_budget=1 << 20, persist_dir=tmp_path)
    for i in range(4):
        cache.put(f"seg{i}", entry(5, float(i)), tag="doc")
    cache.flush()
    assert peak[0] == 1 and live[0] == 0
    assert sorted(p.stem for p in tmp_path.glob("*.safetensors")) == ["seg0", "seg1", "seg2", "seg3"]
    again = PrefixCache(byte_budget=1 << 20, persist_dir=tmp_path).get("seg2")
    assert again is not None and torch.equal(again.keys[1], entry(5, 2.0).keys[1])


def test_kv_bytes_per_token_of_known_models() -> None:
    llama_8b = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    qwen_7b = Qwen2Config(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4)
    assert kv_bytes_per_token(llama_8b, torch.bfloat16) == 128 << 10  # 16 GiB at 128K tokens
    assert kv_bytes_per_token(qwen_7b, torch.bfloat16) == 56 << 10


def test_kv_bytes_per_token_is_what_a_forward_stores() -> None:
    for kw in ({}, {"heads": 4, "kv_heads": 4}, {"head_dim": 32}):
        model = make_tiny_llama(layers=3, cpu_kernels=False, **kw)
        cache = DynamicCache()
        with torch.inference_mode():
            model(torch.arange(11).view(1, 11), past_key_values=cache, use_cache=True)
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values) if t is not None]
        stored = sum(t.numel() * t.element_size() for t in tensors)
        assert len(tensors) == 2 * 3
        assert kv_bytes_per_token(model.config, model.dtype) * 11 == stored


def test_device_budget_leaves_room_for_one_generation_at_the_window() -> None:
    gib, per_token = 1 << 30, 128 << 10  # an 8B model in bf16
    budget = device_kv_budget(100 * gib, per_token, 131072, margin_bytes=2 * gib, fraction=0.9)
    assert budget == int((100 - 16 - 2) * gib * 0.9)
    assert device_kv_budget(100 * gib, per_token, 8192) > budget  # a shorter window sets less aside
    assert device_kv_budget(17 * gib, per_token, 131072) == 0  # nothing left: the lower tiers hold it all


def test_largest_window_is_what_one_generation_leaves_room_for() -> None:
    gib, per_token = 1 << 30, 128 << 10  # Llama-3.1-8B in bf16
    assert largest_window(7 * gib, per_token, margin_bytes=2 * gib) == 40960  # 5 GiB / 128 KiB
    assert largest_window(18 * gib, per_token, margin_bytes=2 * gib) == 131072
    assert largest_window(18 * gib - 1, per_token, margin_bytes=2 * gib) == 130048  # 131071 tokens, in 1024s
    assert largest_window(18 * gib - 1, per_token, margin_bytes=2 * gib, granule=1) == 131071
    assert largest_window(2 * gib + (100 << 20), per_token, margin_bytes=2 * gib) == 0  # 800 tokens: under 1024
    assert largest_window(gib, per_token, margin_bytes=2 * gib) == 0  # not even the margin


def test_the_host_tier_sets_one_full_window_entry_aside() -> None:
    gib, per_token = 1 << 30, 56 << 10  # Qwen2.5-7B in bf16: 7 GiB at 128K tokens
    assert host_kv_budget(20 * gib, per_token, 131072, fraction=0.4) == int(13 * gib * 0.4)
    assert host_kv_budget(20 * gib, per_token, 8192, fraction=0.5) == int((20 * gib - (448 << 20)) * 0.5)
    assert host_kv_budget(6 * gib, per_token, 131072, fraction=0.4) == 0  # less than one entry left
