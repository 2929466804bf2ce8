"""bench.formats without llama.cpp (make test builds none): a random-weight shape written as a streamed F16 GGUF
that gguf-py reads back and our runtime serves, the benchmark's measurement of one file on our runtime in its
quick form, a file our runtime refuses recorded as such while the run goes on, and the table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench import formats
from decoding.runtime import kernels
from tests.decoding.conftest import make_tokenizer

TINY = formats.Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=384, context=512)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("tiny-shape")
    vocab = formats.Vocab(tokens=[f"t{i}" for i in range(300)], token_types=[1] * 300, merges=["t 1"], pre="smollm",
                          bos=1, eos=2)
    formats.write_shape_gguf(formats.model_gguf(model_dir), TINY, vocab, seed=3)
    make_tokenizer().save_pretrained(model_dir)
    return model_dir


def test_a_shape_is_written_as_llama_cpp_names_it(tiny_dir: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(formats.model_gguf(tiny_dir)))
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 1 + 9 * TINY.layers + 1 and "output.weight" not in tensors  # tied embeddings
    assert list(tensors["token_embd.weight"].shape) == [TINY.hidden, TINY.vocab]  # ggml order: row length first
    assert list(tensors["blk.1.attn_k.weight"].shape) == [TINY.hidden, TINY.kv_heads * TINY.head_dim]
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [TINY.ffn, TINY.hidden]
    q = np.asarray(tensors["blk.0.attn_q.weight"].data, dtype=np.float32)
    assert 0.015 < q.std() < 0.025 and abs(q.mean()) < 0.005  # normal * 0.02, not zeros, not one value
    assert not np.array_equal(q, np.asarray(tensors["blk.1.attn_q.weight"].data, dtype=np.float32))
    assert np.all(np.asarray(tensors["output_norm.weight"].data) == 1.0)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == TINY.vocab and tokens[299] == "t299" and tokens[300] == "<|reserved_0|>"
    assert types[299] == 1 and set(types[300:]) == {3}
    assert reader.fields["llama.attention.head_count_kv"].contents() == TINY.kv_heads
    hist = formats.tensor_types(formats.model_gguf(tiny_dir))
    assert hist["count"] == {"F16": 1 + 7 * TINY.layers, "F32": 2 * TINY.layers + 1}
    assert hist["tensor_bytes"] == sum(int(t.n_bytes) for t in reader.tensors)


def test_one_file_measured_on_our_runtime_and_a_refused_one_recorded(tiny_dir: Path, tmp_path: Path) -> None:
    if kernels.load() is None:
        pytest.skip("CPU kernels unavailable on this machine")
    plan = formats.Plan(context=48, max_new=4, repeats=2, threads=1, builds={}, greedy=True, prefill=True)
    row = formats.measure(tiny_dir, plan)
    ours = row["ours"]
    assert ours["runtime"].startswith("cpu-quantized:gguf:") and "F16" in ours["runtime"]  # as stored
    assert ours["served_weight_mb"] > 0 and ours["file_tensor_mb"] > 0
    assert ours["rss_after_load"]["runtime"] == ours["runtime"] and ours["rss_after_load"]["rss_mb"] > 0
    assert len(row["decode"]["ours"]["reps"]) == 2 and row["decode"]["ours"]["median"] > 0
    assert len(row["prefill"]["ours_tokens_per_s_reps"]) == 2
    assert row["greedy"]["ours_same_every_rep"] and row["greedy"]["tokens"] == 4

    odd = tmp_path / "odd"  # a file gguf-py reads and our kernels cannot run (hidden 48): refused, run goes on
    odd.mkdir()
    shape = formats.Shape(hidden=48, layers=1, heads=3, kv_heads=1, head_dim=16, ffn=128, vocab=384, context=512)
    vocab = formats.Vocab(tokens=["a", "b", "c"], token_types=[1, 1, 1], merges=[], pre="smollm", bos=1, eos=2)
    formats.write_shape_gguf(formats.model_gguf(odd), shape, vocab)
    make_tokenizer().save_pretrained(odd)
    refused = formats.measure(odd, plan)
    assert refused["ours"].startswith("refused: ") and "hidden 48" in refused["ours"]
    assert refused["tensor_types"]["count"]["F16"] == 8 and refused["prompt_tokens"] > 0

    result = {"config": {"greedy_tokens": 4}, "llama_cpp_builds": {},
              "formats": {"tiny": row, "odd": refused},
              "shapes": {}}
    lines = formats.table(result)
    tag = ours["runtime"].removeprefix("cpu-quantized:gguf:")  # the table's column: the formats held, the KV
    assert any(line.startswith("tiny") and tag in line for line in lines)
    assert any(line.startswith("odd") and "refused: " in line for line in lines)


def test_the_options(tmp_path: Path) -> None:
    args = formats.parse_args(["--quick", "--formats", "q4_k_m", "iq4_xs", "--shapes"])
    assert args.formats == ["Q4_K_M", "IQ4_XS"] and args.shapes == [] and args.repeats == 1
    assert args.context < 1000 and args.max_new_tokens == 16
    full = formats.parse_args([])
    assert full.formats == list(formats.FORMATS) and full.shapes == list(formats.SHAPES) and full.repeats >= 3
    with pytest.raises(SystemExit):
        formats.parse_args(["--formats", "Q3_K_S"])
