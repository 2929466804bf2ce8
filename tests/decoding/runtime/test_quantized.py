"""The quantized CPU runtime: block formats, quantized kernels against dequantize-then-matmul references,
bit-for-bit batch invariance, the lean forward against transformers, GGUF reading and the engine on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from decoding.cache.slot import SlotCache
from decoding.errors import ModelLoadError
from decoding.runtime import kernels
from decoding.runtime.interface import BatchItem
from decoding.runtime.quant import QuantMatrix, WeightType, quantize, stack_rows
from decoding.runtime.quantized import QuantizedModel
from decoding.runtime.weights import unpermute_rows, weights_from_gguf
from decoding.speculative.tree import ROOT, DraftTree, tree_layout
from tests.decoding.conftest import (
    fake_quantized_activations,
    make_tiny_llama,
    needs_kernels,
    quantized_reference,
    quantized_tiny_llama,
    write_gguf,
)

lib = kernels.load()
KINDS = [WeightType.Q8_0, WeightType.Q4_1]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_tree(nodes: int, roots: int, g: torch.Generator) -> DraftTree:
    """A draft tree of ``nodes`` random tokens: the first ``roots`` under the root, the others under a random
    earlier node (or the root)."""
    tree = DraftTree()
    for i in range(nodes):
        parent = ROOT if i < roots else int(torch.randint(-1, i, (1,), generator=g))
        tree.add(parent, int(torch.randint(0, 97, (1,))), "t")
    return tree


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# ---- block formats --------------------------------------------------------------------------------------


def test_q8_0_block_layout_on_literal_values() -> None:
    w = torch.arange(-16, 16, dtype=torch.float32).reshape(1, 32) / 4  # max |w| = 4 -> d = 4 / 127
    qm = quantize(w, WeightType.Q8_0)
    raw = qm.row_data()[0]
    assert raw.shape == (34,)
    assert float(raw[:2].view(np.float16)[0]) == pytest.approx(4 / 127, rel=1e-3)
    assert raw[2:].view(np.int8)[0] == -127 and raw[2:].view(np.int8)[16] == 0  # -4 -> -127, 0 -> 0
    assert (qm.dequantize() - w).abs().max() <= 4 / 127 / 2 + 1e-3


def test_q4_1_block_layout_on_literal_values() -> None:
    w = torch.tensor([float(t % 16) for t in range(32)]).reshape(1, 32)  # 0..15 twice: exact in Q4_1
    qm = quantize(w, WeightType.Q4_1)
    raw = qm.row_data()[0]
    assert raw.shape == (20,)
    assert float(raw[0:2].view(np.float16)[0]) == 1.0 and float(raw[2:4].view(np.float16)[0]) == 0.0
    assert raw[4] == 0x00 and raw[5] == 0x11 and raw[19] == 0xFF  # byte t: weight t low, weight t + 16 high
    assert torch.equal(qm.dequantize(), w)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 8, 13])
def test_packing_rearranges_bytes_only(kind: WeightType, rows: int) -> None:
    qm = quantize(torch.randn(rows, 96, generator=_gen(rows)), kind)
    raw = qm.row_data()
    assert qm.data.shape == ((rows + 7) // 8, 3 * (160 if kind == WeightType.Q4_1 else 272))
    assert sorted(qm.data.numpy()[:, :].reshape(-1).tolist())[-raw.size:] == sorted(raw.reshape(-1).tolist())
    first = qm.data.numpy()[0, :16].view(np.float16)  # the group's first block: its 8 scales side by side
    assert first[0] == raw[0, :2].view(np.float16)[0] and (rows < 8 or first[7] == raw[7, :2].view(np.float16)[0])


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_error_is_within_half_a_step(kind: WeightType) -> None:
    w = torch.randn(40, 96, generator=_gen(1))
    qm = quantize(w, kind)
    blocks = w.view(40, 3, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127 if kind == WeightType.Q8_0 else (
        (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15
    )
    err = (qm.dequantize().view(40, 3, 32) - blocks).abs()
    # half a step, plus what storing d (and m) in fp16 moves the far end of the block by
    assert bool((err <= 0.57 * step + 1e-3 * blocks.abs().amax(-1, keepdim=True)).all())


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40), WeightType.Q8_0)
    with pytest.raises(ValueError, match="uint8"):
        QuantMatrix.from_rows(WeightType.Q4_1, torch.zeros(2, 21, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="one weight type"):
        stack_rows([quantize(torch.randn(2, 32), WeightType.Q8_0), quantize(torch.randn(2, 32), WeightType.Q4_1)])


def test_gguf_row_unpermutation_matches_llama_cpp_permutation() -> None:
    """llama.cpp's converter permutes q / k rows (w.reshape(h, 2, d/2, ...).swapaxes(1, 2)); we invert it."""
    rows, heads = 24, 3
    w = np.arange(rows)
    permuted = w.reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)
    assert permuted[unpermute_rows(rows, heads)].tolist() == w.tolist()


# ---- quantized linear ------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 96), (3, 576, 37), (4, 32, 5), (5, 128, 130), (17, 96, 64)])
def test_qlinear_matches_dequantize_then_matmul(kind: WeightType, m: int, k: int, n: int) -> None:
    g = _gen(m * 100 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    bias, res = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    qm = quantize(w, kind)
    assert lib is not None
    want = (fake_quantized_activations(x).double() @ qm.dequantize().double().T + bias.double() + res.double())
    got = kernels.qlinear(lib, x, qm, bias, res)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    plain = kernels.qlinear(lib, x, qm)
    torch.testing.assert_close(plain.double(), fake_quantized_activations(x).double() @ qm.dequantize().double().T,
                               rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("nthreads", [1, 2])
def test_qlinear_rows_are_batch_invariant(kind: WeightType, nthreads: int, threads: None) -> None:
    g = _gen(7)
    x = torch.randn(19, 160, generator=g)
    qm = quantize(torch.randn(67, 160, generator=g), kind)
    assert lib is not None
    torch.set_num_threads(nthreads)
    whole = kernels.qlinear(lib, x, qm)
    for i in range(19):
        assert torch.equal(kernels.qlinear(lib, x[i : i + 1], qm), whole[i : i + 1])
    perm = torch.randperm(19, generator=g)
    assert torch.equal(kernels.qlinear(lib, x[perm], qm), whole[perm])
    torch.set_num_threads(3 - nthreads)
    assert torch.equal(kernels.qlinear(lib, x, qm), whole)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_dequant_rows_equals_reference(kind: WeightType) -> None:
    qm = quantize(torch.randn(50, 64, generator=_gen(2)), kind)
    rows = torch.tensor([49, 0, 7, 7])
    assert lib is not None
    assert torch.equal(kernels.dequant_rows(lib, qm, rows), qm.dequantize()[rows])


# ---- the lean forward ------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_forward_matches_transformers_on_the_same_quantized_weights(kind: WeightType) -> None:
    hf, ours = quantized_reference(kind)
    ids = torch.randint(0, 97, (1, 150), generator=_gen(4))  # > CHUNK_ROWS: a chunked causal forward
    with torch.inference_mode():
        want = hf(ids).logits[0]
        got = ours(ids).logits[0]
    assert got.shape == want.shape
    # not bit-equal: a different fp32 summation order moves a few activations across a rounding boundary of
    # their int8 quantization, which then propagates; everything else agrees to float rounding
    diff, scale = (got - want).abs(), want.std()
    assert diff.mean() < 2e-3 * scale and diff.max() < 5e-2 * scale
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.97


def _tree_mask(layout_mask: torch.Tensor, past: int) -> torch.Tensor:
    n = layout_mask.shape[0]
    mask = torch.zeros(n, past + n)
    mask[:, past:].masked_fill_(~layout_mask, torch.finfo(torch.float32).min)
    return mask.view(1, 1, n, past + n)


ARCHS = ["llama", "gemma2", "gemma3"]  # and sliding windows, soft-capping, q / k norms, a local rope (conftest)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_node_logits_equal_decoding_alone_bit_for_bit(kv_dtype: torch.dtype, nthreads: int, arch: str,
                                                           threads: None) -> None:
    """A random draft tree verified in one forward gives every node the logits it gets decoded alone (on the
    windowed families too: a window cut inside a key block, the tree's rows past it)."""
    torch.set_num_threads(nthreads)
    model = quantized_tiny_llama(5, kv_dtype=kv_dtype, head_dim=32, arch=arch)
    g = _gen(6)
    prompt = torch.randint(0, 97, (1, 300), generator=g)  # whole key blocks of 64 and of 128 (the tiles') too
    tree = _random_tree(12, 2, g)
    with torch.inference_mode():
        cache = SlotCache(model.num_layers, 64)
        model(prompt, past_key_values=cache)
        base = cache.length
        layout = tree_layout(11, tree, base, torch.device("cpu"))
        tree_logits = model(
            layout.input_ids, layout.position_ids, _tree_mask(layout.ancestor_mask, base), past_key_values=cache
        ).logits[0]
        for node in range(-1, len(tree)):
            path = [node]
            while path[-1] != ROOT:
                path.append(tree.parents[path[-1]])
            chain = [11] + [tree.tokens[i] for i in reversed(path[:-1])]
            cache.truncate(base)
            for tok in chain:  # decoded one token at a time
                alone = model(torch.tensor([[tok]]), past_key_values=cache).logits[0, -1]
            assert torch.equal(alone, tree_logits[node + 1]), f"node {node}"
        torch.set_num_threads(3 - nthreads)
        cache.truncate(base)
        again = model(layout.input_ids, layout.position_ids, _tree_mask(layout.ancestor_mask, base),
                      past_key_values=cache).logits[0]
        assert torch.equal(again, tree_logits)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("isa", [isa for isa in kernels.ISAS if isa in kernels.available_isas()])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_batched_forward_gives_each_sequence_what_it_gets_alone(kv_dtype: torch.dtype, isa: str, arch: str,
                                                                   threads: None) -> None:
    """Sequences on caches of their own (different prefixes and lengths; a decode row, a draft tree, a prefill
    chunk, a fresh prompt) in one forward, on every ISA path this CPU has (2 threads sharing each sequence's
    work): each one's logits and cache rows are those of its own forward, bit for bit, in any order."""
    torch.set_num_threads(2)
    model = quantized_tiny_llama(9, kv_dtype=kv_dtype, head_dim=32, arch=arch)
    model.lib = kernels.library(isa)  # type: ignore[assignment]
    g = _gen(10)
    prefixes = [torch.randint(0, 97, (1, n), generator=g) for n in (300, 37, 140, 0)]
    tree = _random_tree(16, 3, g)

    def caches() -> list[SlotCache]:
        out = []
        for prefix in prefixes:
            cache = SlotCache(model.num_layers, 16)
            if prefix.shape[1]:
                model(prefix, past_key_values=cache)
            out.append(cache)
        return out

    def items(cs: list[SlotCache]) -> list[BatchItem]:
        layout = tree_layout(11, tree, cs[1].length, torch.device("cpu"))
        return [
            BatchItem(torch.tensor([42]), cs[0]),  # one decoding step
            BatchItem(layout.input_ids, cs[1], layout.position_ids, _tree_mask(layout.ancestor_mask, cs[1].length)),
            BatchItem(torch.randint(0, 97, (60,), generator=_gen(11)), cs[2], logits_to_keep=1),  # a prefill chunk
            BatchItem(torch.randint(0, 97, (25,), generator=_gen(12)), cs[3], logits_to_keep=3),  # a fresh prompt
        ]

    with torch.inference_mode():
        alone_caches = caches()
        alone = [model(it.input_ids.reshape(1, -1), it.position_ids, it.attention_mask, past_key_values=it.cache,
                       logits_to_keep=it.logits_to_keep).logits[0] for it in items(alone_caches)]
        for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
            batch_caches = caches()
            batch = items(batch_caches)
            got = model.forward_batch([batch[i] for i in order])
            for i, logits in zip(order, got, strict=True):
                assert torch.equal(logits, alone[i]), (order, i)
                for a, b in zip(alone_caches[i].slot_layers, batch_caches[i].slot_layers, strict=True):
                    assert a.length == b.length and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        with pytest.raises(ValueError, match="cache of its own"):
            model.forward_batch([BatchItem(torch.tensor([1]), alone_caches[0])] * 2)
        with pytest.raises(ValueError, match="at most"):
            model.forward_batch([BatchItem(torch.zeros(200, dtype=torch.long), SlotCache(model.num_layers, 8))])


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("isa", [isa for isa in kernels.ISAS if isa in kernels.available_isas()])
@pytest.mark.parametrize("arch", ARCHS)
def test_sequences_reading_one_prefix_in_place_get_what_they_get_on_copies(kv_dtype: torch.dtype, isa: str,
                                                                            arch: str, threads: None) -> None:
    """Caches that share a cached prefix (its whole blocks read in place, once per forward for every sequence reading
    them) give each sequence, alone or batched beside others and a sequence on a cache of its own, the logits and
    cache rows it gets on a private copy of the prefix, bit for bit: a decoding step, a draft tree, a prefill chunk
    and a query seeing a sparse set of prefix rows (rapid_kv's), on a prefix of one segment and of two."""
    torch.set_num_threads(2)
    model = quantized_tiny_llama(13, kv_dtype=kv_dtype, head_dim=32, arch=arch)
    model.lib = kernels.library(isa)  # type: ignore[assignment]
    if not model.share_block:
        pytest.skip("this path copies prefixes (the tiles keep each cache's own layout)")
    g = _gen(14)
    ids = torch.randint(0, 97, (1, 300), generator=g)
    tree = _random_tree(10, 2, g)
    with torch.inference_mode():
        source = SlotCache(model.num_layers, 300)
        model(ids, past_key_values=source)
        one = [source.snapshot(0, 300)]  # 256 rows shared, 44 copied
        two = [source.snapshot(0, 150), source.snapshot(150, 300)]  # concatenated once for every cache
        own = SlotCache(model.num_layers, 8)
        model(ids[:, :77], past_key_values=own)

        def caches(entries: list, share: bool) -> list[SlotCache]:
            out = []
            for _ in range(4):
                cache = SlotCache(model.num_layers, 400)
                cache.load_prefix(entries, model.share_block if share else 0)
                out.append(cache)
            return out

        def items(cs: list[SlotCache]) -> list[BatchItem]:
            base = cs[1].length
            layout = tree_layout(11, tree, base, torch.device("cpu"))
            sparse = torch.full((1, 1, 1, base + 1), torch.finfo(torch.float32).min)
            for a, b in ((3, 40), (70, 130), (250, base + 1)):  # rows of the shared prefix and after it
                sparse[..., a:b] = 0
            return [
                BatchItem(torch.tensor([42]), cs[0]),
                BatchItem(layout.input_ids, cs[1], layout.position_ids, _tree_mask(layout.ancestor_mask, base)),
                BatchItem(torch.randint(0, 97, (70,), generator=_gen(15)), cs[2], logits_to_keep=2),
                BatchItem(torch.tensor([7]), cs[3], torch.tensor([base]), sparse),
            ]

        def rows(cache: SlotCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [layer.rows(0, layer.length) for layer in cache.slot_layers]

        for entries in (one, two):
            copies = caches(entries, share=False)
            want = [model(it.input_ids.reshape(1, -1), it.position_ids, it.attention_mask, past_key_values=it.cache,
                          logits_to_keep=it.logits_to_keep).logits[0] for it in items(copies)]
            shared = caches(entries, share=True)
            assert shared[0].slot_layers[0].split == 256
            assert len({c.slot_layers[-1].shared[0].data_ptr() for c in shared}) == 1  # type: ignore[index]
            alone = items(shared)[0]
            assert torch.equal(model(alone.input_ids.reshape(1, -1), past_key_values=alone.cache).logits[0], want[0])
            for order in ([0, 1, 2, 3], [3, 2, 1, 0]):
                shared = caches(entries, share=True)
                batch = items(shared)
                got = model.forward_batch([BatchItem(torch.tensor([5]), own), *(batch[i] for i in order)])[1:]
                own.truncate(77)
                for i, logits in zip(order, got, strict=True):
                    assert torch.equal(logits, want[i]), (len(entries), order, i)
                    for (ka, va), (kb, vb) in zip(rows(copies[i]), rows(shared[i]), strict=True):
                        assert torch.equal(ka, kb) and torch.equal(va, vb)
        with pytest.raises(ValueError, match="shared prefix"):
            shared[0].truncate(100)


@needs_kernels
def test_a_cache_keeps_its_tiled_blocks_only_while_their_rows_stand() -> None:
    """With a bf16 cache on the tiles' path the attention keeps the prefix's whole blocks laid out for the tiles
    (``SlotLayer.tiles``); after truncation and rewriting, compaction and loading a prefix, every forward still
    gives the logits a fresh cache gives, bit for bit."""
    model = quantized_tiny_llama(7, kv_dtype=torch.bfloat16, head_dim=32)
    keys = model.lib.rs_tile_keys()
    if not keys:
        pytest.skip("no attention on the tiles on this CPU")
    g = _gen(8)
    a, b, c = (torch.randint(0, 97, (1, n), generator=g) for n in (300, 150, 40))

    def fresh_cache(*parts: torch.Tensor) -> SlotCache:
        cache = SlotCache(model.num_layers, 16)
        for p in parts:
            model(p, past_key_values=cache)
        return cache

    def fresh(*parts: torch.Tensor) -> torch.Tensor:
        return model(parts[-1], past_key_values=fresh_cache(*parts[:-1])).logits[0]

    with torch.inference_mode():
        cache = SlotCache(model.num_layers, 16)
        model(a, past_key_values=cache)
        layer = cache.slot_layers[0]
        assert layer.tiles is not None and int(layer.tiled[0]) == 256 // keys  # the whole blocks before the last chunk
        assert torch.equal(model(c, past_key_values=cache).logits[0], fresh(a, c))
        assert int(layer.tiled[0]) == 300 // keys
        cache.truncate(200)  # blocks reaching row 200 are stale now
        assert int(layer.tiled[0]) == 200 // keys
        model(b, past_key_values=cache)
        assert torch.equal(model(c, past_key_values=cache).logits[0], fresh(a[:, :200], b, c))
        cache.compact(100, list(range(50, 250)))  # rows 150..349 move to 100..299 (their positions kept)
        assert int(layer.tiled[0]) == 100 // keys
        kept = model(c, past_key_values=cache).logits[0]
        cache.truncate(300)
        for each in cache.slot_layers:
            each.tiled[0] = 0  # every block laid out again from the rows
        assert torch.equal(model(c, past_key_values=cache).logits[0], kept)
        cache.load_prefix([fresh_cache(a[:, :100]).snapshot(0, 100)])
        assert int(layer.tiled[0]) == 0
        assert torch.equal(model(c, past_key_values=cache).logits[0], fresh(a[:, :100], c))


@needs_kernels
def test_an_int8_kv_cache_stores_each_row_with_its_scales_and_stays_close() -> None:
    """int8 keys / values: a row is its 32-value blocks quantized as the activations are (d = max|x| / 127) then
    the blocks' fp32 scales; what attention reads back is within half a step of each value, and the logits stay
    close to the fp32 cache's (it is lossy: opt-in). A head size that is not a multiple of 32 is refused."""
    g = _gen(21)
    ids = torch.randint(0, 97, (1, 60), generator=g)
    out = {}
    with torch.inference_mode():
        for kv in (torch.float32, torch.int8):
            model = quantized_tiny_llama(4, kv_dtype=kv, head_dim=32)
            cache = SlotCache(model.num_layers, 64)
            out[kv] = (model(ids, past_key_values=cache).logits[0], cache.slot_layers[0].keys.clone())
    ref, rows = out[torch.float32][1], out[torch.int8][1]  # layer 0 (same inputs): [1, G, 60, 32] fp32; 36 uint8
    assert rows.dtype == torch.uint8 and rows.shape[-1] == 32 + 4
    q = rows[..., :32].view(torch.int8).float()
    d = rows[..., 32:].contiguous().view(torch.float32)  # [1, G, 60, 1]
    assert torch.equal(d, ref.abs().amax(-1, keepdim=True) / 127)
    assert (q * d - ref).abs().le(d / 2 * 1.0001).all()  # rounding to the nearest step
    a, b = out[torch.float32][0], out[torch.int8][0]
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.999
    assert not torch.equal(a, b)
    with pytest.raises(ModelLoadError, match="multiple of 32"):
        quantized_tiny_llama(4, kv_dtype=torch.int8)  # head size 16
    with pytest.raises(ModelLoadError, match=r"float32, float16, bfloat16 or int8, not torch\.float64"):
        quantized_tiny_llama(4, kv_dtype=torch.float64)


@needs_kernels
def test_prefix_chunking_does_not_change_anything() -> None:
    """Prefill in one call, in pieces, or row by row: the same KV bits and the same last logits."""
    model = quantized_tiny_llama(8)
    ids = torch.randint(0, 97, (1, 300), generator=_gen(9))
    results = []
    with torch.inference_mode():
        for pieces in ([300], [77, 150, 73], [1] * 20 + [280]):
            cache = SlotCache(model.num_layers, 300)
            start = 0
            for size in pieces:
                logits = model(ids[:, start : start + size], past_key_values=cache).logits[0, -1]
                start += size
            results.append((logits, cache.slot_layers[1].keys.clone()))
    for logits, keys in results[1:]:
        assert torch.equal(logits, results[0][0]) and torch.equal(keys, results[0][1])


@needs_kernels
def test_cache_of_another_dtype_and_bad_masks_are_refused() -> None:
    model = quantized_tiny_llama(0)  # fp16 KV
    cache = SlotCache(model.num_layers, 8)
    cache.slot_layers[0].reserve(2, 16, torch.float32, 4)
    with pytest.raises(ValueError, match="float32"), torch.inference_mode():
        model(torch.tensor([[1, 2]]), past_key_values=cache)
    with pytest.raises(ValueError, match="token ids"), torch.inference_mode():
        model(torch.tensor([[5, 97]]), past_key_values=SlotCache(model.num_layers, 8))  # 97 == vocab size
    with pytest.raises(ValueError, match="token ids"), torch.inference_mode():
        model(torch.tensor([[-1]]), past_key_values=SlotCache(model.num_layers, 8))
    bias = torch.zeros(1, 1, 2, 4)
    bias[..., 0] = -2.5  # an additive bias, not a visibility mask
    cache = SlotCache(model.num_layers, 8)
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]), past_key_values=cache)
        with pytest.raises(ValueError, match="bias"):
            model(torch.tensor([[3, 4]]), attention_mask=bias, past_key_values=cache)
        hidden = torch.zeros(1, 1, 2, 4)
        hidden[..., 0] = torch.finfo(torch.float32).min  # a hidden prefix row (a KV-subset drafter): taken
        assert model(torch.tensor([[3, 4]]), attention_mask=hidden, past_key_values=cache).logits.shape[1] == 2


# ---- GGUF files ----------------------------------------------------------------------------------------


@needs_kernels
def test_gguf_weights_are_read_as_stored_and_unpermuted(tmp_path: Path) -> None:
    hf = make_tiny_llama(2, cpu_kernels=False)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf)
    weights = weights_from_gguf(path)
    assert weights.source == "gguf:F16+Q4_1+Q8_0"  # the formats held, each as stored
    c = weights.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_key_value_heads, c.vocab_size) == (2, 64, 2, 97)
    assert not c.tie_word_embeddings
    layer, lw = hf.model.layers[1], weights.layers[1]
    assert lw.qkv.kind == WeightType.Q4_1 and lw.gate_up.kind == WeightType.PARTS  # Q4_1 gate as stored
    assert [p.kind for p in lw.gate_up.parts] == [WeightType.Q4_1, WeightType.F16]  # F16 up as stored
    qkv = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight])
    step = (qkv.detach().view(-1, 2, 32).amax(-1) - qkv.detach().view(-1, 2, 32).amin(-1)).max() / 15
    assert (lw.qkv.dequantize() - qkv).abs().max() <= step  # right rows in the right order
    model = QuantizedModel(weights, torch.float32)
    ids = torch.randint(0, 97, (1, 20), generator=_gen(1))
    with torch.inference_mode():
        got = model(ids).logits[0, -1]
        want = hf(ids).logits[0, -1]
    assert int(got.argmax()) == int(want.argmax())
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.99


def test_unsupported_architectures_say_why() -> None:
    from transformers import LlamaConfig

    from decoding.errors import ModelLoadError
    from decoding.runtime.weights import check_supported

    with pytest.raises(ModelLoadError, match="SiLU"):
        check_supported(LlamaConfig(hidden_act="gelu"))
    with pytest.raises(ModelLoadError, match="shapes"):
        check_supported(LlamaConfig(hidden_size=100, num_attention_heads=4, intermediate_size=64))


def test_bad_gguf_files_are_clear_errors(tmp_path: Path) -> None:
    import gguf

    from decoding.errors import ModelFileError, ModelLoadError
    from decoding.runtime.loader import LoadOptions, load_model

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="GGUF"):
        weights_from_gguf(garbage)
    other = tmp_path / "other" / "model.gguf"
    other.parent.mkdir()
    w = gguf.GGUFWriter(str(other), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="architecture 'gpt2'"):
        weights_from_gguf(other)
    whole = other.read_bytes()
    causes: set[type] = set()
    for cut in (4, 24, len(whole) // 2, len(whole) - 1):  # in the counts, the metadata, the tensor data
        short = tmp_path / f"cut-{cut}.gguf"
        short.write_bytes(whole[:cut])
        with pytest.raises(ModelFileError, match=f"cannot read the GGUF file {short}: it is corrupt, truncated") as err:
            weights_from_gguf(short)
        causes.add(type(err.value.__cause__))
    assert {IndexError, ValueError} <= causes  # the parser's numpy errors on a file cut short, both named as such
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"x")
    (two / "b.gguf").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="several GGUF files"):
        load_model(str(two), LoadOptions(local_files_only=True))
