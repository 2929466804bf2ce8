"""The engine on the real bundled SmolLM2: on the quantized CPU runtime (what the service serves) speculative
greedy equals autoregressive greedy and a cached prefix changes nothing; on the torch runtime both equal HF's
greedy generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoding.cache.prefix import PrefixCache
from decoding.drafters.prompt_lookup import PromptLookupDrafter
from decoding.runtime import kernels
from decoding.runtime.models import LoadedModel, LoadOptions, load_model
from decoding.speculative.engine import Engine, EngineConfig
from decoding.speculative.generation import DoneEvent, GenerationConfig, TokenEvent
from decoding.speculative.prompt import build_prompt

pytestmark = pytest.mark.real_model

DOCUMENT = (
    "The Raven Valley Railway opened in 1887 between Ashford and Millbrook. The line is 42 kilometres long and "
    "has seven stations: Ashford, Cole Bridge, Denton, Elm Hollow, Fernside, Grayling and Millbrook. "
    "Steam locomotives ran the service until 1961, when diesel railcars replaced them. The railway closed to "
    "passengers in 1973 but reopened as a heritage line in 1995, run by volunteers of the Raven Valley Trust. "
) * 6
N = 32


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


def test_torch_runtime_matches_hf_generate_and_speculation_is_lossless(bundled_target_dir: Path) -> None:
    torch.set_num_threads(2)
    target = load_model("bundled", LoadOptions(models_dir=bundled_target_dir.parent, cpu_quant="none"))
    prompt = _prompt(target)
    with torch.inference_mode():
        hf = target.model.generate(  # type: ignore[operator]  # transformers types generate loosely
            torch.tensor([prompt.ids]), max_new_tokens=N, do_sample=False, eos_token_id=list(target.eos_token_ids)
        )[0, len(prompt.ids) :].tolist()
    hf = [t for t in hf if t not in target.eos_token_ids]
    plain, speculative, _ = _three_runs(target)
    assert plain.token_ids == hf
    assert speculative.token_ids == hf
    assert "Cole Bridge" in plain.text
