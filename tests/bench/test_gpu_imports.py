"""The GPU checks must import on the lent device machine's image, which has torch and transformers but none of
the service's web / retrieval stack (fastapi, pydantic, faiss, redis...): a module of tests/gpu that pulls one in
stops the whole `pytest -m gpu` run at collection there, while here, where everything is installed, every test
under tests/gpu is merely skipped and the failure would go unseen. So the GPU test modules and the bench are
imported in a fresh interpreter that refuses those packages (/work/.library/device/KINDS.md lists the image's
packages; these are our dependencies missing from it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ABSENT_ON_DEVICE = (
    "fastapi", "fastapi_offline", "starlette", "pydantic", "pydantic_settings", "sse_starlette", "uvicorn",
    "multipart", "python_multipart", "redis", "cachetools", "faiss", "FlagEmbedding", "pypdf", "bs4", "gguf",
    "httpx_sse", "openai", "schemathesis", "fpdf",
)
CHECK = """
import importlib, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # what an absent package looks like: import raises, importlib.util.find_spec is None
for module in sys.argv[2:]:
    importlib.import_module(module)
print("ok")
"""


def gpu_modules() -> list[str]:
    modules = [f"tests.gpu.{p.stem}" for p in sorted((ROOT / "tests" / "gpu").glob("*.py")) if p.stem != "__init__"]
    return [*modules, "bench.gpu_check", "bench.gpu_models", "bench.gpu_correctness"]


def test_gpu_checks_import_without_the_service_stack() -> None:
    modules = gpu_modules()
    assert "tests.gpu.conftest" in modules and len(modules) >= 6
    done = subprocess.run([sys.executable, "-c", CHECK, ",".join(ABSENT_ON_DEVICE), *modules], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_refusal_catches_a_module_that_needs_the_service_stack() -> None:
    """The check itself: a module importing the settings (pydantic) is refused."""
    done = subprocess.run([sys.executable, "-c", CHECK, ",".join(ABSENT_ON_DEVICE), "app.settings"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr and "pydantic" in done.stderr
