"""The engine on the real bundled SmolLM2: plain and speculative greedy equal HF's greedy generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoding.drafters.prompt_lookup import PromptLookupDrafter
from decoding.engine import Engine, EngineConfig
from decoding.generation import DoneEvent, GenerationConfig, TokenEvent
from decoding.kv_cache import PrefixCache
from decoding.models import LoadedModel, load_model
from decoding.prompt import build_prompt

pytestmark = pytest.mark.real_model

DOCUMENT = (
    "The Raven Valley Railway opened in 1887 between Ashford and Millbrook. The line is 42 kilometres long and "
    "has seven stations: Ashford, Cole Bridge, Denton, Elm Hollow, Fernside, Grayling and Millbrook. "
    "Steam locomotives ran the service until 1961, when diesel railcars replaced them. The railway closed to "
    "passengers in 1973 but reopened as a heritage line in 1995, run by volunteers of the Raven Valley Trust. "
) * 6


@pytest.fixture(scope="module")
def target(bundled_target_dir: Path) -> LoadedModel:
    torch.set_num_threads(2)
    return load_model("bundled", bundled_dir=bundled_target_dir)


def test_engine_matches_hf_generate_and_speculation_is_lossless(target: LoadedModel) -> None:
    prompt = build_prompt(
        target.tokenizer,
        system="Answer using the document.",
        document=DOCUMENT,
        question="List the seven stations of the Raven Valley Railway in order.",
        prefix_key="raven",
    )
    n = 32
    with torch.inference_mode():
        hf = target.model.generate(  # type: ignore[operator]  # transformers types generate loosely
            torch.tensor([prompt.ids]), max_new_tokens=n, do_sample=False, eos_token_id=list(target.eos_token_ids)
        )[0, len(prompt.ids) :].tolist()
    hf = [t for t in hf if t not in target.eos_token_ids]
    engine = Engine(target, prefix_cache=PrefixCache(1 << 30), config=EngineConfig(prompt_topk=4))
    outs = []
    for drafters in ([], [PromptLookupDrafter()], []):
        events = list(engine.generate(prompt, GenerationConfig(max_new_tokens=n), drafters))
        done = events[-1]
        assert isinstance(done, DoneEvent)
        assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == done.text
        outs.append(done)
    assert outs[0].token_ids == hf
    assert outs[1].token_ids == hf
    assert outs[1].stats.prefix_cache_hit and outs[2].stats.prefix_cache_hit
    assert outs[1].stats.accepted > 0  # the answer copies station names from the document
    assert "Cole Bridge" in outs[0].text
