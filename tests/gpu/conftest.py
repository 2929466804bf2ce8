"""Tests that need a CUDA device: every test under tests/gpu.

Every test collected here gets the ``gpu`` marker (``pytest -m gpu`` selects them) and, where there is no CUDA,
a skip (the collection hook below does both, so a module here needs no marker of its own).

``RAGSPEC_TEST_DEVICE=cpu`` runs them on the CPU instead, to validate the tests' own logic where no GPU is
(what they assert about the device's numerics then only says the CPU's hold); any torch device name works
(``cuda:1``). ``RAGSPEC_GPU_REPORT=PATH``: measurements a test reports (the bf16 agreement rate) are written
there as JSON, one key per test.

Modules here share the ``device`` fixture, ``tiny_llama`` (a random Llama with the same weights on every
device and dtype for a seed), ``device_target`` (it as the engine's target) and ``report``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from decoding.runtime.attention import use_grouped_sdpa
from decoding.runtime.torch_runtime import TorchRuntime
from tests.decoding.conftest import TinyTarget, TinyTokenizer

HERE = Path(__file__).resolve().parent
VOCAB = 97
SKIP_REASON = "needs CUDA (RAGSPEC_TEST_DEVICE=cpu runs the tests under tests/gpu on the CPU)"


def selected_device() -> torch.device | None:
    """The device the tests here run on: RAGSPEC_TEST_DEVICE if set, else CUDA when there is one, else None."""
    forced = os.environ.get("RAGSPEC_TEST_DEVICE", "").strip()
    if forced:
        return torch.device(forced)
    return torch.device("cuda") if torch.cuda.is_available() else None


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selection, which reads the marker added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    device = selected_device()
    for item in items:  # the hook sees every item of the session: only those under this folder
        if HERE not in Path(item.path).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if device is None:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def device() -> torch.device:
    found = selected_device()
    if found is None:
        pytest.skip(SKIP_REASON)
    return found


def tiny_llama(
    device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = 2, vocab: int = VOCAB
) -> LlamaForCausalLM:
    """A random Llama (head size 64, 2 query heads per key/value head), made on the CPU from ``seed`` and moved,
    so a seed gives the same weights on every device; switched to the engine's attention as the service does."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         attn_implementation="sdpa")  # fmt: skip
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    model.to(device=device, dtype=dtype)
    use_grouped_sdpa(model)
    return model


def device_target(model: Any, device: torch.device, name: str = "tiny") -> TinyTarget:
    """A transformers model on the test device as the engine's target (``speculative.engine.TargetModel``), on the
    torch runtime, 1024-token window."""
    runtime = TorchRuntime(model)
    return TinyTarget(runtime, TinyTokenizer(runtime.vocab_size), f"{name}-{model.dtype}", device, (), 1024)


def nocache_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    """Reference: every token from a full forward over the whole sequence, no KV cache."""
    seq = list(ids)
    device = next(model.parameters()).device
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq], device=device)).logits[0, -1].argmax()))
    return seq[len(ids) :]


@pytest.fixture(scope="session")
def report() -> Any:
    """``report(key, value)``: printed, and merged into the JSON file RAGSPEC_GPU_REPORT names (if set)."""

    def write(key: str, value: Any) -> None:
        print(f"{key}: {json.dumps(value)}")
        path = os.environ.get("RAGSPEC_GPU_REPORT")
        if not path:
            return
        target = Path(path)
        data = json.loads(target.read_text()) if target.is_file() else {}
        data[key] = value
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(data, indent=2) + "\n")

    return write
