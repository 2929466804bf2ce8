"""bench.gpu_check on tiny shapes (the code path a GPU run takes, on whatever device is here): its JSON, its
correctness section, and its guards (time budget, out of memory, a failing measurement)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.gpu_check import SMOKE, Run, main
from tests.conftest import REPO


def test_smoke_run_writes_every_measurement(tmp_path: Path) -> None:
    path = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--smoke", "--json", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(path.read_text())
    assert doc["mode"] == "smoke" and doc["dtype"] == "bfloat16" and doc["torch"] == torch.__version__
    assert doc["passed"] and doc["errors"] == [] and doc["skipped"] == []
    c = doc["correctness"]
    assert c["passed"] and c["fp32_exact"] and c["float32"]["identical"] == SMOKE.prompts
    assert c["float32"]["accepted"] > 0 and 0.0 <= c["bfloat16"]["agreement_rate"] <= 1.0
    assert [row["context"] for row in doc["contexts"]] == list(SMOKE.contexts)
    for row in doc["contexts"]:
        assert row["plain"]["median_ms"] > 0 and row["plain"]["repeats"] == SMOKE.repeats
        assert [e["nodes"] for e in row["verify"]] == [*SMOKE.nodes, SMOKE.tree[0] * SMOKE.tree[1]]
        for e in [*row["verify"], row["rapid_kv"]]:
            assert e["median_ms"] > 0
            assert abs(e["ratio_to_plain"] - e["median_ms"] / row["plain"]["median_ms"]) < 0.01
        assert 0 < row["rapid_kv"]["rows"] <= min(SMOKE.kv_rows, row["context"])
    assert [(e["drafter"], e["rows"]) for e in doc["rapid"]] == [
        (d, r) for d in SMOKE.drafters for r in SMOKE.draft_rows
    ]
    assert all(e["median_ms"] > 0 for e in doc["rapid"])
    assert "passed=True" in proc.stdout and "chain64" in proc.stdout


def test_a_spent_budget_skips_the_rest_with_a_note(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    assert main(["--smoke", "--budget-s", "0", "--json", str(path)]) == 1  # nothing checked: not passed
    doc = json.loads(path.read_text())
    assert {s["what"] for s in doc["skipped"]} == {"correctness", "build target"}
    assert doc["errors"] == [] and doc["contexts"] == [] and not doc["passed"]


def test_repeats_that_would_overrun_are_skipped() -> None:
    run = Run(torch.device("cpu"), SMOKE, budget_s=0.2)
    assert run.guarded("slow", lambda: run.timed(lambda: time.sleep(0.1))) is None  # 1 warm-up, then 3 x 0.1 s
    assert run.skipped[0]["what"] == "slow" and "exceed" in run.skipped[0]["why"] and not run.errors


def test_out_of_memory_and_errors_are_recorded_and_the_run_goes_on() -> None:
    run = Run(torch.device("cpu"), SMOKE, budget_s=60)

    def oom() -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    assert run.guarded("big", oom) is None
    assert run.guarded("broken", lambda: 1 // 0) is None
    assert run.guarded("fine", lambda: 7) == 7
    assert [(e["what"], e["error"]) for e in run.errors] == [
        ("big", "out of memory"), ("broken", "ZeroDivisionError: integer division or modulo by zero")
    ]
    assert "ZeroDivisionError" in run.errors[1]["traceback"]


def test_the_full_check_refuses_a_machine_without_cuda(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("with CUDA the full check runs (minutes): scripts/gpu-check's job")
    assert main(["--json", str(tmp_path / "full.json")]) == 2
    assert not (tmp_path / "full.json").exists()


def test_the_full_shapes_are_the_real_models() -> None:
    """Built on the meta device (no memory): the parameter counts of Llama-3.1-8B and Llama-3.2-1B, in bf16,
    on the device asked for, switched to the engine's attention."""
    from bench.gpu_models import build_model

    for shape, params in [("llama-3.1-8b", 8_030_261_248), ("llama-3.2-1b", 1_235_814_400)]:
        model = build_model(shape, torch.device("meta"), torch.bfloat16)
        assert sum(p.numel() for p in model.parameters()) == params
        assert model.dtype == torch.bfloat16 and next(model.parameters()).device.type == "meta"
        assert model.config._attn_implementation == "ragspec_grouped_sdpa"
    assert torch.get_default_dtype() == torch.float32  # restored after building
