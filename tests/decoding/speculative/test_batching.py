"""Generations in several threads at once share the target's forwards (``decoding.speculative.batching``) and each
gives what it gives alone: greedy and seeded-sampling token ids, with or without drafters, staggered joins, one
finishing or cancelled while others run, a failure failing only its own request."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch

from decoding.cache.prefix import PrefixCache
from decoding.drafters.prompt_lookup import PromptLookupDrafter
from decoding.runtime import kernels
from decoding.runtime.interface import BatchItem
from decoding.speculative.batching import ForwardBatcher
from decoding.speculative.budget import DRAFTER_WARMUP, WARMUP
from decoding.speculative.drafter import BaseDrafter, DraftRequest
from decoding.speculative.engine import Engine
from decoding.speculative.generation import (
    DoneEvent,
    GenerationConfig,
    GenerationEvent,
    Prompt,
    SamplingParams,
    TokenEvent,
)
from decoding.speculative.tree import DraftTree
from tests.decoding.conftest import VOCAB, RandomTreeDrafter, tiny_target

N = 40


def prompt(seed: int, length: int, key: str | None = None) -> Prompt:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
    return Prompt(prefix_ids=ids[:-3], suffix_ids=ids[-3:], prefix_key=key)


@dataclass
class Request:
    """One generation to run: what it asks, and what it got (events, the done event, an error)."""

    prompt: Prompt
    config: GenerationConfig = field(default_factory=lambda: GenerationConfig(max_new_tokens=N))
    drafters: Callable[[], Sequence[BaseDrafter]] = lambda: ()
    events: list[GenerationEvent] = field(default_factory=list)
    error: BaseException | None = None
    cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def done(self) -> DoneEvent:
        assert isinstance(self.events[-1], DoneEvent), self.error
        return self.events[-1]

    def tokens(self) -> int:
        return sum(len(e.token_ids) > 0 for e in self.events if isinstance(e, TokenEvent))


def consume(engine: Engine, r: Request, on_event: Callable[[Request], None] = lambda r: None) -> None:
    try:
        for event in engine.generate(r.prompt, r.config, r.drafters(), cancel=r.cancel):
            r.events.append(event)
            on_event(r)
    except BaseException as exc:  # recorded for the test to check
        r.error = exc


def alone(engine: Engine, r: Request) -> list[int]:
    solo = Request(r.prompt, r.config, r.drafters)
    consume(engine, solo)
    return solo.done.token_ids


def together(engine: Engine, requests: Sequence[Request], on_event: Callable[[Request], None] = lambda r: None,
             starts: Sequence[threading.Event | None] = ()) -> None:
    """Run every request in its own thread; request i starts once ``starts[i]`` is set (None: at once)."""
    gates = list(starts) + [None] * (len(requests) - len(starts))

    def go(r: Request, gate: threading.Event | None) -> None:
        if gate is not None:
            assert gate.wait(60)
        consume(engine, r, on_event)

    threads = [threading.Thread(target=go, args=(r, g)) for r, g in zip(requests, gates, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a generation hung"


@pytest.fixture(scope="module")
def engine() -> Engine:
    if kernels.load() is None:
        pytest.skip("CPU kernels unavailable: no quantized runtime")
    torch.set_num_threads(1)
    return Engine(tiny_target(0, quantized=True), PrefixCache(64 << 20))


def mark(engine: Engine) -> tuple[int, int]:
    """The batcher's counts of forwards and of sequences in them so far."""
    assert engine.batcher is not None
    return engine.batcher.stats.forwards, engine.batcher.stats.sequences


def batched(engine: Engine, before: tuple[int, int]) -> bool:
    """Whether some forward since ``before`` (``mark``) held more than one sequence."""
    forwards, sequences = mark(engine)
    return sequences - before[1] > forwards - before[0]


MIXED = [
    ("plain", lambda: (), SamplingParams()),
    ("trees", lambda: (RandomTreeDrafter(list(range(N)), seed=3),), SamplingParams()),
    ("lookup", lambda: (PromptLookupDrafter(),), SamplingParams()),
    ("seeded", lambda: (PromptLookupDrafter(),), SamplingParams(temperature=0.9, top_k=20, seed=7)),
]


def test_concurrent_generations_each_give_their_solo_tokens(engine: Engine) -> None:
    """Five generations (different prompts, one past a prefill slice, two on one cached document prefix that their
    caches share and each forward reads once for both, greedy and seeded sampling, with and without draft trees)
    joined at once, then again with staggered joins."""
    shared = prompt(1, 150, key="doc")
    requests = [
        Request(prompt(10 + i, length, key), GenerationConfig(max_new_tokens=N, sampling=sampling), drafters)
        for i, ((_, drafters, sampling), length, key) in enumerate(zip(MIXED, (30, 300, 12, 60),
                                                                      (None, None, None, "other"), strict=True))
    ]
    requests[2] = Request(Prompt(shared.prefix_ids, [4, 5, 6], "doc"), requests[2].config, requests[2].drafters)
    requests.append(Request(Prompt(shared.prefix_ids, [7, 8, 9, 10], "doc"), GenerationConfig(max_new_tokens=N),
                            lambda: (RandomTreeDrafter(list(range(N)), seed=5),)))
    solo = [alone(engine, r) for r in requests]
    assert len(shared.prefix_ids) >= 2 * engine.model.share_block  # its first whole blocks are read in place
    assert all(len(s) == N for s in solo)

    before = mark(engine)
    together(engine, requests)
    assert [r.done.token_ids for r in requests] == solo
    assert batched(engine, before), "the generations never shared a forward"

    # staggered: each starts once the one before it has emitted 5 tokens
    gates = [threading.Event() for _ in requests]
    again = [Request(r.prompt, r.config, r.drafters) for r in requests]

    def on_event(r: Request) -> None:
        i = again.index(r)
        if r.tokens() >= 5 and i + 1 < len(gates):
            gates[i + 1].set()

    together(engine, again, on_event, [None, *gates[1:]])
    assert [r.done.token_ids for r in again] == solo


def test_one_finishing_or_cancelled_mid_batch_leaves_the_others_unchanged(engine: Engine) -> None:
    """A generation stopped by its length, one by a stop string, one cancelled mid-decode and one cancelled during
    its prompt's prefill (in slices beside the others) leave; the rest give their solo tokens."""
    base = [Request(prompt(20 + i, 40)) for i in range(3)]
    solo = [alone(engine, r) for r in base]
    stop_at = f"<{solo[1][6]}>"
    short = Request(base[0].prompt, GenerationConfig(max_new_tokens=7))
    stopped = Request(base[1].prompt, GenerationConfig(max_new_tokens=N, stop=(stop_at,)))
    runner = Request(base[2].prompt)
    cancelled = Request(prompt(30, 40))
    prefilling = Request(prompt(31, 480))
    solo_stopped = alone(engine, stopped)

    def on_event(r: Request) -> None:
        if r is cancelled and r.tokens() >= 3:
            r.cancel.set()
        if r is prefilling and len(r.events) >= 2:  # after its first slices
            r.cancel.set()

    requests = [short, stopped, runner, cancelled, prefilling]
    before = mark(engine)
    together(engine, requests, on_event)
    assert short.done.token_ids == solo[0][:7] and short.done.finish_reason == "length"
    assert stopped.done.token_ids == solo_stopped and stopped.done.finish_reason == "stop"
    assert runner.done.token_ids == solo[2]
    assert cancelled.done.finish_reason == "cancelled" and 3 <= len(cancelled.done.token_ids) < N
    assert prefilling.done.finish_reason == "cancelled" and prefilling.done.token_ids == []
    assert batched(engine, before)
    assert engine.batcher is not None and engine.batcher.present == 0


def test_people_asking_about_one_new_document_at_once_compute_its_prefix_once(engine: Engine) -> None:
    """Three generations on one document prefix nobody has read yet, started together: one computes it, the others
    wait for it (out of the batch meanwhile) and read it from the prefix cache; each gives its solo tokens. A waiter
    cancelled while it waits leaves at once; when the prefix is left uncomputed, a waiter computes it."""
    doc = prompt(50, 400, key="new-doc")
    asks = [Request(Prompt(doc.prefix_ids, [11 + i, 12, 13], "new-doc")) for i in range(3)]
    solo_engine = Engine(tiny_target(0, quantized=True))  # no prefix cache: the solo tokens, nothing cached here
    solo = [alone(solo_engine, r) for r in asks]
    together(engine, asks)
    assert [r.done.token_ids for r in asks] == solo
    reused = sorted(r.done.stats.prefix_reused_tokens for r in asks)
    assert reused == [0, len(doc.prefix_ids), len(doc.prefix_ids)], reused

    # a segment held as being computed (by a stand-in claimer): a waiter cancelled while it waits leaves at once;
    # released without being cached, the waiting generation computes it itself
    doc2 = prompt(51, 300, key="newer-doc")
    waiter, patient = (Request(Prompt(doc2.prefix_ids, [20 + i], "newer-doc")) for i in range(2))
    keys, _ = engine.reader._cached_run("newer-doc", waiter.prompt.ids, [len(doc2.prefix_ids)])
    held: dict[str, threading.Event] = {}
    for r in (waiter, patient):
        assert engine.reader._claim(keys, held, set()) is None
        t = threading.Thread(target=consume, args=(engine, r))
        t.start()
        time.sleep(0.3)
        assert t.is_alive() and not r.events, "it waits for the segment"
        if r is waiter:
            r.cancel.set()
        else:
            engine.reader._release(held)
            held.clear()
        t.join(60)
        assert not t.is_alive()
        if r is waiter:
            engine.reader._release(held)
            held.clear()
    assert waiter.done.finish_reason == "cancelled" and waiter.done.token_ids == []
    assert patient.done.token_ids == alone(solo_engine, patient)
    assert patient.done.stats.prefix_reused_tokens == 0


class CountingDrafter(RandomTreeDrafter):
    """Random trees whose every proposal is counted."""

    def __init__(self, answer: Sequence[int], seed: int) -> None:
        super().__init__(answer, seed)
        self.proposals = 0

    def propose(self, request: DraftRequest) -> DraftTree:
        self.proposals += 1
        return super().propose(request)


def test_in_a_big_batch_drafts_that_do_not_pay_are_not_drafted(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A generation whose drafts land rarely, in what it sees as a batch of 16 sequences that each forward serves
    faster than its drafting: after its first measured steps it drafts only to probe, and its tokens stay its plain
    ones. Alone its time is charged too, over a longer warm-up (``DRAFTER_WARMUP`` proposals)."""
    p = prompt(31, 40)
    plain = alone(engine, Request(p))
    wrong = [(t + 1) % VOCAB for t in plain]  # a drafter that is always wrong
    solo = CountingDrafter(wrong, seed=2)
    assert alone(engine, Request(p, drafters=lambda: (solo,))) == plain
    assert DRAFTER_WARMUP <= solo.proposals <= DRAFTER_WARMUP + N // engine.policy.explore_every + 1
    monkeypatch.setattr(engine, "_batch_now", lambda: (16, 1e-4))
    busy = CountingDrafter(wrong, seed=2)
    assert alone(engine, Request(p, drafters=lambda: (busy,))) == plain
    assert busy.proposals <= WARMUP + N // engine.policy.explore_every + 1, busy.proposals


def test_a_failing_generation_fails_alone(engine: Engine) -> None:
    """A prompt with a token outside the vocabulary fails its own generation; the others finish as alone."""
    good = [Request(prompt(40 + i, 50)) for i in range(2)]
    solo = [alone(engine, r) for r in good]
    bad = Request(Prompt([1, 2, VOCAB + 5], [3], None))
    together(engine, [good[0], bad, good[1]])
    assert isinstance(bad.error, ValueError)
    assert [r.done.token_ids for r in good] == solo


# ---- the batcher on its own ---------------------------------------------------------------------------------


class Recorder:
    """A ``forward_batch`` stand-in: logits are (position, sequence id) rows; records every batch's row counts."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.fail_on = fail_on

    def __call__(self, items: Sequence[BatchItem]) -> list[torch.Tensor]:
        self.batches.append([int(i.input_ids.numel()) for i in items])
        if self.fail_on is not None and len(self.batches) == self.fail_on:
            raise RuntimeError("kernel failure")
        out = []
        for item in items:
            cache = item.cache
            n = int(item.input_ids.numel())
            rows = torch.arange(cache.length, cache.length + n, dtype=torch.float32)  # type: ignore[attr-defined]
            cache.length += n  # type: ignore[attr-defined]
            keep = item.logits_to_keep or n
            out.append(torch.stack([rows, item.input_ids.reshape(-1).float()], 1)[-keep:])
        return out


class FakeCache:
    def __init__(self) -> None:
        self.length = 0


def test_a_long_causal_forward_runs_in_slices_and_returns_its_kept_rows() -> None:
    rec = Recorder()
    batcher = ForwardBatcher(rec, solo_rows=128, prefill_rows=16)
    ids = torch.arange(300)
    everything = batcher.forward(BatchItem(ids, FakeCache(), logits_to_keep=0))  # type: ignore[arg-type]
    assert torch.equal(everything[:, 0], torch.arange(300, dtype=torch.float32))
    assert torch.equal(everything[:, 1], ids.float())
    last = batcher.forward(BatchItem(ids, FakeCache(), logits_to_keep=130))  # type: ignore[arg-type]
    assert torch.equal(last[:, 0], torch.arange(170, 300, dtype=torch.float32))
    assert rec.batches == [[128], [128], [44], [128], [128], [44]]  # alone: whole slices of solo_rows


def test_beside_a_waiting_sequence_a_prompt_adds_prefill_rows_per_forward() -> None:
    rec = Recorder()
    batcher = ForwardBatcher(rec, solo_rows=128, prefill_rows=16)
    results: dict[str, torch.Tensor] = {}
    both_in = threading.Barrier(2)

    def prefill() -> None:
        with batcher.joined():
            both_in.wait()
            results["prefill"] = batcher.forward(BatchItem(torch.arange(40), FakeCache(), logits_to_keep=1))  # type: ignore[arg-type]

    def decode() -> None:
        cache = FakeCache()
        with batcher.joined():
            both_in.wait()
            for step in range(3):
                results[f"step{step}"] = batcher.forward(BatchItem(torch.tensor([7]), cache))  # type: ignore[arg-type]

    threads = [threading.Thread(target=prefill), threading.Thread(target=decode)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(map(sorted, rec.batches)) == [[1, 8], [1, 16], [1, 16]]  # 16 + 16 + 8 prompt rows beside a step
    assert results["prefill"].tolist() == [[39.0, 39.0]]
    assert [results[f"step{i}"][0, 0].item() for i in range(3)] == [0.0, 1.0, 2.0]


def test_a_failed_batch_fails_its_calls_and_the_batcher_keeps_serving() -> None:
    rec = Recorder(fail_on=1)
    batcher = ForwardBatcher(rec)
    with pytest.raises(RuntimeError, match="kernel failure"):
        batcher.forward(BatchItem(torch.tensor([1, 2]), FakeCache()))  # type: ignore[arg-type]
    assert batcher.forward(BatchItem(torch.tensor([1, 2]), FakeCache())).shape == (2, 2)  # type: ignore[arg-type]
    assert batcher.present == 0


def test_a_sequence_away_is_not_waited_for() -> None:
    """A joined thread that steps away (handing an event to a slow reader) does not hold up the others."""
    batcher = ForwardBatcher(Recorder())
    released, done = threading.Event(), threading.Event()

    def slow_reader() -> None:
        with batcher.joined(), batcher.away():
            released.wait(10)

    t = threading.Thread(target=slow_reader)
    t.start()
    try:
        with batcher.joined():
            batcher.forward(BatchItem(torch.tensor([1]), FakeCache()))  # type: ignore[arg-type]
            done.set()
    finally:
        released.set()
        t.join(10)
    assert done.is_set()
