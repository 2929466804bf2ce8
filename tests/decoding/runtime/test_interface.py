"""The one runtime interface: the quantized CPU runtime and the torch runtime are both ``TargetRuntime``s, and the
same tiny model gives the same logits through either (a prompt, a draft tree on top of it, a batch), within the
tolerance the lean forward keeps against transformers on the same quantized weights."""

from __future__ import annotations

import pytest
import torch

from decoding.cache.slot import SlotCache
from decoding.runtime import kernels
from decoding.runtime.interface import BatchItem, TargetRuntime, additive_tree_mask
from decoding.runtime.quant import WeightType
from decoding.runtime.torch_runtime import TorchRuntime
from decoding.speculative.tree import ROOT, DraftTree, tree_layout
from tests.decoding.conftest import VOCAB, make_tiny_llama, needs_kernels, quantized_reference

PROMPT = torch.tensor([[5, 17, 3, 42, 8, 8, 23, 61, 5, 17, 3, 42, 9, 1, 77, 30, 2, 64]])  # [1, 18]


def _tree() -> DraftTree:
    tree = DraftTree()
    a = tree.add(ROOT, 20, "t")
    tree.add(ROOT, 21, "t")
    b = tree.add(a, 22, "t")
    tree.add(b, 23, "t")
    tree.add(a, 24, "t")
    return tree


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """test_cpu_llama's tolerance for the lean forward against transformers on the same quantized weights."""
    assert got.shape == want.shape
    diff, scale = (got - want).abs(), want.std()
    assert diff.mean() < 2e-3 * scale and diff.max() < 5e-2 * scale
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.97


def test_the_torch_runtime_is_a_target_runtime_and_a_bare_model_is_not() -> None:
    module = make_tiny_llama(0, cpu_kernels=False)
    runtime = TorchRuntime(module)
    assert isinstance(runtime, TargetRuntime)
    assert not isinstance(module, TargetRuntime)  # the check sees a missing member: a transformers model has none
    assert runtime.runtime_tag == "torch:float32" and TorchRuntime(module, "rope-linearx2@256").runtime_tag == \
        "torch+rope-linearx2@256:float32"
    assert (runtime.device, runtime.dtype, runtime.config) == (torch.device("cpu"), torch.float32, module.config)
    assert (runtime.num_layers, runtime.vocab_size, runtime.max_positions) == (2, VOCAB, 512)
    assert not runtime.batches and runtime.share_block == 0
    assert runtime.kv_bytes_per_token() == 2 * 2 * 16 * 2 * 4  # layers x KV heads x head size x (K, V) x fp32
    assert runtime.weight_bytes == sum(p.numel() * 4 for p in module.parameters())


@needs_kernels
def test_the_quantized_runtime_is_a_target_runtime() -> None:
    _, runtime = quantized_reference(WeightType.Q4_1)
    assert isinstance(runtime, TargetRuntime)
    assert runtime.runtime_tag == "cpu-quantized:quantized:q4_1/kv-float32"
    assert (runtime.device, runtime.dtype) == (torch.device("cpu"), torch.float32)
    assert (runtime.num_layers, runtime.vocab_size, runtime.max_positions) == (3, VOCAB, 512)
    assert runtime.batches and runtime.share_block >= 0
    assert runtime.kv_bytes_per_token() > 0 and 0 < runtime.weight_bytes == runtime.weights.nbytes


@needs_kernels
@pytest.mark.parametrize("kind", [WeightType.Q8_0, WeightType.Q4_1])
def test_both_runtimes_give_the_same_logits(kind: WeightType) -> None:
    """The same quantized weights through each runtime's protocol calls: the prompt's rows, then a draft tree after
    them with each runtime's own tree mask (the same mask), then a batch of two sequences."""
    torch.set_num_threads(1)
    hf, quantized = quantized_reference(kind)  # transformers on the dequantized weights, activations as the kernels'
    runtimes: list[TargetRuntime] = [quantized, TorchRuntime(hf)]
    n = PROMPT.shape[1]
    layout = tree_layout(12, _tree(), n)
    caches = [SlotCache(rt.num_layers, 64) for rt in runtimes]
    masks = [rt.tree_mask(layout.ancestor_mask, n) for rt in runtimes]
    assert torch.equal(masks[0], masks[1]) and masks[0].shape == (1, 1, 6, n + 6)
    assert torch.equal(masks[0], additive_tree_mask(layout.ancestor_mask, n, torch.float32))
    with torch.inference_mode():
        prompt = [rt.forward(PROMPT, cache) for rt, cache in zip(runtimes, caches, strict=True)]  # [n, V] each
        assert all(cache.length == n for cache in caches)
        tree = [rt.forward(layout.input_ids, cache, layout.position_ids, mask)
                for rt, cache, mask in zip(runtimes, caches, masks, strict=True)]  # [6, V] each
        assert all(cache.length == n + 6 for cache in caches)
    _close(prompt[0], prompt[1])
    _close(tree[0], tree[1])
    with torch.inference_mode():
        for rt, rows in zip(runtimes, prompt, strict=True):
            alone = [rt.forward(PROMPT[:, :7], SlotCache(rt.num_layers, 16), None, None, 1),
                     rt.forward(PROMPT[:, 4:], SlotCache(rt.num_layers, 16))]
            batch = rt.forward_batch([BatchItem(PROMPT[0, :7], SlotCache(rt.num_layers, 16), logits_to_keep=1),
                                      BatchItem(PROMPT[:, 4:], SlotCache(rt.num_layers, 16))])
            assert [b.shape for b in batch] == [(1, VOCAB), (n - 4, VOCAB)]
            assert all(torch.equal(b, a) for b, a in zip(batch, alone, strict=True))  # each as it is alone
            if rt.batches:  # a batching runtime's rows are what they are in any forward: the prompt's row 6 too
                assert torch.equal(alone[0][0], rows[6])


@pytest.mark.parametrize("quantized", [False, True], ids=["torch", "quantized"])
def test_both_runtimes_refuse_an_item_they_cannot_run(quantized: bool) -> None:
    if quantized:
        if kernels.load() is None:
            pytest.skip("CPU kernels unavailable on this machine")
        runtime: TargetRuntime = quantized_reference(WeightType.Q8_0)[1]
    else:
        runtime = TorchRuntime(make_tiny_llama(0, cpu_kernels=False))
    cache = SlotCache(runtime.num_layers, 8)
    runtime.validate(BatchItem(torch.tensor([3, 96]), cache))
    for ids, positions in (([3, VOCAB], None), ([], None), ([-1], None), ([3], [512])):
        item = BatchItem(torch.tensor(ids, dtype=torch.long), cache,
                         None if positions is None else torch.tensor(positions))
        with pytest.raises(ValueError):
            runtime.validate(item)
    assert cache.length == 0  # validating runs nothing
