"""bench.llama_ref's worker protocol, end to end through a real worker process, with a stand-in ``llama_cpp``
package on the worker's path (the real one needs a built libllama, which make test does not build)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import llama_ref

STAND_IN = '''
import time
__version__ = "stand-in"
def llama_print_system_info():
    return b"CPU : STAND-IN"
class Llama:
    def __init__(self, model_path, **kw):
        self.n_tokens = 0
        self.kw = kw
    def eval(self, ids):
        if any(i < 0 for i in ids):
            raise ValueError("negative token id")
        self.n_tokens += len(ids)
    def generate(self, ids, **kw):
        self.n_tokens = len(ids)
        t = ids[-1]
        while True:
            t = (t * 7 + 3) % 50
            yield t
'''


@pytest.fixture()
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "site" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(STAND_IN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pkg.parent), str(llama_ref.REPO)]))
    lib = tmp_path / "build"
    lib.mkdir()
    (lib / "build-flags.txt").write_text("variant: test\ncmake -DX=ON\npatch: none\nGGML_X:BOOL=ON\n")
    return lib


def test_a_worker_generates_evaluates_and_reports_errors(stand_in: Path, tmp_path: Path) -> None:
    worker = llama_ref.LlamaWorker(stand_in, tmp_path / "model.gguf", 2, n_ctx=4096)
    try:
        assert worker.info["version"] == "stand-in" and worker.info["system_info"] == "CPU : STAND-IN"
        memory = worker.memory()
        assert set(memory) == {"rss_mb", "peak_mb"} and memory["peak_mb"] > 0
        assert worker.info["build_flags"] == ["variant: test", "cmake -DX=ON", "patch: none"]
        out = worker.generate([5, 9], 4, eos=[])
        assert out["tokens"] == [16, 15, 8, 9] and out["ttft_s"] >= 0 and out["decode_s"] >= 0
        assert worker.generate([5, 9], 10, eos=[8])["tokens"] == [16, 15]  # stops at an end token, not kept
        assert worker.eval([1, 2, 3]) >= 0 and worker.eval([4], keep=3) >= 0
        with pytest.raises(RuntimeError, match="negative token id"):
            worker.eval([-1])
        assert worker.eval([1]) >= 0  # the worker survives a failed request
    finally:
        worker.close()
    assert worker.proc.returncode == 0


def test_builds_that_are_not_there_are_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_ref, "BUILDS_DIR", tmp_path)
    assert llama_ref.open_workers(tmp_path / "model.gguf", 2, ["llama_cpp", "llama_cpp_avx2"]) == {}
    assert llama_ref.open_workers(None, 2, ["llama_cpp"]) == {}
