"""Lossless with RACER: speculative greedy output == plain greedy output on a tiny random-weight Llama."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from decoding.drafters.racer import (
    SOURCE_CROSS_SESSION,
    SOURCE_LOGITS,
    SOURCE_RETRIEVAL,
    CrossSessionConfig,
    InProcessSharedTier,
    LogitsTable,
    RacerConfig,
    RacerDrafter,
    RacerFactory,
    RedisSharedTier,
)
from decoding.speculative.drafter import BaseDrafter, DraftRequest, VerifyOutcome
from decoding.speculative.engine import Engine, EngineConfig
from decoding.speculative.generation import DoneEvent, GenerationConfig, Prompt
from decoding.speculative.tree import DraftTree
from tests.conftest import RedisServer
from tests.decoding.conftest import VOCAB, TinyTarget

N = 48
_rng = random.Random(7)
DOC = [_rng.randrange(VOCAB) for _ in range(40)]
PROMPT = Prompt(prefix_ids=[1, 2, *DOC, 3, *DOC[5:30], 4], suffix_ids=[5, 6, 7], prefix_key=None)


def run(engine: Engine, prompt: Prompt, drafters: Sequence[object] = (), budget: int | None = None,
        n: int = N) -> DoneEvent:
    events = list(engine.generate(prompt, GenerationConfig(max_new_tokens=n, draft_budget=budget), drafters))  # type: ignore[arg-type]
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return done


@pytest.fixture(scope="module")
def engine(tiny: TinyTarget) -> Engine:
    return Engine(tiny, config=EngineConfig(prompt_topk=8, node_topk=8))


@pytest.fixture(scope="module")
def reference(tiny: TinyTarget) -> list[int]:
    return run(Engine(tiny), PROMPT).token_ids


@pytest.mark.parametrize("budget", [1, 3, 8, 24])
def test_racer_output_equals_plain_greedy(engine: Engine, reference: list[int], budget: int) -> None:
    drafter = RacerDrafter(RacerConfig(), LogitsTable(VOCAB))
    done = run(engine, PROMPT, [drafter], budget)
    assert done.token_ids == reference
    assert set(done.stats.drafted_by_source) <= {SOURCE_RETRIEVAL, SOURCE_LOGITS}
    if budget > 3:  # a short budget goes to the retrieval chain wherever the text's end occurred before
        assert done.stats.drafted_by_source.get(SOURCE_LOGITS, 0) > 0
    assert done.stats.accepted > 0  # the table holds the target's own top-k: some drafts land
    assert done.stats.drafted <= budget * done.stats.steps


def test_racer_with_the_budget_policy_and_small_windows(engine: Engine, reference: list[int]) -> None:
    for cfg in (RacerConfig(), RacerConfig(max_match=2, max_retrieval=3, topk=2)):
        done = run(engine, PROMPT, [RacerDrafter(cfg, LogitsTable(VOCAB, 4))], None)
        assert done.token_ids == reference


def test_racer_without_prompt_topk(tiny: TinyTarget, reference: list[int]) -> None:
    table = LogitsTable(VOCAB)
    done = run(Engine(tiny), PROMPT, [RacerDrafter(RacerConfig(), table)], 6)
    assert done.token_ids == reference
    assert table.rows_filled > 0  # learnt from verify top-k alone


class WrongFirst(BaseDrafter):
    """A drafter placed before RACER that proposes wrong tokens: RACER's nodes must still be verified."""

    name = "wrong"

    def propose(self, request: DraftRequest) -> DraftTree:
        return DraftTree.chain([(request.root + 1) % VOCAB, 0], self.name)


def test_racer_after_another_drafter(engine: Engine, reference: list[int]) -> None:
    done = run(engine, PROMPT, [WrongFirst(), RacerDrafter(RacerConfig(), LogitsTable(VOCAB))], 10)
    assert done.token_ids == reference


def test_cross_session_in_process_raises_acceptance(tiny: TinyTarget) -> None:
    engine = Engine(tiny)  # no prompt top-k: the logits table starts empty in every session
    tier = InProcessSharedTier(CrossSessionConfig())

    def session(tenant: str) -> DoneEvent:
        factory = RacerFactory(RacerConfig(), LogitsTable(VOCAB), tier, model_id=tiny.name)
        return run(engine, PROMPT, [factory.drafter(tenant)], 8)

    first = session("acme")
    second = session("acme")
    stranger = session("globex")
    assert first.token_ids == second.token_ids == stranger.token_ids
    assert second.stats.accepted_by_source.get(SOURCE_CROSS_SESSION, 0) > 0
    assert second.stats.acceptance_length > stranger.stats.acceptance_length
    assert stranger.stats.drafted_by_source.get(SOURCE_CROSS_SESSION, 0) == 0


class KillRedis(BaseDrafter):
    """Stops the Redis server after ``after`` verify steps (a drafter that only observes)."""

    name = "kill-redis"

    def __init__(self, server: RedisServer, after: int) -> None:
        self.server, self.after, self.steps = server, after, 0

    def observe(self, outcome: VerifyOutcome) -> None:
        self.steps += 1
        if self.steps == self.after:
            self.server.stop()


@pytest.mark.redis
def test_redis_tier_exact_and_killed_mid_generation(
    tiny: TinyTarget, reference: list[int], redis_server: RedisServer
) -> None:
    torch.set_num_threads(1)
    engine = Engine(tiny, config=EngineConfig(prompt_topk=8))
    tier = RedisSharedTier(CrossSessionConfig(redis_url=redis_server.url, retry_initial_s=0.05))
    try:
        factory = RacerFactory(RacerConfig(), LogitsTable(VOCAB), tier, model_id=tiny.name)
        first = run(engine, PROMPT, [factory.drafter("acme")], 8)
        assert first.token_ids == reference
        assert tier.drain()
        second = run(engine, PROMPT, [factory.drafter("acme")], 8)
        assert second.token_ids == reference
        assert second.stats.drafted_by_source.get(SOURCE_CROSS_SESSION, 0) > 0
        killed = run(engine, PROMPT, [KillRedis(redis_server, after=3), factory.drafter("acme")], 8)
        assert killed.token_ids == reference
        assert killed.finish_reason == "length"
        assert tier.drain()
        tier.cache(tiny.name, "", "acme").prefetch([[9, 9, 9]])
        assert tier.drain()
        assert tier.status()["available"] is False
        again = run(engine, PROMPT, [factory.drafter("acme")], 8)  # Redis still down: local tiers only
        assert again.token_ids == reference
    finally:
        tier.close()
