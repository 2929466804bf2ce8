"""Sizing the KV tiers from the device and the RAM, the calibration lengths by device, and the trigger that
queues a calibration at the cache lengths requests are served at."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import app.serving.kv_tuning as kv_tuning
from app.serving.kv_tuning import (
    available_ram_bytes,
    calibration_contexts,
    check_weights_fit,
    check_window_fits,
    fit_cpu_window,
    kv_budgets,
    schedule_recalibration,
    start_calibration,
)
from app.serving.scheduler import GenerationScheduler
from decoding.cache.memory import DEVICE_MARGIN_BYTES, device_kv_budget, kv_bytes_per_token
from decoding.errors import ModelLoadError
from decoding.runtime.loader import LoadedModel
from decoding.runtime.torch_runtime import TorchRuntime
from decoding.speculative.budget import BudgetPolicy
from decoding.speculative.calibration import calibrate
from decoding.speculative.engine import Engine
from tests.decoding.conftest import make_tiny_llama, tiny_target

GIB = 1 << 30


def loaded(device: str) -> LoadedModel:
    model = make_tiny_llama(cpu_kernels=False).to(torch.bfloat16)
    return LoadedModel(model=TorchRuntime(model), tokenizer=None, name="tiny", device=torch.device(device),
                       dtype=torch.bfloat16, eos_token_ids=(), max_context=4096, vocab_size=97)


def test_available_ram_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    8000000 kB\n")
    no_cgroup = tmp_path / "no-cgroup"
    assert available_ram_bytes(meminfo, no_cgroup) == 8_000_000 * 1024
    assert available_ram_bytes(tmp_path / "absent", no_cgroup) > 0  # elsewhere: the free pages


def test_available_ram_is_capped_by_the_containers_memory_limit(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:    8000000 kB\n")  # the host's: 7.6 GiB
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{4 * GIB}\n")
    (v2 / "memory.current").write_text(f"{3 * GIB}\n")
    assert available_ram_bytes(meminfo, v2) == 1 * GIB  # the limit leaves 1 GiB
    (v2 / "memory.max").write_text("max\n")
    assert available_ram_bytes(meminfo, v2) == 8_000_000 * 1024  # no limit: the host's figure
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{GIB // 2}\n")
    assert available_ram_bytes(meminfo, v1) == GIB + GIB // 2
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert available_ram_bytes(meminfo, v1) == 8_000_000 * 1024
    assert available_ram_bytes(meminfo, tmp_path / "no-cgroup") == 8_000_000 * 1024

def test_the_containers_reclaimable_page_cache_counts_as_available(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:    80000000 kB\n")  # the host's: 76 GiB
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{16 * GIB}\n")
    (v2 / "memory.current").write_text(f"{16 * GIB}\n")  # full: 15 GiB of it the weights' pages just read
    (v2 / "memory.stat").write_text(f"anon {GIB}\nfile {15 * GIB}\nactive_file {GIB}\ninactive_file {14 * GIB}\n")
    assert available_ram_bytes(meminfo, v2) == 14 * GIB  # the inactive page cache is dropped under pressure
    (v2 / "memory.stat").write_text("anon 1\n")
    assert available_ram_bytes(meminfo, v2) == 0  # without the figure: limit - usage, as before
    (v2 / "memory.stat").write_text(f"inactive_file {20 * GIB}\n")  # inconsistent counters: never above the limit
    assert available_ram_bytes(meminfo, v2) == 16 * GIB
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{8 * GIB}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{7 * GIB}\n")
    (v1 / "memory" / "memory.stat").write_text(f"inactive_file {GIB}\ntotal_inactive_file {3 * GIB}\n")
    assert available_ram_bytes(meminfo, v1) == 4 * GIB  # v1: the hierarchy's total_inactive_file


def llama_8b_on_cuda(window: int) -> LoadedModel:
    """Llama-3.1-8B's shapes (128 KiB of bf16 KV a token) on a CUDA device object: built on the meta device (no
    memory), only its config and dtype are read."""
    config = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return LoadedModel(model=TorchRuntime(model), tokenizer=None, name="llama-8b",
                       device=torch.device("cuda"), dtype=torch.bfloat16, eos_token_ids=(), max_context=window,
                       vocab_size=128256)


def test_a_window_that_does_not_fit_the_gpu_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    target = llama_8b_on_cuda(131072)  # one generation: 16 GiB of KV, plus the 2 GiB margin
    monkeypatch.setattr(kv_tuning, "free_device_bytes", lambda device: 7 * GIB)  # a 24 GB GPU after the weights
    with pytest.raises(ModelLoadError, match=r"RAGSPEC_MAX_CONTEXT=40960 \(the largest") as err:
        kv_budgets(target, "auto", "auto")
    assert "16.0 GiB of KV" in str(err.value) and "7.0 GiB is free" in str(err.value)
    assert "smaller model" in str(err.value) and "more memory" in str(err.value)
    with pytest.raises(ModelLoadError, match="RAGSPEC_MAX_CONTEXT=40960"):  # whatever the tiers' settings
        kv_budgets(target, GIB, 0)
    monkeypatch.setattr(kv_tuning, "free_device_bytes", lambda device: 18 * GIB - 1)  # one byte short
    with pytest.raises(ModelLoadError, match="RAGSPEC_MAX_CONTEXT=130048 "):
        check_window_fits(target)
    monkeypatch.setattr(kv_tuning, "free_device_bytes", lambda device: GIB)  # not even the margin
    with pytest.raises(ModelLoadError) as err:
        check_window_fits(target)
    assert "RAGSPEC_MAX_CONTEXT=" not in str(err.value) and "smaller model" in str(err.value)
    monkeypatch.setattr(kv_tuning, "free_device_bytes", lambda device: 18 * GIB)  # exactly enough
    monkeypatch.setattr(kv_tuning, "available_ram_bytes", lambda: 26 * GIB)
    assert check_window_fits(target) == 18 * GIB
    # device tier: 0.9 x (18 - 16 - 2) GiB = 0; host tier: 0.4 x (26 GiB - one 16 GiB entry) = 4 GiB
    assert kv_budgets(target, "auto", "auto") == (0, 4 * GIB)
    monkeypatch.setattr(kv_tuning, "available_ram_bytes", lambda: 10 * GIB)  # less than one entry: no host tier
    assert kv_budgets(target, "auto", "auto") == (0, 0)


def test_kv_budgets_on_a_cpu_are_two_gib_and_no_host_tier() -> None:
    target = loaded("cpu")
    assert kv_budgets(target, "auto", "auto") == (2 * GIB, 0)
    assert kv_budgets(target, 123, 456) == (123, 0)


def test_kv_budgets_on_cuda_follow_free_device_memory_and_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    target = loaded("cuda")  # a device object only: nothing runs on it
    monkeypatch.setattr(kv_tuning, "free_device_bytes", lambda device: 40 * GIB)
    monkeypatch.setattr(kv_tuning, "available_ram_bytes", lambda: 100 * GIB)
    per_token = kv_bytes_per_token(target.model.config, torch.bfloat16)
    device, host = kv_budgets(target, "auto", "auto")
    assert device == device_kv_budget(40 * GIB, per_token, 4096) and 0 < device < 40 * GIB
    # the tiny model's KV is 2 layers x 2 KV heads x 16 x 2 x 2 bytes = 256 bytes a token: 1 MiB at 4096 set aside
    assert host == int((100 * GIB - (1 << 20)) * 0.4)
    assert kv_budgets(target, GIB, 0) == (GIB, 0)


def test_a_cpu_window_is_capped_to_the_ram_or_refused_when_asked_for(caplog: pytest.LogCaptureFixture) -> None:
    """One generation's KV at the window, the 2 GiB prefix tier and the margin must fit the available RAM: the
    model's own window is capped to the largest that does (1024-token steps, one log line), a window asked for
    that does not fit stops the start naming the largest; one that fits is left alone."""
    target = loaded("cpu")  # 256 bytes of KV a token: 1 MiB at its 4096 positions
    per_token = target.model.kv_bytes_per_token()
    plenty = 2 * GIB + DEVICE_MARGIN_BYTES + per_token * 4096
    assert fit_cpu_window(target, explicit=True, available=plenty) is target
    short = plenty - per_token * 1500  # room for 2596 tokens: 2048 in whole granules
    with caplog.at_level("WARNING", logger="app.serving.kv_tuning"):
        capped = fit_cpu_window(target, explicit=False, available=short)
    assert capped.max_context == 2048 and capped.model is target.model
    assert "context window capped to 2048 tokens (the model's is 4096)" in caplog.text
    with pytest.raises(ModelLoadError, match="set RAGSPEC_MAX_CONTEXT=2048 or less"):
        fit_cpu_window(target, explicit=True, available=short)
    with pytest.raises(ModelLoadError, match=r"does not fit this machine's memory.*: use a smaller model"):
        fit_cpu_window(target, explicit=False, available=2 * GIB)
    assert fit_cpu_window(loaded("cuda"), explicit=True, available=0).max_context == 4096  # CUDA: checked elsewhere


def test_calibration_lengths_by_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert calibration_contexts(131072, cpu) == (256, 2048)  # start-up stays cheap on a CPU
    assert calibration_contexts(131072, cuda) == (256, 2048, 8192, 32768, 131072)
    assert calibration_contexts(32768, cuda) == (256, 2048, 8192, 32768)
    assert calibration_contexts(4096, cuda) == (256, 2048, 4096)
    assert calibration_contexts(2048, cuda) == (256, 2048)


def wait_calibrated(policy: BudgetPolicy, length: int) -> None:
    deadline = time.monotonic() + 120
    while length not in policy.calibrated_contexts():
        assert time.monotonic() < deadline, f"no calibration at {length} tokens"
        time.sleep(0.05)


def test_a_recalibration_is_queued_once_requests_run_beyond_the_calibrated_lengths() -> None:
    target = tiny_target(0, cpu_kernels=False)
    started = Engine(target, policy=BudgetPolicy(max_budget=4))
    engine = Engine(target, policy=BudgetPolicy(max_budget=4))
    scheduler = GenerationScheduler(queue_size=1)
    try:
        assert start_calibration(started, scheduler)  # on a CPU: 256 and 2048 as before, clamped to the window
        longest = target.max_context - 4 - 2
        wait_calibrated(started.policy, longest)
        assert started.policy.calibrated_contexts() == [256, longest]
        calibrate(engine, contexts=(16, 48), repeats=1)
        assert schedule_recalibration(engine, scheduler) is None  # nothing served yet
        engine.policy.observe_cost(0, 0.001, 72)
        assert schedule_recalibration(engine, scheduler) is None  # within reach of the calibrated lengths
        engine.policy.observe_cost(0, 0.001, 300)
        assert schedule_recalibration(engine, scheduler) == 300
        wait_calibrated(engine.policy, 300)
        assert engine.policy.cost_context == 300 and schedule_recalibration(engine, scheduler) is None
    finally:
        scheduler.stop()


def test_the_host_tier_bytes_are_a_gauge() -> None:
    from app.serving.metrics import LiveCollector

    live = {"queue_waiting": 0, "generations_running": 0, "kv_cache_bytes": 1, "kv_disk_bytes": 2,
            "kv_host_bytes": 3, "kv_cache_hits": 0, "kv_cache_misses": 0, "indexing_jobs": {}, "redis_up": None}
    gauges = {f.name: f.samples[0].value for f in LiveCollector(lambda: live).collect() if f.samples}
    assert gauges["ragspec_kv_host_bytes"] == 3 and gauges["ragspec_kv_cache_bytes"] == 1


def test_a_gguf_too_big_for_the_ram_is_refused_saying_what_it_needs(tmp_path: Path) -> None:
    model = tmp_path / "big.Q4_K_M.gguf"
    with model.open("wb") as f:
        f.truncate(3 << 30)  # sparse: no disk
    need = (int((3 << 30) * kv_tuning.WEIGHTS_GROWTH) + DEVICE_MARGIN_BYTES) / (1 << 30)  # served, and room to run
    want = rf"^big\.Q4_K_M\.gguf needs about {need:.1f} GiB of RAM to load \(its 3\.0 GiB of weights .* 2\.0 GiB "
    with pytest.raises(ModelLoadError, match=want):
        check_weights_fit(str(model), available=2 << 30)
    with pytest.raises(ModelLoadError, match=want):
        check_weights_fit(str(tmp_path), available=2 << 30)  # a directory holding one GGUF: that file
    check_weights_fit(str(model), available=8 << 30)  # fits
    check_weights_fit("bundled", available=1)  # not a GGUF path: the loader's to resolve
