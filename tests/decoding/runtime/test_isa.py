"""The CPU kernels' ISA paths: chosen from what the CPU reports, forced by configuration, refused clearly where
the CPU lacks them, one library each in the kernel cache; on every path this CPU has, a row computed alone equals
the same row among 64 shuffled ones bit for bit, speculative greedy equals plain greedy, and every path gives the
same bits as the AVX2 baseline (the AMX int8 tiles and the 16-lane attention included), except a bf16 KV cache's
attention where it multiplies bf16 operands (amx's tiles; avx512's vector dot products on a CPU with AVX-512 BF16): its
own arithmetic, invariant in itself and close to the exact result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.services import configure_kernels
from app.settings import Settings
from decoding.errors import ModelLoadError
from decoding.runtime import kernels
from decoding.runtime.kernels import KernelUnavailable, available_isas, resolve_isa
from decoding.runtime.kernels import cpu as kernel_cpu
from decoding.runtime.quant import WeightType, quantize
from decoding.speculative.engine import Engine
from tests.decoding.conftest import PROMPT, RandomTreeDrafter, TinyTarget, TinyTokenizer, quantized_tiny_llama, run

AVX2 = frozenset({"avx2", "fma", "f16c", "sse4_2"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
AMX = AVX512 | {"amx_tile", "amx_int8", "amx_bf16", "avx512_bf16"}
HERE = [isa for isa in kernels.ISAS if isa in available_isas()]  # the paths this CPU runs


def test_paths_are_chosen_from_the_cpu_flags() -> None:
    assert resolve_isa("auto", AVX2) == "avx2"
    assert resolve_isa("auto", AVX512) == "avx512" and resolve_isa("auto", AMX) == "amx"
    assert resolve_isa("avx2", AMX) == "avx2" and resolve_isa("avx512", AMX) == "avx512"  # forcing a lesser path
    assert available_isas(AMX) == ["amx", "avx512", "avx2"] and available_isas(frozenset()) == []
    with pytest.raises(KernelUnavailable, match=r"'avx512' needs avx512_vnni, avx512bw, avx512f, avx512vl.*run: avx2"):
        resolve_isa("avx512", AVX2)
    with pytest.raises(KernelUnavailable, match=r"'amx' needs amx_bf16, amx_int8, amx_tile, avx512_bf16.*run: avx512"):
        resolve_isa("amx", AVX512)
    with pytest.raises(KernelUnavailable, match="unknown CPU kernel path 'neon'"):
        resolve_isa("neon", AMX)


def test_the_service_refuses_a_path_the_cpu_lacks_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    before = kernels.config()
    monkeypatch.setattr(kernel_cpu, "cpu_flags", lambda: AVX2)  # where resolve_isa reads it
    with pytest.raises(ModelLoadError, match=r"RAGSPEC_CPU_ISA=avx512: .*needs avx512_vnni"):
        configure_kernels(Settings(cpu_isa="avx512"))
    with pytest.raises(ModelLoadError, match=r"RAGSPEC_CPU_ISA=amx: .*needs amx_bf16, amx_int8, amx_tile, avx512_bf16"):
        configure_kernels(Settings(cpu_isa="amx"))
    assert kernels.config() == before  # nothing changed
    with pytest.raises(ValueError, match="cpu_isa"):
        Settings(cpu_isa="neon")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def libraries() -> dict[str, object]:
    """Every path this CPU runs, loaded from the usual kernel cache (built there once)."""
    if kernels.load() is None:
        pytest.skip("CPU kernels unavailable on this machine")
    found = {isa: kernels.library(isa) for isa in HERE}
    assert all(lib.rs_isa().decode() == isa for isa, lib in found.items())
    return found  # type: ignore[return-value]


def test_each_path_is_its_own_library_in_the_cache(libraries: dict[str, object]) -> None:
    names = {isa: Path(lib._name).name for isa, lib in libraries.items()}  # type: ignore[attr-defined]
    assert len(set(names.values())) == len(HERE) and all(f"-{isa}-" in name for isa, name in names.items())


@pytest.mark.parametrize("kind", [WeightType.Q8_0, WeightType.Q4_1])
def test_rows_alone_equal_rows_among_64_on_every_path(libraries: dict[str, object], kind: WeightType) -> None:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 576, generator=g) * 3
    qm = quantize(torch.randn(200, 576, generator=g), kind)
    perm = torch.randperm(64, generator=g)
    outputs = {}
    for isa, lib in libraries.items():
        whole = kernels.qlinear(lib, x, qm)  # type: ignore[arg-type]
        shuffled = kernels.qlinear(lib, x[perm], qm)  # type: ignore[arg-type]
        assert torch.equal(shuffled, whole[perm]), isa
        for i in (0, 17, 63):
            assert torch.equal(kernels.qlinear(lib, x[i : i + 1], qm), whole[i : i + 1]), isa  # type: ignore[arg-type]
        outputs[isa] = whole
    for isa, whole in outputs.items():
        assert torch.equal(whole, outputs["avx2"]), f"{isa} differs from avx2"


@pytest.mark.parametrize("kind", [WeightType.Q8_0, WeightType.Q4_1])
def test_ragged_shapes_give_every_path_the_same_bits(libraries: dict[str, object], kind: WeightType) -> None:
    """Row counts around the tile size (the AMX path takes 8 rows and more, 16 a tile), weight rows that fill
    neither a pair of groups nor a group, bias and residual: every path equals the baseline."""
    g = torch.Generator().manual_seed(12)
    for n in (8, 13, 24, 40):
        qm = quantize(torch.randn(n, 96, generator=g), kind)
        bias = torch.randn(n, generator=g)
        for m in (7, 8, 15, 16, 17, 40):
            x, res = torch.randn(m, 96, generator=g) * 2, torch.randn(m, n, generator=g)
            want = kernels.qlinear(libraries["avx2"], x, qm, bias, res)  # type: ignore[arg-type]
            for isa, lib in libraries.items():
                assert torch.equal(kernels.qlinear(lib, x, qm, bias, res), want), (isa, n, m)  # type: ignore[arg-type]


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16"])
def test_tree_attention_gives_every_path_the_same_bits(libraries: dict[str, object], half: bool) -> None:
    """A verify-shaped attention (9 query heads on 3 key heads, a 150-key prefix, a 20-node tree): the wide paths
    widen each key block once for all rows and run 16 lanes; the results are the baseline's bits."""
    g = torch.Generator().manual_seed(13)
    heads, groups, d, past, n = 9, 3, 64, 150, 20
    k, v = torch.randn(1, groups, past + n, d, generator=g), torch.randn(1, groups, past + n, d, generator=g)
    if half:
        k, v = k.half(), v.half()
    q = torch.randn(1, heads, n, d, generator=g)
    vis = _tree_queries(g, past, n)
    outs = {isa: kernels.attention(lib, q, k, v, *vis, scale=d**-0.5) for isa, lib in libraries.items()}  # type: ignore[arg-type]
    for isa, out in outs.items():
        assert torch.equal(out, outs["avx2"]), isa


def _tree_queries(g: torch.Generator, past: int, n: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The visibility of n tree nodes after a past-key prefix: each node sees its ancestors and itself."""
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]
    path, off = [], [0]
    for i in range(n):
        chain, j = [], i
        while j >= 0:
            chain.append(past + j)
            j = parents[j]
        path += sorted(chain)
        off.append(len(path))
    return past, torch.tensor(path, dtype=torch.int32), torch.tensor(off, dtype=torch.int32)


def _bf16_products(libraries: dict[str, object]) -> list[str]:
    """The paths here whose bf16 cache's attention multiplies bf16 operands."""
    return [isa for isa, lib in libraries.items() if kernels.attention_bf16(lib)]  # type: ignore[arg-type]


@pytest.mark.parametrize(("past", "d"), [(0, 64), (37, 64), (300, 32), (1100, 64), (130, 128)])
def test_attention_on_bf16_products_is_row_invariant_and_close(
    libraries: dict[str, object], past: int, d: int
) -> None:
    """A bf16 cache where the path multiplies bf16 operands (the tiles; the AVX-512 BF16 dot products): 64 tree nodes
    (9 query heads on 3 key heads) in one call, in shuffled order, and each node alone give the same bits; the result
    is the exact attention of the bf16 operands within bf16 rounding; the paths without them read the same bf16 cache
    with the baseline's bits."""
    if not _bf16_products(libraries):
        pytest.skip("no bf16 products on this CPU (AMX or AVX-512 BF16)")
    g = torch.Generator().manual_seed(past)
    heads, groups, n = 9, 3, 64
    k = torch.randn(1, groups, past + n, d, generator=g).bfloat16()
    v = torch.randn(1, groups, past + n, d, generator=g).bfloat16()
    q = torch.randn(1, heads, n, d, generator=g) * 2
    _, path, off = _tree_queries(g, past, n)
    order = torch.randperm(n, generator=g)
    rows = [path[off[i] : off[i + 1]] for i in order.tolist()]
    outs = {}
    for isa in _bf16_products(libraries):
        lib = libraries[isa]
        out = outs[isa] = kernels.attention(lib, q, k, v, past, path, off, scale=d**-0.5)  # type: ignore[arg-type]
        shuffled = kernels.attention(  # type: ignore[arg-type]
            lib, q[:, :, order], k, v, past, torch.cat(rows),
            torch.tensor([0] + [len(r) for r in rows]).cumsum(0).int(), scale=d**-0.5,
        )
        assert torch.equal(shuffled, out[:, order]), isa
        for i in (0, 1, n // 2, n - 1):
            alone = kernels.attention(lib, q[:, :, i : i + 1], k, v, past, path[off[i] : off[i + 1]],  # type: ignore[arg-type]
                                      torch.tensor([0, int(off[i + 1] - off[i])], dtype=torch.int32), scale=d**-0.5)
            assert torch.equal(alone[0, 0], out[0, i]), (isa, i)
        for m in (2, 3, 5, 7):  # a verify's few nodes: 6, 9, 15, 21 query rows a key head, in tiles of even size
            some = kernels.attention(lib, q[:, :, :m], k, v, past, path[: off[m]], off[: m + 1],  # type: ignore[arg-type]
                                     scale=d**-0.5)
            assert torch.equal(some, out[:, :m]), (isa, m)
    visible = torch.zeros(n, past + n, dtype=torch.bool)
    visible[:, :past] = True
    for i in range(n):
        visible[i, path[off[i] : off[i + 1]].long()] = True
    kk, vv = (t.float().repeat_interleave(heads // groups, dim=1) for t in (k, v))

    def exact(queries: torch.Tensor) -> torch.Tensor:
        scores = (queries @ kk.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
        return (scores.softmax(-1) @ vv).transpose(1, 2)

    for isa, out in outs.items():  # their queries are bf16(q * scale)
        assert (out - exact((q * d**-0.5).bfloat16().float())).abs().max() < 1e-2, isa
    fp32 = {isa: kernels.attention(lib, q, k, v, past, path, off, scale=d**-0.5)  # type: ignore[arg-type]
            for isa, lib in libraries.items() if isa not in outs}
    for isa, out in fp32.items():
        assert torch.equal(out, fp32["avx2"]), isa
    assert (fp32["avx2"] - exact(q * d**-0.5)).abs().max() < 1e-4


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.int8])
def test_speculative_greedy_equals_plain_greedy_on_every_path(
    libraries: dict[str, object], kv_dtype: torch.dtype
) -> None:
    """The whole quantized forward (linear layers, norms, rope, attention, head) on each path: speculative ==
    autoregressive, and every path's tokens and logits equal the baseline's (fp16, bf16 and int8 KV caches; a bf16
    cache where the path multiplies bf16 operands: its own bits, close to the baseline's)."""
    torch.set_num_threads(1)
    tokens, logits = {}, {}
    for isa, lib in libraries.items():
        model = quantized_tiny_llama(5, kv_dtype=kv_dtype, head_dim=32)
        model.lib = lib  # type: ignore[assignment]
        engine = Engine(TinyTarget(model, TinyTokenizer(), f"tiny-{isa}", torch.device("cpu"), (), 512))
        plain = run(engine, PROMPT, 40, [], None).token_ids
        assert run(engine, PROMPT, 40, [RandomTreeDrafter(plain, seed=1)], 16).token_ids == plain, isa
        tokens[isa] = plain
        with torch.inference_mode():
            logits[isa] = model(torch.tensor([PROMPT.ids])).logits
    for isa in libraries:
        if kv_dtype == torch.bfloat16 and kernels.attention_bf16(libraries[isa]):  # type: ignore[arg-type]
            assert (logits[isa] - logits["avx2"]).abs().max() < 0.05
        else:
            assert tokens[isa] == tokens["avx2"] and torch.equal(logits[isa], logits["avx2"]), isa
