"""Prefix cache: LRU by bytes, persistence across instances, drop by tag; slot cache compaction."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from decoding.cache.prefix import PrefixCache, PrefixEntry, prefix_cache_key, segment_keys
from decoding.cache.slot import SlotCache, SlotLayer


def entry(n: int, fill: float, layers: int = 2) -> PrefixEntry:
    keys = tuple(torch.full((1, 2, n, 4), fill + i) for i in range(layers))
    values = tuple(torch.full((1, 2, n, 4), -fill - i) for i in range(layers))
    return PrefixEntry(keys, values, topk=torch.arange(n * 3).view(n, 3))


def test_lru_respects_byte_budget() -> None:
    one = entry(10, 1.0).nbytes
    cache = PrefixCache(byte_budget=int(one * 2.5))
    cache.put("a", entry(10, 1.0))
    cache.put("b", entry(10, 2.0))
    assert cache.get("a") is not None  # a is now most recent
    cache.put("c", entry(10, 3.0))
    assert cache.bytes_used <= cache.byte_budget
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.hits == 3 and cache.misses == 1


def test_entry_over_budget_is_not_kept() -> None:
    cache = PrefixCache(byte_budget=10)
    cache.put("big", entry(10, 1.0))
    assert len(cache) == 0


def test_persistence_and_drop(tmp_path: Path) -> None:
    first = PrefixCache(byte_budget=1 << 20, persist_dir=tmp_path)
    e = entry(7, 5.0)
    first.put("k1", e, tag="doc-1")
    first.put("k2", entry(3, 1.0), tag="doc-2")
    first.flush()
    second = PrefixCache(byte_budget=1 << 20, persist_dir=tmp_path)
    got = second.get("k1")
    assert got is not None and second.disk_hits == 1
    assert all(torch.equal(a, b) for a, b in zip(got.keys, e.keys, strict=True))
    assert got.topk is not None and torch.equal(got.topk, e.topk)  # type: ignore[arg-type]
    assert second.drop("doc-1") >= 1
    assert second.get("k1") is None
    assert not (tmp_path / "k1.safetensors").exists()
    assert (tmp_path / "k2.safetensors").exists()
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    assert second.get("junk") is None  # unreadable file: discarded, not a crash
    assert not (tmp_path / "junk.safetensors").exists()


def test_the_disk_tier_keeps_to_its_quota_least_recently_used_first(tmp_path: Path) -> None:
    probe = PrefixCache(byte_budget=1 << 20, persist_dir=tmp_path / "probe")
    probe.put("x", entry(8, 1.0))
    probe.flush()
    size = probe.disk_bytes
    cache = PrefixCache(byte_budget=1 << 20, persist_dir=tmp_path / "kv", disk_budget=int(size * 2.5))
    for age, key in ((200, "a"), (100, "b")):  # written long ago, a before b (file times keep the order)
        cache.put(key, entry(8, 1.0))
        cache.flush()
        old = time.time() - age
        os.utime(tmp_path / "kv" / f"{key}.safetensors", (old, old))
    assert PrefixCache(byte_budget=1 << 20, persist_dir=tmp_path / "kv").get("a") is not None  # a read: a is recent
    cache = PrefixCache(byte_budget=1 << 20, persist_dir=tmp_path / "kv", disk_budget=int(size * 2.5))
    cache.put("c", entry(8, 1.0))
    cache.flush()
    assert sorted(p.stem for p in (tmp_path / "kv").glob("*.safetensors")) == ["a", "c"]  # b was the oldest
    assert cache.disk_bytes == 2 * size <= cache.disk_budget  # type: ignore[operator]
    smaller = PrefixCache(byte_budget=1 << 20, persist_dir=tmp_path / "kv", disk_budget=size)  # quota lowered
    assert [p.stem for p in (tmp_path / "kv").glob("*.safetensors")] == ["c"] and smaller.disk_bytes == size
    assert smaller.drop("nothing") == 0 and smaller.get("c") is not None


def test_key_binds_model_and_tokens() -> None:
    a = prefix_cache_key("m", "doc", [1, 2, 3])
    assert a == prefix_cache_key("m", "doc", [1, 2, 3])
    assert a != prefix_cache_key("m2", "doc", [1, 2, 3])
    assert a != prefix_cache_key("m", "doc", [1, 2, 4])


def test_segment_keys_chain_every_token_before() -> None:
    ids = [1, 2, 3, 4, 5, 6]
    keys = segment_keys("m", "doc", ids, [2, 4, 6])
    assert keys[0] == prefix_cache_key("m", "doc", [1, 2])  # one segment: the plain prefix key
    assert segment_keys("m", "doc", [1, 2, 3, 4, 9, 9], [2, 4, 6])[:2] == keys[:2]  # shared leading run
    assert segment_keys("m", "doc", [1, 2, 5, 6, 3, 4], [2, 4, 6])[2] != keys[1]  # same tokens, other place
    assert segment_keys("m", "doc", [9, 2, 3, 4, 5, 6], [2, 4, 6])[2] != keys[2]  # anything before differs
    assert segment_keys("m", "doc", ids, [3, 6])[1] != keys[2]  # other cut, same end: other key


def test_match_takes_the_longest_leading_run_and_evicts_tails_first() -> None:
    one = entry(4, 1.0).nbytes
    cache = PrefixCache(byte_budget=one * 3)
    for key in ("s", "a", "b"):
        cache.put(key, entry(4, 1.0))
    assert [e.length for e in cache.match(["s", "a", "x", "b"])] == [4, 4]  # stops at the first miss
    assert cache.match(["x", "s"]) == []
    cache.match(["s", "a", "b"])  # touched b, a, s in that order: s is the most recent
    cache.put("c", entry(4, 1.0))  # evicts the least recent: b, a branch's tail
    assert [len(cache.match(k)) for k in (["s", "a", "b"], ["s", "c"])] == [2, 2]


def test_slot_cache_loads_segments_one_after_the_other() -> None:
    cache = SlotCache(num_layers=2, capacity=2)
    cache.load_prefix([entry(3, 1.0), entry(2, 5.0)])
    assert cache.length == 5
    keys = cache.slot_layers[1].keys
    assert keys is not None and keys[0, 0, :, 0].tolist() == [2.0, 2.0, 2.0, 6.0, 6.0]
    part = cache.snapshot(2, 4)
    assert part.length == 2 and part.keys[0][0, 0, :, 0].tolist() == [1.0, 5.0]


def test_slot_cache_compaction_moves_only_accepted_rows() -> None:
    cache = SlotCache(num_layers=1, capacity=4)  # grows on demand
    layer = cache.slot_layers[0]
    base = torch.arange(3, dtype=torch.float32).view(1, 1, 3, 1)
    layer.update(base, -base)
    tree = torch.arange(10, 16, dtype=torch.float32).view(1, 1, 6, 1)
    layer.update(tree, -tree)  # root + 5 nodes at rows 3..8
    assert cache.length == 9 and layer.capacity >= 9
    cache.compact(3, [0, 2, 5])
    assert cache.length == 6
    assert layer.keys is not None
    assert layer.keys.flatten().tolist() == [0, 1, 2, 10, 12, 15]
    assert layer.values is not None and layer.values.flatten().tolist() == [0, -1, -2, -10, -12, -15]


def test_a_shared_prefix_is_refused_where_it_cannot_be_read_in_place() -> None:
    """Sharing goes first into an empty layer, with keys and values alike and rows contiguous; rows below it are read
    only. Each refusal leaves the layer as it was."""
    k = torch.randn(1, 2, 8, 4)
    layer = SlotLayer(16)
    with pytest.raises(ValueError, match="alike"):
        layer.share(k, torch.randn(1, 2, 8, 6)[..., :4])  # rows not next to each other
    with pytest.raises(ValueError, match="alike"):
        layer.share(k, k[:, :, :4])
    assert layer.length == 0 and layer.split == 0
    v = k.clone()
    layer.share(k, v)
    assert torch.equal(layer.keys, k) and torch.equal(layer.rows(2, 5)[1], v[:, :, 2:5])  # no buffer of its own yet
    with pytest.raises(ValueError, match="empty cache layer"):
        layer.share(k, k.clone())
    with pytest.raises(ValueError, match="read only"):
        layer.truncate(3)
    assert layer.length == 8 and layer.split == 8
