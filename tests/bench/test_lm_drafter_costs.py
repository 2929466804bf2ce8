"""bench.decode's cost split of an LM drafter the target's own size (RAPID, rapid_kv): what one of its forwards
costs against a plain step, how often its tokens land, and the best that chains could give with those figures."""

from __future__ import annotations

import pytest

from bench.decode_measure import lm_drafter_costs, summarize_case
from bench.decode_methods import Run

VERIFY = {"2": 1.2, "4": 1.4, "8": 2.0, "16": 3.5, "32": 6.0, "64": 12.0}  # a verify vs a step


def _run(tokens: int, decode_s: float, **kw: object) -> Run:
    return Run(tokens=list(range(tokens + 1)), ttft_s=0.1, decode_s=decode_s, total_s=decode_s + 0.1,
               decode_tokens=tokens, forwards=tokens, acceptance_length=1.0, **kw)  # type: ignore[arg-type]


def _case(forward_s: float) -> dict[str, object]:
    """One prompt: plain decoding at 10 ms a token; rapid_kv: 10 forwards of ``forward_s``, 9 of 10 drafts landing."""
    runs = {
        "autoregressive": [_run(40, 0.4)],
        "rapid_kv": [_run(40, 0.5, drafted_by_source={"rapid_kv": 10}, accepted_by_source={"rapid_kv": 9},
                          draft_forwards=10, draft_s=10 * forward_s, draft_prefill_s=0.0)],
    }
    return {"methods": summarize_case(runs, list(range(41)))}


def test_a_drafter_forward_half_a_step_pays_in_two_token_chains() -> None:
    result = _case(0.005)
    drafter = result["methods"]["rapid_kv"]["drafter"]  # type: ignore[index]
    assert drafter == {"forwards": 10, "ms_per_forward": 5.0, "prefill_s": 0.0, "share_of_decode": 0.1}
    assert "drafter" not in result["methods"]["autoregressive"]  # type: ignore[index]
    split = lm_drafter_costs([result], ["autoregressive", "rapid_kv"], VERIFY)
    assert list(split) == ["rapid_kv"]
    row = split["rapid_kv"]
    assert row["target_step_ms"] == 10.0 and row["forward_vs_step"] == 0.5
    assert row["drafted_tokens"] == 10 and row["acceptance_per_drafted_token"] == 0.9
    assert row["speedup_vs_ar_measured"] == 0.8
    # g = 1: 1.9 / (1 + 0.5 + 0.1) = 1.19; g = 2: 2.71 / (1 + 1.0 + 0.2) = 1.23; g = 3: 3.44 / 2.8 = 1.23-
    assert row["chain_model"]["best_depth"] == 2
    assert row["chain_model"]["speedup_bound"] == pytest.approx(2.71 / 2.2, abs=1e-4)


def test_a_drafter_forward_as_dear_as_a_step_cannot_pay() -> None:
    row = lm_drafter_costs([_case(0.010)], ["autoregressive", "rapid_kv"], VERIFY)["rapid_kv"]
    assert row["forward_vs_step"] == 1.0
    assert row["chain_model"] == {"best_depth": 0, "speedup_bound": 1.0}  # 1.9 / 2.1 at best: plain decoding wins


def test_the_timed_forward_drives_a_second_chain_model() -> None:
    timed = {"forward_vs_step": 0.5}
    row = lm_drafter_costs([_case(0.010)], ["autoregressive", "rapid_kv"], VERIFY, timed)["rapid_kv"]
    assert row["chain_model"]["best_depth"] == 0  # the runs' forwards cost a step each
    assert row["chain_model_timed"]["best_depth"] == 2  # timed at half a step: as in the first test


def test_rapid_kv_forward_is_timed_against_a_plain_step_on_one_cache() -> None:
    """On the tiny quantized model: the drafter's one-token call and a plain step, on a cache of the prompt, which
    is left as it was (the drafter's row cut back)."""
    from decoding.runtime import kernels

    if kernels.load() is None:
        pytest.skip("CPU kernels unavailable: no quantized runtime")
    import torch

    from bench.decode_measure import lm_forward_vs_step
    from bench.decode_methods import Bench, Case
    from decoding.speculative.engine import Engine
    from decoding.speculative.generation import Prompt
    from tests.decoding.conftest import VOCAB, tiny_target

    target = tiny_target(0, quantized=True)
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    rows = [(0, 10), (100, 164), (280, 300)]
    case = Case("tiny", "", "", Prompt(prefix_ids=ids[:-3], suffix_ids=ids[-3:], prefix_key=None, draft_rows=rows))
    out = lm_forward_vs_step(Bench(target, Engine(target), 8), case, 3)  # type: ignore[arg-type]
    assert out is not None and out["context_tokens"] == 300 and out["visible_rows"] == 94
    assert out["step_ms"] > 0 and out["drafted_token_ms"] > 0
    assert out["forward_vs_step"] == pytest.approx(out["drafted_token_ms"] / out["step_ms"], rel=0.01)
    no_rows = Case("tiny", "", "", Prompt(prefix_ids=ids[:-3], suffix_ids=ids[-3:], prefix_key=None))
    assert lm_forward_vs_step(Bench(target, Engine(target), 8), no_rows, 3) is None  # type: ignore[arg-type]
