"""The bench check of the GGUF tokenizer: llama.cpp itself tokenizes every test vocabulary
(``tests/decoding/runtime/gguf_vocabs.py``) now, and ours and the committed ids must equal its ids. Skipped without
the bench extra (llama-cpp-python) and a llama.cpp build (``make bench`` makes both)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gguf_tokens import llama_cpp_ids, llama_cpp_lib, main
from tests.decoding.runtime.gguf_vocabs import EXPECTED, VOCABS, ours, texts_of, write_vocab

pytestmark = [pytest.mark.real_model,  # the byte-level BPE vocabularies are the bundled SmolLM2's
              pytest.mark.skipif(llama_cpp_lib() is None, reason="needs the bench extra and a llama.cpp build")]


def test_ids_equal_llama_cpps_live(tmp_path: Path) -> None:
    lib = llama_cpp_lib()
    assert lib is not None
    want = json.loads(EXPECTED.read_text())["vocabs"]
    paths = {name: write_vocab(name, tmp_path) for name in VOCABS}
    live = llama_cpp_ids({str(p): texts_of(name) for name, p in paths.items()}, lib)
    for name, path in paths.items():
        ref, got = live[str(path)], ours(path, texts_of(name))
        for kind in ("ids", "plain"):
            assert got[kind] == ref[kind], (name, kind)
            assert [case[kind] for case in want[name]["cases"]] == ref[kind], (name, kind)
        assert got["eog"] == ref["eog"] == want[name]["eog"], name


def test_the_bench_reports_no_difference(tmp_path: Path) -> None:
    main(["--json", str(tmp_path / "gguf_tokens.json")])
    report = json.loads((tmp_path / "gguf_tokens.json").read_text())
    assert set(report["vocabs"]) == set(VOCABS)
    assert all(not v["different"] and v["eog_equal"] for v in report["vocabs"].values())
