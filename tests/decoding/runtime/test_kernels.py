"""decoding.runtime.kernels: agreement with torch, batch invariance (bit for bit), mask parsing, build and fallback."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from decoding.runtime import kernels
from decoding.runtime.interface import visibility
from decoding.runtime.kernels.building import _rename_soname
from decoding.speculative.tree import ROOT, DraftTree, tree_layout
from tests.decoding.conftest import make_tiny_llama

pytestmark = pytest.mark.heavy  # among the longest modules: scheduled first (tests/conftest.py)

lib = kernels.load()
needs_kernels = pytest.mark.skipif(lib is None, reason=f"CPU kernels unavailable: {kernels.unavailable_reason()}")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@needs_kernels
@pytest.mark.parametrize(
    ("m", "k", "n", "bias"),
    [(1, 64, 96, False), (5, 576, 192, True), (9, 13, 7, True), (3, 40, 4, False), (96, 72, 130, True)],
)
def test_linear_matches_torch(m: int, k: int, n: int, bias: bool) -> None:
    g = _gen(m * 1000 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    assert lib is not None
    got = kernels.linear(lib, x, w, b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_rows_are_batch_invariant(threads: int) -> None:
    """A row's result is the same bits alone, in any batch, at any position, on any thread count."""
    g = _gen(3)
    x, w, b = torch.randn(17, 200, generator=g), torch.randn(259, 200, generator=g), torch.randn(259, generator=g)
    assert lib is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = kernels.linear(lib, x, w, b)
        for i in range(17):
            assert torch.equal(kernels.linear(lib, x[i : i + 1], w, b), whole[i : i + 1])
        perm = torch.randperm(17, generator=g)
        assert torch.equal(kernels.linear(lib, x[perm], w, b), whole[perm])
        torch.set_num_threads(1 if threads == 2 else 2)
        assert torch.equal(kernels.linear(lib, x, w, b), whole)
    finally:
        torch.set_num_threads(before)


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=True)
    return out.transpose(1, 2)  # [1, n, H, D]


def _random_tree(n: int, seed: int) -> torch.Tensor:
    """Ancestor mask [n, n] of a random tree whose nodes come parent-first (row 0 is the root)."""
    g = _gen(seed)
    tree = DraftTree()
    for i in range(n - 1):
        parent = ROOT if i == 0 else int(torch.randint(-1, i, (1,), generator=g))
        tree.add(parent, i, "t")
    return tree_layout(0, tree, 0, torch.device("cpu")).ancestor_mask


@needs_kernels
@pytest.mark.parametrize(
    ("heads", "groups", "d", "past", "n"),
    [
        (9, 3, 64, 300, 1),
        (9, 3, 64, 300, 9),
        (4, 2, 16, 0, 7),
        (4, 4, 32, 77, 33),
        (6, 1, 8, 5, 20),
        (8, 2, 128, 130, 5),
        (3, 3, 72, 64, 2),
    ],
)
def test_attention_matches_sdpa_on_trees(heads: int, groups: int, d: int, past: int, n: int) -> None:
    g = _gen(past + n)
    cap = past + n + 11  # rows live in a bigger buffer, like the slot cache
    kbuf, vbuf = torch.randn(1, groups, cap, d, generator=g), torch.randn(1, groups, cap, d, generator=g)
    k, v = kbuf[:, :, : past + n], vbuf[:, :, : past + n]
    q = torch.randn(1, heads, n, d, generator=g)
    tree = _random_tree(n, seed=n)
    visible = torch.cat([torch.ones(n, past, dtype=torch.bool), tree], dim=1)
    mask = torch.zeros(1, 1, n, past + n + 3).masked_fill_(~F.pad(visible, (0, 3)), torch.finfo(torch.float32).min)
    vis = visibility(mask, n, past + n)
    assert vis is not None
    assert lib is not None
    got = kernels.attention(lib, q, k, v, *vis, scale=d**-0.5)
    torch.testing.assert_close(got, _reference_attention(q, k, v, visible), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16"])
def test_attention_over_a_subset_of_the_cached_rows(half: bool) -> None:
    """Queries that see only some cached rows (a drafter reading the retrieved chunks' KV), plus a chain."""
    g = _gen(3)
    heads, groups, d, past, n = 9, 3, 64, 700, 3
    k, v = torch.randn(1, groups, past + n, d, generator=g), torch.randn(1, groups, past + n, d, generator=g)
    if half:
        k, v = k.half(), v.half()
    q = torch.randn(1, heads, n, d, generator=g)
    keep = torch.zeros(past, dtype=torch.bool)
    for a, b in ((0, 70), (200, 330), (512, 600), (690, 700)):  # system, two chunks, question
        keep[a:b] = True
    visible = torch.cat([keep.expand(n, past), torch.ones(n, n, dtype=torch.bool).tril()], dim=1)
    mask = torch.zeros(1, 1, n, past + n).masked_fill_(~visible, float("-inf"))
    vis = visibility(mask, n, past + n)
    assert vis is not None and vis[0] == 70 and lib is not None
    got = kernels.attention(lib, q, k, v, *vis, scale=d**-0.5)
    want = _reference_attention(q, k.float(), v.float(), visible)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_is_batch_invariant_across_tree_and_chain(threads: int) -> None:
    """A query's output inside a tree equals, bit for bit, the output it gets decoded alone on the same keys
    (prefix keys are scored eight at a time, path keys one by one: both give the same bits)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_tree_equals_chain()
    finally:
        torch.set_num_threads(before)


def _check_tree_equals_chain() -> None:
    g = _gen(11)
    heads, groups, d, past, n = 9, 3, 64, 513, 12
    q = torch.randn(1, heads, n, d, generator=g)
    k, v = torch.randn(1, groups, past + n, d, generator=g), torch.randn(1, groups, past + n, d, generator=g)
    tree = _random_tree(n, seed=5)
    mask = torch.zeros(1, 1, n, past + n)
    mask[0, 0, :, past:].masked_fill_(~tree, float("-inf"))
    vis = visibility(mask, n, past + n)
    assert vis is not None and lib is not None
    together = kernels.attention(lib, q, k, v, *vis, scale=0.125)
    for i in range(n):
        path = tree[i].nonzero()[:, 0] + past  # the rows node i sees beyond the prefix, in order
        rows = torch.cat([torch.arange(past), path])
        # alone: a chain where those rows are contiguous and the query is the last one (a plain decode step)
        alone = kernels.attention(
            lib,
            q[:, :, i : i + 1],
            k[:, :, rows],
            v[:, :, rows],
            len(rows) - 1,
            torch.tensor([len(rows) - 1], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            scale=0.125,
        )
        assert torch.equal(alone[0, 0], together[0, i]), i


def test_visibility_parsing() -> None:
    past, path, off = visibility(None, 3, 10)  # type: ignore[misc]
    assert past == 7 and path.tolist() == [7, 7, 8, 7, 8, 9] and off.tolist() == [0, 1, 3, 6]
    neg = torch.finfo(torch.float32).min
    mask = torch.zeros(1, 1, 2, 6)
    mask[0, 0, 0, 5] = neg
    vis = visibility(mask, 2, 6)
    assert vis is not None and vis[0] == 4 and vis[1].tolist() == [4, 4, 5] and vis[2].tolist() == [0, 1, 3]
    hidden_prefix = mask.clone()
    hidden_prefix[0, 0, 1, 0] = neg  # query 1 does not see row 0: no prefix is seen whole, rows listed
    vis = visibility(hidden_prefix, 2, 6)
    assert vis is not None and vis[0] == 0
    assert vis[1].tolist() == [0, 1, 2, 3, 4, 1, 2, 3, 4, 5] and vis[2].tolist() == [0, 5, 10]
    hidden_prefix[0, 0, :, 2] = neg  # row 2 hidden from both: the whole prefix is [0, 2)
    vis = visibility(hidden_prefix, 2, 6)
    assert vis is not None and vis[0] == 0 and vis[1].tolist() == [0, 1, 3, 4, 1, 3, 4, 5]
    mask[0, 0, :, 3] = neg
    assert visibility(mask, 2, 6)[0] == 3  # type: ignore[index]
    bias = mask.clone()
    bias[0, 0, 0, 1] = -3.0  # an additive bias is not a visibility mask: fall back
    assert visibility(bias, 2, 6) is None
    assert visibility(torch.ones(1, 1, 2, 6, dtype=torch.bool), 2, 6) is not None
    assert visibility(torch.zeros(2, 1, 2, 6), 2, 6) is None  # batch of 2


@needs_kernels
def test_tiny_llama_decode_steps_equal_one_batched_forward() -> None:
    """With the kernels, logits of tokens fed one by one == logits of the same tokens in one forward, bitwise."""
    from transformers import DynamicCache

    model = make_tiny_llama(seed=4, layers=3)
    assert kernels.kernels_active(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 70), generator=_gen(2))
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=ids[:, :40], past_key_values=cache, use_cache=True)
        batched = model(input_ids=ids[:, 40:], past_key_values=cache, use_cache=True).logits
        cache = DynamicCache()
        model(input_ids=ids[:, :40], past_key_values=cache, use_cache=True)
        steps = [
            model(input_ids=ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits for i in range(40, 70)
        ]
        assert torch.equal(torch.cat(steps, dim=1), batched)
        plain = make_tiny_llama(seed=4, layers=3, cpu_kernels=False)
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)


def test_disabled_by_settings_falls_back(tmp_path: Path) -> None:
    """RAGSPEC_CPU_KERNELS=0 reaches the kernels through the service's settings (the library reads no
    environment): nothing is built and the model runs on torch's kernels."""
    code = (
        "import logging, torch; logging.basicConfig(level=logging.WARNING);"
        "from app.services import configure_kernels; from app.settings import Settings;"
        "from decoding.runtime import kernels; from tests.decoding.conftest import make_tiny_llama;"
        "configure_kernels(Settings());"
        "m = make_tiny_llama(); assert kernels.load() is None and not kernels.kernels_active(m);"
        "print(kernels.unavailable_reason())"
    )
    env = {"RAGSPEC_CPU_KERNELS": "0", "RAGSPEC_KERNEL_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=Path.cwd())
    assert out.returncode == 0, out.stderr
    assert "disabled by configuration" in out.stdout
    assert "CPU kernels unavailable" in out.stderr
    assert not list(tmp_path.iterdir())  # nothing was built


def test_the_library_reads_no_environment(tmp_path: Path) -> None:
    """The old variables (RAGSPEC_KERNEL_CACHE, RAGSPEC_CPU_KERNELS, CC) do nothing to ``decoding.runtime.kernels``
    by themselves; the service's settings carry the cache dir and compiler to it."""
    code = (
        "from pathlib import Path; from decoding.runtime import kernels;"
        "c = kernels.config(); assert c.enabled and c.cache_dir is None and c.compiler is None, c;"
        "assert kernels.cache_dir() == Path.home() / '.cache/ragspec/kernels', kernels.cache_dir();"
        "from app.services import configure_kernels; from app.settings import Settings;"
        "configure_kernels(Settings()); c = kernels.config();"
        f"assert c.cache_dir == Path({str(tmp_path)!r}) and c.compiler == '/bin/false' and not c.enabled, c"
    )
    env = {"RAGSPEC_CPU_KERNELS": "0", "RAGSPEC_KERNEL_CACHE": str(tmp_path), "CC": "/bin/false",
           "RAGSPEC_KERNEL_COMPILER": "/bin/false", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=Path.cwd())
    assert out.returncode == 0, out.stderr


def test_broken_compiler_gives_a_clear_reason_and_fallback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kernels.configure(cache_dir=tmp_path, compiler="/bin/false")
    try:
        with caplog.at_level(logging.WARNING):
            assert kernels.load() is None
        assert "compiling the CPU kernels failed" in kernels.unavailable_reason()
        assert "CPU kernels unavailable" in caplog.text
        model = make_tiny_llama(seed=1)
        assert not kernels.kernels_active(model)
        assert not list(tmp_path.glob("*.so"))
    finally:
        kernels.configure()
        kernels.load()


@needs_kernels
def test_build_is_cached_and_atomic(tmp_path: Path) -> None:
    """The configured path built into an empty cache dir, then found there; nothing else left behind. The path is
    avx2, the quickest to compile (every path's build: tests/app/test_deploy_build.py)."""
    before = kernels.config()
    kernels.configure(cache_dir=tmp_path, isa="avx2")
    try:
        _check_cached_atomic_build(tmp_path)
    finally:
        kernels.configure(before.enabled, before.cache_dir, before.compiler, before.isa)
        kernels.load()


def _check_cached_atomic_build(tmp_path: Path) -> None:
    first = kernels.build()
    assert first.parent == tmp_path and first.is_file() and first.name.startswith("libragspec_cpu-avx2-")
    stamp = first.stat().st_mtime_ns
    assert kernels.build() == first and first.stat().st_mtime_ns == stamp  # reused, not rebuilt
    private = kernels.private_openmp(kernels.config().compiler or "gcc")
    expected = [first.name] if private is None else sorted([first.name, "openmp"])
    assert sorted(p.name for p in tmp_path.iterdir()) == expected  # no temp files left behind
    if private is not None:
        assert [p.name for p in private.parent.iterdir()] == [kernels.PRIVATE_OPENMP]


@needs_kernels
def test_the_kernels_run_on_their_own_openmp_runtime_and_thread() -> None:
    """The loaded kernels use the private copy of libgomp (not the one torch loaded), and every call handed to the
    kernel thread runs on that one thread, with the caller's inference mode and thread count, and raises there."""
    assert kernels.load() is not None
    if kernels.private_openmp(kernels.config().compiler or "gcc") is not None:
        maps = Path("/proc/self/maps").read_text()
        assert kernels.PRIVATE_OPENMP in maps
    seen: list[tuple[int, bool, int]] = []

    def where() -> None:
        seen.append((threading.get_ident(), torch.is_inference_mode_enabled(), torch.get_num_threads()))

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.inference_mode():
            kernels.run_on_kernel_thread(where)
        worker = threading.Thread(target=kernels.run_on_kernel_thread, args=(where,))
        worker.start()
        worker.join(10)
    finally:
        torch.set_num_threads(before)
    assert len({ident for ident, _, _ in seen}) == 1 and seen[0][0] != threading.get_ident()
    assert [(inference, threads) for _, inference, threads in seen] == [(True, 1), (False, 1)]

    def fail() -> None:
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        kernels.run_on_kernel_thread(fail)


def test_a_renamed_runtime_keeps_its_bytes_but_its_name() -> None:
    lib = Path("/usr/lib/x86_64-linux-gnu/libgomp.so.1")
    if not lib.is_file():
        pytest.skip("no system libgomp here")
    data = lib.read_bytes()
    renamed = _rename_soname(data, b"libgomp.so.1", kernels.PRIVATE_OPENMP.encode())
    assert renamed is not None and len(renamed) == len(data)
    assert b"libgomp.so.1\0" not in renamed and kernels.PRIVATE_OPENMP.encode() + b"\0" in renamed
    assert _rename_soname(b"not an elf", b"libgomp.so.1", b"librsmp.so.1") is None
    assert _rename_soname(data, b"libgomp.so.1", b"short") is None
