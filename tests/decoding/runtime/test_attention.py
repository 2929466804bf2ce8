"""Grouped SDPA gives the same logits as transformers' sdpa, with and without a tree mask."""

from __future__ import annotations

import torch

from decoding.cache.slot import SlotCache
from decoding.runtime.attention import NAME, use_grouped_sdpa
from decoding.runtime.torch_runtime import TorchRuntime
from decoding.speculative.engine import Engine
from decoding.speculative.tree import ROOT, DraftTree, tree_layout
from tests.decoding.conftest import TinyTarget, make_tiny_llama


def test_grouped_sdpa_matches_reference_sdpa() -> None:
    ref = make_tiny_llama(seed=5)
    ref.config._attn_implementation = "sdpa"  # conftest switched it; go back for the reference
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    with torch.inference_mode():
        want = ref(ids).logits
        assert use_grouped_sdpa(ref)
        assert ref.config._attn_implementation == NAME
        got = ref(ids).logits
    assert torch.allclose(want, got, atol=1e-5)


def test_grouped_sdpa_tree_pass_matches_sequential_decoding() -> None:
    model = make_tiny_llama(seed=6)
    target = TinyTarget(TorchRuntime(model), None, "t", torch.device("cpu"), (), 512)
    engine = Engine(target)
    prefix = [7, 8, 9, 10, 11]
    tree = DraftTree()
    a = tree.add(ROOT, 20, "x")
    tree.add(ROOT, 21, "x")
    tree.add(a, 22, "x")
    with torch.inference_mode():
        cache = SlotCache(engine.num_layers, 32)
        engine.prefill(prefix, cache)
        base = cache.length
        layout = tree_layout(12, tree, base)
        logits = engine._forward(layout.input_ids, cache, layout.position_ids, engine._mask(layout.ancestor_mask, base))
        # the same rows computed without a tree: each path on its own
        for path, row in (([12], 0), ([12, 20], 1), ([12, 21], 2), ([12, 20, 22], 3)):
            alone = model(torch.tensor([[*prefix, *path]])).logits[0, -1]
            assert torch.allclose(logits[row], alone, atol=1e-4), row
