"""bench.architectures without llama.cpp (make test builds none) and without big files: every family's tiny shape
written with llama.cpp's converter's tensor names and keys and served by our runtime through the benchmark's own
decode / prefill, long-document and drafter measurements (ours alone), the chain model's arithmetic, merging the JSON
of partial runs, the table and the options."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import architectures as arch
from bench import formats
from decoding.runtime import kernels
from tests.decoding.conftest import make_tokenizer

VOCAB = 384
BASE = formats.Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=VOCAB, context=1024)
# each family's flags as the benchmark's real shape has them, at a tiny size
TINY = {name: dataclasses.replace(BASE, arch=a.shape.arch, tied=a.shape.tied,
                                  sliding_window=min(a.shape.sliding_window, 24), attn_softcap=a.shape.attn_softcap,
                                  final_softcap=a.shape.final_softcap,
                                  head_dim=32 if a.shape.arch.startswith("gemma") else 16,
                                  experts=min(a.shape.experts, 4), experts_used=min(a.shape.experts_used, 2),
                                  expert_ffn=32 if a.shape.experts else 0, rope_scaling=a.shape.rope_scaling,
                                  rope_scaling_factor=a.shape.rope_scaling_factor,
                                  rope_original_context=min(a.shape.rope_original_context, 256))
        for name, a in arch.ARCHS.items()}  # fmt: skip
PLAN = arch.Plan(runs=2, threads=1, max_new=4, builds={}, contexts=(160,), prefill_tokens=160, long_tokens=80,
                 drafter_context=40, verify_repeats=1, rss_probe=False)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    vocab = formats.Vocab(tokens=[f"t{i}" for i in range(300)], token_types=[1] * 300, merges=["t 1"], pre="smollm",
                          bos=1, eos=2)
    tokenizer = make_tokenizer()
    dirs = {}
    for name, shape in TINY.items():
        model_dir = tmp_path_factory.mktemp(f"tiny-{name}")
        formats.write_shape_gguf(formats.model_gguf(model_dir), shape, vocab, seed=1, scale=arch.scale_of(shape))
        tokenizer.save_pretrained(model_dir)
        dirs[name] = model_dir
    return dirs


@pytest.fixture(scope="module")
def text() -> arch.Text:
    return arch.Text.of(make_tokenizer())


def test_every_family_is_written_with_its_tensors_and_keys(tiny_dirs: dict[str, Path]) -> None:
    from gguf import GGUFReader

    for name, shape in TINY.items():
        reader = GGUFReader(str(formats.model_gguf(tiny_dirs[name])))
        tensors = {t.name: t for t in reader.tensors}
        assert reader.fields["general.architecture"].contents() == shape.arch
        assert set(tensors) == {n for n, _, _ in formats.shape_tensors(shape)}
        layer = {n.removeprefix("blk.0.") for n in tensors if n.startswith("blk.0.")}
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        if name == "phi3":  # fused q / k / v rows and gate / up rows, its own output
            assert {"attn_qkv.weight", "ffn_up.weight"} <= layer and "attn_q.weight" not in layer
            assert "ffn_gate.weight" not in layer and "output.weight" in tensors
            assert list(tensors["blk.0.attn_qkv.weight"].shape) == [shape.hidden, q + 2 * kv]
            assert list(tensors["blk.0.ffn_up.weight"].shape) == [shape.hidden, 2 * shape.ffn]
        elif name in ("qwen3moe", "gpt-oss"):  # the router (F32) and the experts stacked [expert, rows, row]
            assert {f"ffn_{x}.weight" for x in ("gate_inp", "gate_exps", "up_exps", "down_exps")} <= layer
            assert "ffn_gate.weight" not in layer and "output.weight" in tensors
            assert list(tensors["blk.0.ffn_gate_exps.weight"].shape) == [shape.hidden, shape.expert_ffn, shape.experts]
            assert list(tensors["blk.0.ffn_down_exps.weight"].shape) == [shape.expert_ffn, shape.hidden, shape.experts]
            assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
            assert reader.fields[f"{shape.arch}.expert_count"].contents() == shape.experts
        else:
            assert {"attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight"} <= layer
            assert "output.weight" not in tensors  # tied, as the real 1-2B models are
        assert ({"attn_q.bias", "attn_k.bias", "attn_v.bias"} <= layer) == (name in ("qwen2", "gpt-oss"))
        gpt_oss = {"attn_output.bias", "attn_sinks.weight", "ffn_gate_inp.bias", "ffn_gate_exps.bias",
                   "ffn_up_exps.bias", "ffn_down_exps.bias"}
        assert (gpt_oss <= layer) == (name == "gpt-oss") and bool(gpt_oss & layer) == (name == "gpt-oss")
        assert ("ffn_norm.weight" in layer) == (name != "gpt-oss")  # gpt-oss's pre-MLP norm: post_attention_norm
        assert ("post_attention_norm.weight" in layer) == (name == "gpt-oss" or name.startswith("gemma"))
        scaling = reader.fields.get(f"{shape.arch}.rope.scaling.type")
        assert (scaling.contents() if scaling else "") == shape.rope_scaling
        assert ({"attn_q_norm.weight", "attn_k_norm.weight"} <= layer) == (name in ("qwen3", "qwen3moe", "gemma3"))
        assert ({"post_attention_norm.weight", "post_ffw_norm.weight"} <= layer) == name.startswith("gemma")
        window = reader.fields.get(f"{shape.arch}.attention.sliding_window")
        assert (window.contents() if window else 0) == shape.sliding_window
        assert (f"{shape.arch}.final_logit_softcapping" in reader.fields) == (name == "gemma2")
        assert np.all(np.asarray(tensors["blk.1.attn_norm.weight"].data) == 1.0)  # a multiplier of 1 in every family
        if name == "qwen2":
            bias = np.asarray(tensors["blk.0.attn_k.bias"].data)
            assert bias.shape == (kv,) and 0.3 < bias.std() < 0.7
        if name == "gpt-oss":
            assert list(tensors["blk.0.ffn_down_exps.bias"].shape) == [shape.hidden, shape.experts]
            assert list(tensors["blk.0.attn_sinks.weight"].shape) == [shape.heads]
            assert reader.fields["gpt-oss.rope.scaling.original_context_length"].contents() == 256
        embed = np.asarray(tensors["token_embd.weight"].data, dtype=np.float32)
        assert abs(embed.std() * np.sqrt(shape.hidden) - 1.0) < 0.05  # normal / sqrt(hidden)


def test_a_vocabulary_is_padded_or_cut_to_the_shape() -> None:
    vocab = formats.Vocab(tokens=["a", "b", "ab", "c", "abc", "d"], token_types=[1] * 6,
                          merges=["a b", "ab c", "c d"], pre="smollm", bos=0, eos=1)
    assert formats.Vocab.fitted(vocab, 8).tokens[6:] == ["<|reserved_0|>", "<|reserved_1|>"]
    cut = vocab.fitted(4)
    assert cut.tokens == ["a", "b", "ab", "c"] and cut.token_types == [1] * 4
    assert cut.merges == ["a b"]  # "ab c" makes a token cut away, "c d" joins one
    with pytest.raises(ValueError, match="do not fit"):
        dataclasses.replace(vocab, eos=5).fitted(4)


def test_prompts_are_ids_of_the_texts_within_the_vocabulary(text: arch.Text) -> None:
    p = text.prompt(500, 50, "k", question=1)
    assert len(p.ids) == 500 and p.prefix_key == "k" and max(p.ids) < 50
    assert list(p.suffix_ids) == [i % 50 for i in text.questions[1]]
    long = text.prompt(0, VOCAB, None, document=len(text.stream) + 10)  # the texts repeat past their end
    assert len(long.prefix_ids) == len(text.stream) + 10 and long.prefix_ids[-10:] == text.stream[:10]


def test_each_family_measured_on_our_runtime(tiny_dirs: dict[str, Path], text: arch.Text) -> None:
    if kernels.load() is None:
        pytest.skip("CPU kernels unavailable on this machine")
    for name, model_dir in tiny_dirs.items():
        row = arch.measure_arch(name, dataclasses.replace(arch.ARCHS[name], shape=TINY[name]), model_dir, PLAN, text,
                                decode=True, prefill=True)
        assert row["ours"]["runtime"].startswith("cpu-quantized:gguf:F16"), (name, row["ours"])
        piece = row["decode"]["160"]
        assert piece["prompt_tokens"] == 160 and len(piece["ours"]["reps"]) == 2 and piece["ours"]["median"] > 0
        assert piece["greedy"]["ours_same_every_rep"] and piece["logits"] == {}  # no llama.cpp to compare with
        assert len(row["prefill"]["ours_tokens_per_s_reps"]) == 2
        assert row["shape"]["arch"] == TINY[name].arch and ("note" in row) == (name == "phi3")


def test_the_long_document_is_read_once_and_reused(tiny_dirs: dict[str, Path], text: arch.Text,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if kernels.load() is None:
        pytest.skip("CPU kernels unavailable on this machine")
    result = arch.long_document(tiny_dirs["gemma3"], PLAN, text, fresh_process=False)
    ours = result["ours"]
    assert ours["document_tokens"] == 80 and ours["prompt_tokens"] == 80 + len(text.questions[0])
    assert ours["reused_tokens"] == [80] * 4 and ours["same_output_cached"]  # the document's KV, same answer
    assert ours["cold_ttft_s"] > 0 and len(ours["another_question_ttft_ms"]["reps"]) == 2
    assert ours["memory"]["kv_mb"] > 0 and ours["memory"]["peak_process_mb"] > 0


def test_the_drafter_section_times_the_target_and_the_drafter(tiny_dirs: dict[str, Path]) -> None:
    if kernels.load() is None:
        pytest.skip("CPU kernels unavailable on this machine")
    model = formats.load_ours(tiny_dirs["llama"], 1)
    costs = arch.drafter_costs(model, model, PLAN, draft_context=24)
    assert set(costs["verify_ms"]) == {f"chain_{n}" for n in arch.VERIFY_CHAINS} | {"tree_2x4", "tree_4x4"}
    assert costs["verify_vs_step"]["chain_0"] == 1.0 and costs["drafter_forward_ms"] > 0
    assert set(costs["chain_model"]["acceptance"]) == {"0.6", "0.7", "0.8"}


def test_the_chain_model() -> None:
    assert arch.expected_tokens(0.5, 0) == 1.0 and arch.expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert arch.expected_tokens(1.0, 8) == 9.0
    # free drafting and verifies as cheap as a step: the speed-up is the tokens per step
    assert arch.chain_speedup(0.8, 3, 1.0, 0.0, 1.0) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    # a drafter at 1/4 of a step, a verify of 2 nodes at 1.5 steps: 1.7 tokens per 2 steps
    assert arch.chain_speedup(0.7, 2, 0.1, 0.025, 0.15) == pytest.approx(2.19 * 0.1 / 0.2)
    even = arch.break_even(2, 0.1, 0.025, 0.15)
    assert even is not None and arch.chain_speedup(even, 2, 0.1, 0.025, 0.15) == pytest.approx(1.0, abs=1e-3)
    assert arch.break_even(1, 0.1, 0.2, 0.1) is None  # a drafter dearer than a step never pays with g = 1
    verify = {g: 0.1 * (1 + 0.1 * g) for g in range(1, 9)}
    model = arch.chain_model(0.1, 0.01, verify)
    a8 = model["acceptance"]["0.8"]
    assert a8["pays"] and a8["best_speedup"] == max(r["speedup"] for r in a8["by_length"].values())
    assert a8["by_length"]["1"]["expected_tokens"] == 1.8 and a8["by_length"]["1"]["step_ms"] == pytest.approx(120.0)
    assert model["acceptance"]["0.6"]["best_length"] <= a8["best_length"]  # lower acceptance, shorter chains
    assert set(model["break_even_acceptance"]) == {str(g) for g in range(1, 9)}


def _piece(ours: float, theirs: float, equal: bool = True) -> dict[str, Any]:
    greedy: dict[str, Any] = {"equal": equal}
    if not equal:
        greedy |= {"first_divergence": 5, "ours_top2": [[1, 2.0], [2, 1.9]], "llama_cpp_top2": [[2, 2.1], [1, 2.0]]}
    return {"ours": {"median": ours}, "llama_cpp": {"median": theirs}, "ours_vs_llama_cpp": round(ours / theirs, 3),
            "greedy": {"vs_llama_cpp": greedy}, "logits": {"llama_cpp": {"max_abs_diff": 0.03}}}


def test_partial_runs_merge_and_the_table_renders() -> None:
    first = {"benchmark": "architectures", "llama_cpp_builds": {"llama_cpp": {}}, "runs": [{"at": "1"}],
             "architectures": {"gemma3": {"model": "Gemma-3-1B", "ours": {"served_weight_mb": 700.0},
                                          "decode": {"2048": _piece(60.0, 40.0)},
                                          "prefill": {"ours_tokens_per_s": 300.0, "llama_cpp_tokens_per_s": 200.0,
                                                      "ours_vs_llama_cpp": 1.5}}}}
    second = {"benchmark": "architectures", "llama_cpp_builds": {"llama_cpp": {}}, "runs": [{"at": "2"}],
              "architectures": {"gemma3": {"model": "Gemma-3-1B", "ours": {"served_weight_mb": 700.0},
                                           "decode": {"16384": _piece(30.0, 20.0, equal=False)}},
                                "qwen2": {"model": "Qwen2.5-1.5B", "ours": "refused: no", "decode": {}}}}
    merged = arch.merge(first, second)
    g3 = merged["architectures"]["gemma3"]
    assert set(g3["decode"]) == {"2048", "16384"} and g3["prefill"]["ours_vs_llama_cpp"] == 1.5  # kept
    assert [r["at"] for r in merged["runs"]] == ["1", "2"] and "qwen2" in merged["architectures"]
    merged["long_document"] = {"model": "Gemma-3-1B", "document_tokens": 32768,
                               "ours": {"cold_ttft_s": 90.0, "same_question_ttft_ms": {"median": 80.0},
                                        "another_question_ttft_ms": {"median": 85.0},
                                        "decode_tokens_per_s": {"median": 50.0}, "memory": {"after_all_mb": 2000}},
                               "llama_cpp": {"cold_ttft_s": 120.0, "same_question_ttft_ms": {"median": 90.0},
                                             "another_question_ttft_ms": {"median": 95.0},
                                             "decode_tokens_per_s": {"median": 30.0},
                                             "memory": {"after_all_mb": 2500}}}
    verify = {g: 0.1 * (1 + 0.2 * g) for g in range(1, 9)}
    merged["drafter"] = {"target": {"model": "Llama-3.1-8B"}, "drafter": {"model": "Llama-3.2-1B"},
                         "target_step_ms": 100.0, "drafter_forward_ms": 15.0,
                         "chain_model": arch.chain_model(0.1, 0.015, verify)}
    lines = arch.table(merged)
    header = lines[0]
    assert "decode at 2K" in header and "decode at 16K" in header
    row = next(line for line in lines if line.startswith("| `gemma3`"))
    assert "60.0 / 40.0 (**1.50x**)" in row and "30.0 / 20.0 (**1.50x**)" in row and "300 / 200 (1.50x)" in row
    assert "2K: =, logits ±0.03" in row and "16K: 5 (gaps 0.1/0.1)" in row
    assert any(line.startswith("| `qwen2`") and "refused: no" in line for line in lines)
    assert any("32K-token document" in line for line in lines)
    assert any(line.startswith("| time to first token, cold | 90.0 s / 120.0 s") for line in lines)
    assert any(line.startswith("| speed-up over plain decoding at acceptance 0.8") for line in lines)
    assert any(line.startswith("| break-even acceptance") for line in lines)


def test_the_options() -> None:
    args = arch.parse_args(["--archs", "gemma3,Qwen2", "--sections", "decode,prefill", "--contexts", "2048,16384",
                            "--runs", "5"])
    assert args.archs == ["gemma3", "qwen2"] and args.sections == ["decode", "prefill"]
    assert args.contexts == [2048, 16384] and args.runs == 5 and args.builds == ["llama_cpp"]
    full = arch.parse_args([])
    assert full.archs == list(arch.ARCHS) and full.sections == list(arch.SECTIONS) and full.runs == 3
    for bad in (["--archs", "falcon"], ["--sections", "everything"]):
        with pytest.raises(SystemExit):
            arch.parse_args(bad)


def test_the_shapes_fit_a_32k_document() -> None:
    for a in [*arch.ARCHS.values(), arch.TARGET]:
        assert a.shape.context >= arch.MIN_CONTEXT and a.trained_context <= a.shape.context
        assert a.shape.heads % a.shape.kv_heads == 0
    assert arch.ARCHS[arch.DRAFTER_ARCH].shape.vocab == arch.TARGET.shape.vocab  # RAPID needs one vocabulary
