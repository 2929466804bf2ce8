"""Device bookkeeping, checked on the CPU: one device-to-host transfer per decoding step, the prefill's top-k
on the device until it is cached or returned, no CPU generator meeting a device tensor, the prefill chunk by
device.

The target's logits are wrapped in ``OnDevice``, a tensor subclass standing in for an accelerator's tensor:
everything computed from them stays ``OnDevice``, and every host read of one (``.tolist()``, ``float()``,
``.cpu()``...) is recorded. ``decoding.runtime.host.fetch`` is the one sanctioned way over: the spy counts the calls
that carry an ``OnDevice`` tensor (a real transfer on a device) and hands back plain tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import pytest
import torch

from decoding.cache.prefix import PrefixCache, PrefixEntry
from decoding.cache.slot import SlotCache
from decoding.drafters.prompt_lookup import PromptLookupDrafter
from decoding.drafters.rapid import DraftLM, RapidDrafter
from decoding.runtime import host
from decoding.speculative import engine as engine_module
from decoding.speculative.drafter import BaseDrafter, Drafter, PromptInfo, VerifyOutcome
from decoding.speculative.engine import Engine, EngineConfig
from decoding.speculative.generation import DoneEvent, GenerationConfig, Prompt, SamplingParams
from decoding.speculative.prefill import TOPK_CHUNK, TOPK_LOGITS_BYTES, default_prefill_chunk, topk_chunk
from tests.decoding.conftest import VOCAB, TinyTarget, tiny_target

N = 24
DOC = [5, 17, 3, 42, 8, 8, 23, 61, 5, 17, 3, 42, 8, 9, 23] * 3  # repeats: prompt lookup drafts


class OnDevice(torch.Tensor):
    """A CPU tensor playing an accelerator's: host reads of it are recorded in ``reads``."""

    reads: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        moves = name == "to" and any(isinstance(a, str | torch.device) for a in (*args[1:], *(kwargs or {}).values()))
        if name in _READS or moves:
            cls.reads.append(name)
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out.as_subclass(torch.Tensor) if moves or name == "cpu" else out  # what a transfer gives


_READS = {"item", "tolist", "__float__", "__int__", "__index__", "__bool__", "numpy", "cpu"}


class SimEngine(Engine):
    """The engine with its target's logits ``OnDevice``; ``per_step``: transfers of each decoding step."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.per_step: list[int] = []

    def _forward(self, *args: Any, **kw: Any) -> torch.Tensor:
        return super()._forward(*args, **kw).as_subclass(OnDevice)

    def _step(self, run: Any) -> list[int]:
        before = len(TRANSFERS)
        out = super()._step(run)
        self.per_step.append(len(TRANSFERS) - before)
        return out


TRANSFERS: list[int] = []  # one entry per fetch that moved something
REAL_FETCH = host.fetch


@pytest.fixture(autouse=True)
def spy_fetch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    real = REAL_FETCH

    def fetch(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if any(isinstance(t, OnDevice) for t in tensors):
            TRANSFERS.append(len(tensors))
        return real(*(t.as_subclass(torch.Tensor) for t in tensors))

    monkeypatch.setattr(host, "fetch", fetch)
    TRANSFERS.clear()
    OnDevice.reads = []
    yield


@pytest.fixture(scope="module")
def target() -> TinyTarget:
    torch.set_num_threads(1)
    return tiny_target(0, cpu_kernels=False)


class Recorder(BaseDrafter):
    """Records what the engine hands a drafter: the prompt's top-k and every step's node top-k."""

    name = "recorder"
    uses_node_topk = True

    def __init__(self) -> None:
        self.prompt_topk: list[torch.Tensor | None] = []
        self.node_topk: list[torch.Tensor | None] = []

    def begin(self, prompt: PromptInfo) -> None:
        self.prompt_topk.append(prompt.prompt_topk)

    def observe(self, outcome: VerifyOutcome) -> None:
        self.node_topk.append(outcome.node_topk)


SAMPLINGS = {
    "greedy": SamplingParams(),
    "unseeded": SamplingParams(temperature=0.9, top_p=0.95),
    "seeded": SamplingParams(temperature=0.8, top_k=20, seed=7),
}


def _drafters(kind: str, target: TinyTarget, sampling: SamplingParams) -> list[Drafter]:
    if kind == "tree":  # prompt lookup with branches, and an LM drafting sampled nodes (q) under sampling
        return [PromptLookupDrafter(branches=3), RapidDrafter(DraftLM(target.model), sampling, threshold=0.0),
                Recorder()]  # fmt: skip
    return []


def _generate(engine: Engine, sampling: SamplingParams, drafters: list[Drafter], prefix_key: str | None = None,
              budget: int | None = 8) -> DoneEvent:  # fmt: skip
    prompt = Prompt(DOC, [3, 42, 9], prefix_key=prefix_key, segment_ends=[15, 30, 45] if prefix_key else ())
    cfg = GenerationConfig(max_new_tokens=N, sampling=sampling, draft_budget=budget)
    done = list(engine.generate(prompt, cfg, drafters))[-1]
    assert isinstance(done, DoneEvent)
    return done


@pytest.mark.parametrize("drafting", ["plain", "tree"])
@pytest.mark.parametrize("mode", list(SAMPLINGS))
def test_one_transfer_per_step(target: TinyTarget, mode: str, drafting: str) -> None:
    """Every decoding step brings the device's results over in one ``fetch`` and reads nothing else off the
    device; the first token (from the prefill's logits) likewise. The greedy and seeded answers are the
    plain engine's."""
    sampling = SAMPLINGS[mode]
    engine = SimEngine(target, config=EngineConfig(node_topk=4))
    done = _generate(engine, sampling, _drafters(drafting, target, sampling))
    assert OnDevice.reads == []
    assert engine.per_step and engine.per_step == [1] * done.stats.steps
    assert len(TRANSFERS) == done.stats.steps + 1  # + the first token
    if drafting == "tree":
        assert done.stats.drafted > 0
    if mode != "unseeded":
        plain = _generate(Engine(target, config=EngineConfig(node_topk=4)), sampling,
                          _drafters(drafting, target, sampling))  # fmt: skip
        assert done.token_ids == plain.token_ids


def test_node_topk_reaches_drafters_on_the_host(target: TinyTarget) -> None:
    """The node top-k travels in the step's one transfer (argmax rows and top-k packed together) and is the
    target's top-k of every verified row."""
    recorder = Recorder()
    engine = SimEngine(target, config=EngineConfig(node_topk=5))
    _generate(engine, SAMPLINGS["greedy"], [PromptLookupDrafter(branches=2), recorder])
    assert recorder.node_topk and all(type(t) is torch.Tensor for t in recorder.node_topk)
    assert all(t.shape[1] == 5 and t.dtype == torch.long for t in recorder.node_topk)
    assert set(TRANSFERS[1:]) == {2}  # each step: [argmax, top-k] in one fetch
    none = Recorder()  # node_topk=0: drafters still get a (k = 0) top-k
    _generate(SimEngine(target, config=EngineConfig(node_topk=0)), SAMPLINGS["greedy"], [none])
    assert none.node_topk and all(t is not None and t.shape[1] == 0 for t in none.node_topk)


def test_node_topk_is_computed_only_for_drafters_that_read_it(target: TinyTarget) -> None:
    """A top-k over the vocabulary at every verified row is host work each step would pay: with no drafter that
    reads it (prompt lookup, RAPID) the step's transfer is the argmax rows alone and drafters see None."""
    quiet = Recorder()
    quiet.uses_node_topk = False
    _generate(SimEngine(target, config=EngineConfig(node_topk=5)), SAMPLINGS["greedy"],
              [PromptLookupDrafter(branches=2), quiet])
    assert quiet.node_topk and all(t is None for t in quiet.node_topk)
    assert set(TRANSFERS[1:]) == {1}  # each step: the argmax rows only


def test_sampling_never_hands_a_device_tensor_to_a_cpu_generator(
    target: TinyTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unseeded sampling draws with the request's CPU generator: every tensor it samples from is a host one
    (on a GPU, a CPU generator with CUDA probabilities raises), and the verifiers get host probabilities."""
    seen: list[tuple[str, str, bool]] = []
    real_multinomial, real_rand = torch.multinomial, torch.rand

    def multinomial(p: torch.Tensor, *args: Any, generator: torch.Generator | None = None, **kw: Any) -> Any:
        if generator is not None:
            seen.append((generator.device.type, p.device.type, isinstance(p, OnDevice)))
        return real_multinomial(p, *args, generator=generator, **kw)

    def rand(*args: Any, generator: torch.Generator | None = None, device: Any = None, **kw: Any) -> Any:
        if generator is not None:
            seen.append((generator.device.type, torch.device(device or "cpu").type, False))
        return real_rand(*args, generator=generator, device=device, **kw)

    verified: list[bool] = []
    real_verify = engine_module.verify_sampling

    def verify_sampling(tree: Any, probs: torch.Tensor, *args: Any) -> Any:
        verified.append(isinstance(probs, OnDevice))
        return real_verify(tree, probs, *args)

    monkeypatch.setattr(torch, "multinomial", multinomial)
    monkeypatch.setattr(torch, "rand", rand)
    monkeypatch.setattr(engine_module, "verify_sampling", verify_sampling)
    engine = SimEngine(target)
    _generate(engine, SAMPLINGS["unseeded"], [PromptLookupDrafter(branches=3)])
    assert verified and not any(verified)
    assert seen and all(g == d and not on_device for g, d, on_device in seen)


def test_prefill_topk_stays_on_the_device_until_cached(target: TinyTarget) -> None:
    """With prompt_topk and three cacheable segments: one transfer per segment put into the prefix cache and
    one for the rows after them; the cache and the drafters get host top-k equal to the plain engine's, and
    a second request reads it back from the cache without a transfer for it."""
    config = EngineConfig(prompt_topk=6, prefill_chunk=4)
    cache = PrefixCache(1 << 30)
    engine = SimEngine(target, prefix_cache=cache, config=config)
    recorder = Recorder()
    _generate(engine, SAMPLINGS["greedy"], [recorder], prefix_key="doc")
    prefill_transfers = len(TRANSFERS) - sum(engine.per_step) - 1  # minus the steps' and the first token's
    assert prefill_transfers == 3 + 1 and OnDevice.reads == []
    assert len(cache) == 3
    entries = [e for e in cache._entries.values()]
    assert all(type(e.topk) is torch.Tensor and e.topk.shape == (15, 6) for e in entries)
    plain = Recorder()
    _generate(Engine(target, prefix_cache=PrefixCache(1 << 30), config=config), SAMPLINGS["greedy"], [plain],
              prefix_key="doc")  # fmt: skip
    got, want = recorder.prompt_topk[0], plain.prompt_topk[0]
    assert got is not None and want is not None and type(got) is torch.Tensor
    assert torch.equal(got, want) and got.shape == (len(DOC) + 3, 6)

    TRANSFERS.clear()
    engine.per_step = []
    again = Recorder()
    _generate(engine, SAMPLINGS["greedy"], [again], prefix_key="doc")
    assert len(TRANSFERS) - sum(engine.per_step) - 1 == 1  # only the question's rows ran
    assert again.prompt_topk[0] is not None and torch.equal(again.prompt_topk[0], want)


def test_cached_topk_held_on_a_device_comes_to_the_host(target: TinyTarget) -> None:
    """A prefix-cache entry whose top-k sits on the device (a disk load onto the GPU) is brought over before
    it is joined with the fresh rows' top-k: the prompt's top-k is one host tensor."""
    config = EngineConfig(prompt_topk=6, prefill_chunk=4)
    cache = PrefixCache(1 << 30)
    _generate(Engine(target, prefix_cache=cache, config=config), SAMPLINGS["greedy"], [], prefix_key="doc")
    for key, entry in list(cache._entries.items()):
        assert entry.topk is not None
        cache.put(key, PrefixEntry(entry.keys, entry.values, entry.topk.as_subclass(OnDevice)), persist=False)
    recorder = Recorder()
    engine = SimEngine(target, prefix_cache=cache, config=config)
    _generate(engine, SAMPLINGS["greedy"], [recorder], prefix_key="doc")
    got = recorder.prompt_topk[0]
    assert got is not None and type(got) is torch.Tensor and got.shape == (len(DOC) + 3, 6)
    assert OnDevice.reads == []


def test_prefill_chunk_by_device() -> None:
    assert default_prefill_chunk("cpu") == 256
    assert default_prefill_chunk(torch.device("cuda")) == 4096 == default_prefill_chunk("cuda:1")
    assert Engine(tiny_target(0, cpu_kernels=False)).reader.prefill_chunk == 256
    assert Engine(tiny_target(0, cpu_kernels=False), config=EngineConfig(prefill_chunk=32)).reader.prefill_chunk == 32
    with pytest.raises(ValueError):
        EngineConfig(prefill_chunk=0)


def test_topk_chunk_bounds_the_logits_of_a_chunk() -> None:
    assert topk_chunk(256, 49152) == 256 and topk_chunk(4, 151936) == 4  # the CPU's chunks are unchanged
    rows = topk_chunk(4096, 151936)
    assert TOPK_CHUNK < rows < 4096 and rows * 151936 * 4 <= TOPK_LOGITS_BYTES
    assert topk_chunk(4096, 10**7) == TOPK_CHUNK == topk_chunk(4096, 0)  # never below 256 rows


def test_large_chunks_split_where_every_row_keeps_its_logits(
    target: TinyTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a large prefill chunk, a prompt runs in one forward; with prompt_topk in forwards of at most
    ``topk_chunk`` rows, and its top-k then equals a small-chunk prefill's."""
    monkeypatch.setattr("decoding.speculative.prefill.TOPK_LOGITS_BYTES", 300 * VOCAB * 4)  # 300 rows of this vocab
    ids = [(7 * i + 3) % VOCAB for i in range(500)]
    rows: list[int] = []

    def sizes(engine: Engine) -> list[int]:
        forward = engine.reader.forward

        def counting(ids: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
            rows.append(ids.shape[1])
            return forward(ids, *args, **kw)

        engine.reader.forward = counting
        rows.clear()
        with torch.inference_mode():
            engine.prefill(ids, SlotCache(engine.num_layers, len(ids)))
        return rows[:]

    big = Engine(target, config=EngineConfig(prefill_chunk=4096))
    assert sizes(big) == [500]
    with_topk = Engine(target, config=EngineConfig(prefill_chunk=4096, prompt_topk=4))
    assert sizes(with_topk) == [300, 200]
    with torch.inference_mode():
        _, topk = with_topk.prefill(ids, SlotCache(with_topk.num_layers, len(ids)))
        small = Engine(target, config=EngineConfig(prefill_chunk=100, prompt_topk=4))
        _, want = small.prefill(ids, SlotCache(small.num_layers, len(ids)))
    assert topk is not None and want is not None and topk.shape == (500, 4)
    assert (topk[:, 0] == want[:, 0]).float().mean() > 0.99  # chunking only moves floats by rounding


def test_pack_round_trips_every_dtype_and_fetch_leaves_host_tensors_alone() -> None:
    parts = [torch.randn(3, 5), torch.arange(7), torch.tensor(True), torch.randn(2, 3, dtype=torch.float64),
             torch.randn(4).to(torch.bfloat16), torch.zeros(0, 3, dtype=torch.long),
             torch.randint(0, 9, (3,), dtype=torch.int16)]  # fmt: skip
    packed = host.pack(parts)
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    back = host.unpack(packed.clone(), parts)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(parts, back, strict=True))
    a, b = torch.randn(2), torch.arange(3)
    got = REAL_FETCH(a, b)
    assert got[0] is a and got[1] is b


def test_host_argmax_is_torchs_argmax_ties_and_nan_included() -> None:
    """``host.argmax`` (numpy on plain CPU tensors) picks what ``torch.argmax`` picks: the first maximal index, a NaN
    as the maximum; a device's tensor (here ``OnDevice``) stays with torch, for ``fetch``."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(-3, 4, (17, 1000), generator=g).float()  # many ties
    logits[5, 10] = logits[5, 700] = 9.0
    logits[7, 300] = float("nan")
    logits[8, 2] = logits[8, 900] = float("nan")
    got = host.argmax(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1))
    assert got[5] == 10 and got[7] == 300 and got[8] == 2
    assert torch.equal(host.argmax(logits[3]), logits[3].argmax(dim=-1))  # one row: a 0-d result
    OnDevice.reads.clear()
    on_device = host.argmax(logits.as_subclass(OnDevice))
    assert type(on_device) is OnDevice and OnDevice.reads == []
