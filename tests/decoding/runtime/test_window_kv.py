"""Sliding-window layers keep only their window's KV (``decoding.cache.slot``): in a generation's cache, in the prefix
cache's entries (every tier, on disk too), in shared prefixes and batches, and every logit stays what a cache keeping
every row gives, bit for bit, on every ISA path.

The tiny windowed families (window ``WINDOW`` = 72) read prompts of ~900 tokens here, so their window layers'
buffers slide several times (a windowed layer holds about its window plus 512 rows)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from decoding.cache.prefix import PrefixCache
from decoding.cache.slot import WINDOW_BLOCK, SlotCache
from decoding.drafters.rapid import RapidKVDrafter
from decoding.runtime import kernels
from decoding.runtime.interface import BatchItem
from decoding.runtime.quant import WeightType
from decoding.runtime.quantized import QuantizedModel
from decoding.runtime.weights import weights_from_hf
from decoding.speculative.engine import Engine
from decoding.speculative.generation import Prompt
from tests.decoding.conftest import (
    WINDOW,
    RandomTreeDrafter,
    TinyTarget,
    TinyTokenizer,
    make_tiny_family,
    needs_kernels,
    run,
)

pytestmark = needs_kernels
HERE = [isa for isa in kernels.ISAS if isa in kernels.available_isas()]
PROMPT = 900  # tokens: the window layers slide, the full layers hold them all
BOUND = WINDOW + 4 * WINDOW_BLOCK  # rows a window layer's buffers may hold (window, margin, a chunk, whole blocks)


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _model(arch: str, kv: torch.dtype = torch.float16, isa: str | None = None) -> QuantizedModel:
    hf = make_tiny_family(arch, seed=3, layers=3, max_position_embeddings=2048)
    model = QuantizedModel(weights_from_hf(hf, WeightType.Q8_0), kv)
    if isa is not None:
        model.lib = kernels.library(isa)  # type: ignore[assignment]
    return model


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def _feed(model: QuantizedModel, cache: SlotCache, ids: torch.Tensor, chunk: int = 200) -> list[torch.Tensor]:
    """The logits of every row of ``ids`` fed in chunks, then of a 4-node tree after them (its rows cut off)."""
    out = [model.forward(ids[:, i : i + chunk], cache) for i in range(0, ids.shape[1], chunk)]
    base = cache.length
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    pos = torch.tensor([[base, base + 1, base + 1, base + 2]])
    out.append(model.forward(torch.tensor([[5, 6, 7, 8]]), cache, pos, model.tree_mask(ancestors, base)))
    cache.compact(base, [0, 2, 3])
    return out


def _window_layers(model: QuantizedModel, cache: SlotCache) -> tuple[list[int], list[int]]:
    windowed = [i for i, w in enumerate(model.kv_windows) if w]
    assert [layer.window for layer in cache.slot_layers] == list(model.kv_windows)
    return windowed, [i for i in range(model.num_layers) if i not in windowed]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral", "phi3"])
def test_window_layers_hold_their_window_and_every_logit_stays_the_same(arch: str, threads: None) -> None:
    model = _model(arch)
    ids = _ids(PROMPT)
    keeping, sliding = SlotCache(model.num_layers, PROMPT + 8), model.new_cache(PROMPT + 8)
    with torch.inference_mode():
        want, got = _feed(model, keeping, ids), _feed(model, sliding, ids)
        steps = [[model.forward(torch.tensor([[t]]), c) for t in range(0, 96)] for c in (keeping, sliding)]
    assert all(torch.equal(a, b) for a, b in zip(want + steps[0], got + steps[1], strict=True)), arch
    windowed, full = _window_layers(model, sliding)
    assert windowed, arch
    for i in windowed:
        layer = sliding.slot_layers[i]
        assert layer.capacity <= BOUND and layer.first > 0 and layer.first % WINDOW_BLOCK == 0, (i, layer.capacity)
        assert sliding.length - layer.first >= WINDOW  # what the next query reads is there
    for i in full:
        assert sliding.slot_layers[i].first == 0 and sliding.slot_layers[i].capacity >= sliding.length


@pytest.mark.parametrize("isa", HERE)
def test_every_isa_path_gives_the_keeping_caches_logits(isa: str, threads: None) -> None:
    """bf16 KV (the bf16 dot products and their laid-out blocks where the CPU has them) and fp16 KV."""
    for kv in (torch.bfloat16, torch.float16):
        model = _model("gemma3", kv, isa)
        ids = _ids(PROMPT, seed=1)
        with torch.inference_mode():
            want = _feed(model, SlotCache(model.num_layers, PROMPT + 8), ids, chunk=300)
            got = _feed(model, model.new_cache(PROMPT + 8), ids, chunk=300)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), (isa, kv)


def test_only_full_layers_count_per_token() -> None:
    model = _model("gemma3")
    windowed = sum(1 for w in model.kv_windows if w)
    assert 0 < windowed < model.num_layers
    per_layer = model.kv_bytes_per_token() // (model.num_layers - windowed)
    assert per_layer * (model.num_layers - windowed) == model.kv_bytes_per_token()
    assert _model("qwen2").kv_bytes_per_token() == per_layer * model.num_layers  # no window: every layer


def _continue(model: QuantizedModel, cache: SlotCache, n: int = 40, first: int = 40) -> list[torch.Tensor]:
    return [model.forward(torch.tensor([[t]]), cache) for t in range(first, first + n)]


@pytest.mark.parametrize("share", [False, True])
def test_prefix_entries_keep_the_window_and_load_shared_or_copied(share: bool, tmp_path: Path, threads: None) -> None:
    """Two segments (600 + 300 rows): each entry's window layers hold only the rows after it can read; loaded (their
    whole blocks shared in place, or copied), from memory or from disk, they continue as the cache that made them."""
    model = _model("gemma2")
    ids = _ids(PROMPT, seed=2)
    with torch.inference_mode():
        cache = model.new_cache(PROMPT + 64)
        model.forward(ids[:, :600], cache)
        first = cache.snapshot(0, 600)
        model.forward(ids[:, 600:], cache)
        second = cache.snapshot(600, PROMPT)
        want = _continue(model, cache)
    windowed, full = _window_layers(model, cache)
    for entry in (first, second):
        assert all(entry.dropped_rows(i) > 0 for i in windowed) and all(entry.dropped_rows(i) == 0 for i in full)
    assert first.length == 600 and second.length == 300
    keeping = SlotCache(model.num_layers, PROMPT)
    with torch.inference_mode():
        model.forward(ids, keeping)
    assert first.nbytes < keeping.snapshot(0, 600).nbytes
    disk = PrefixCache(1 << 30, persist_dir=tmp_path)
    disk.put("a", first, persist=True)
    disk.put("b", second, persist=True)
    disk.flush()
    reread = PrefixCache(1 << 30, persist_dir=tmp_path)
    entries = reread.match(["a", "b"], torch.device("cpu"))
    assert [e.dropped for e in entries] == [first.dropped, second.dropped]
    for run_entries in ([first, second], entries):
        loaded = model.new_cache(PROMPT + 64)
        loaded.load_prefix(run_entries, model.share_block if share else 0)
        assert loaded.length == PROMPT
        with torch.inference_mode():
            got = _continue(model, loaded)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_a_batch_reading_one_windowed_prefix_equals_each_alone(threads: None) -> None:
    """Three caches read one prefix's window tail in place, then run 100-row chunks batched past their buffers'
    room (their window layers slide off the shared rows): each row's logits what the cache gives alone."""
    model = _model("gemma3")
    with torch.inference_mode():
        cache = model.new_cache(PROMPT)
        model.forward(_ids(PROMPT, seed=4), cache)
        entry = cache.snapshot(0, PROMPT)
        caches = [model.new_cache(PROMPT + 800) for _ in range(6)]
        for c in caches:
            c.load_prefix([entry], model.share_block)
        chunks = [[_ids(100, seed=10 * j + step)[0] for step in range(7)] for j in range(3)]
        alone = [[model.forward(x[None], c) for x in chunks[j]] for j, c in enumerate(caches[:3])]
        batched = list(zip(*(model.forward_batch([BatchItem(chunks[j][step], c) for j, c in enumerate(caches[3:])])
                             for step in range(7)), strict=True))
    windowed = [layer for layer in caches[3].slot_layers if layer.window]
    assert all(0 < layer.pre0 < layer.split <= PROMPT < layer.base for layer in windowed)
    assert all(torch.equal(a, b) for one, many in zip(alone, batched, strict=True)
               for a, b in zip(one, many, strict=True))


def test_what_a_window_dropped_is_refused_not_read(threads: None) -> None:
    model = _model("gemma2")
    cache = model.new_cache(PROMPT)
    with torch.inference_mode():
        model.forward(_ids(PROMPT), cache)
    floor = cache.floor
    assert floor > 0
    with pytest.raises(ValueError, match="dropped"):
        cache.truncate(floor)  # the next query would read below what the window layers hold
    with pytest.raises(ValueError, match="dropped"):
        cache.snapshot(0, PROMPT // 2)
    mask = torch.zeros(1, 1, 1, PROMPT + 1)
    mask[..., floor:PROMPT] = torch.finfo(torch.float32).min  # shows only rows the window layers dropped
    with pytest.raises(ValueError, match="dropped"), torch.inference_mode():
        model.forward(torch.tensor([[3]]), cache, torch.tensor([[PROMPT]]), mask)
    assert cache.length == PROMPT  # nothing written, the cache still serves
    cache.truncate(PROMPT - 50)  # within the margin: allowed
    with torch.inference_mode():
        model.forward(torch.tensor([[3]]), cache)


def test_speculative_and_rapid_kv_equal_plain_greedy_on_a_long_prompt(threads: None) -> None:
    """The engine's caches slide: random trees and RAPID-KV (its prompt rows below the cache's floor hidden) give
    the plain greedy tokens."""
    model = _model("gemma3")
    engine = Engine(TinyTarget(model, TinyTokenizer(), "tiny-gemma3-window", torch.device("cpu"), (), 2048))
    ids = _ids(PROMPT, seed=5)[0].tolist()
    prompt = Prompt(prefix_ids=ids[:-10], suffix_ids=ids[-10:], prefix_key=None)
    plain = run(engine, prompt, 60, [], None).token_ids
    assert len(set(plain)) > 5  # not a one-token loop
    assert run(engine, prompt, 60, [RandomTreeDrafter(plain, seed=2)], 12).token_ids == plain
    rapid = RapidKVDrafter(model, threshold=0.0)
    with_rows = dataclasses.replace(prompt, draft_rows=[(100, 300), (PROMPT - 40, PROMPT)])
    assert run(engine, with_rows, 60, [rapid], 6).token_ids == plain
