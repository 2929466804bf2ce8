"""llama.cpp as bench.decode's reference, one build per worker process.

llama-cpp-python binds one ``libllama`` per process (``LLAMA_CPP_LIB_PATH``, read at import), and the benchmark
compares two builds in one run: ``llama_cpp`` (the fastest build that runs correctly here) and ``llama_cpp_avx2``
(the portable AVX2 build). So each build runs in a worker process of its own (``python -m bench.llama_ref``)
that holds the model and answers JSON lines on stdin / stdout; the timing happens in the worker, around the
llama.cpp calls alone. ``scripts/build-llama-cpp`` builds the libraries (``make bench`` does it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BUILDS_DIR = REPO / ".venv" / "llama-builds"
BUILDS = {"llama_cpp": "best", "llama_cpp_avx2": "avx2"}  # method name -> build directory under BUILDS_DIR


class LlamaWorker:
    """A worker process running one llama.cpp build on one GGUF file (full window, ``threads`` threads)."""

    def __init__(self, lib_dir: Path, gguf: Path, threads: int) -> None:
        env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(lib_dir)}
        cmd = [sys.executable, "-m", "bench.llama_ref", "--gguf", str(gguf), "--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info: dict[str, Any] = self._call({"op": "info"})
        self.info["lib_dir"] = str(lib_dir)
        flags = lib_dir / "build-flags.txt"  # variant, cmake command, patch; then the whole cmake cache
        self.info["build_flags"] = flags.read_text().splitlines()[:3] if flags.is_file() else None

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker ({self.info.get('lib_dir', '?')}) exited: {self.proc.wait()}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"llama.cpp worker: {reply['error']}")
        return reply

    def generate(self, ids: list[int], max_new: int, eos: list[int]) -> dict[str, Any]:
        """Greedy decoding: tokens (eos excluded), ttft_s, decode_s, total_s (its KV of a shared prefix reused)."""
        return self._call({"op": "generate", "ids": ids, "max_new": max_new, "eos": eos})

    def eval(self, ids: list[int], keep: int | None = 0) -> float:
        """Seconds to evaluate ``ids`` after the first ``keep`` cached tokens (None: after all of them)."""
        return float(self._call({"op": "eval", "ids": ids, "keep": keep})["seconds"])

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def open_workers(gguf: Path | None, threads: int, names: list[str]) -> dict[str, LlamaWorker]:
    """A worker per requested build that is built (``scripts/build-llama-cpp``); the others are left out."""
    workers: dict[str, LlamaWorker] = {}
    if gguf is None:
        return workers
    for name in names:
        lib_dir = BUILDS_DIR / BUILDS[name]
        if any(lib_dir.glob("libllama.so*")):
            workers[name] = LlamaWorker(lib_dir, gguf, threads)
    return workers


# ---- the worker ---------------------------------------------------------------------------------------


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _serve(gguf: str, threads: int) -> None:
    import llama_cpp
    from llama_cpp import Llama

    before = _rss_mb()
    llm = Llama(model_path=gguf, n_ctx=8192, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "info":
                system = llama_cpp.llama_print_system_info()
                reply: dict[str, Any] = {
                    "version": str(getattr(llama_cpp, "__version__", "?")),
                    "system_info": system.decode() if isinstance(system, bytes) else str(system),
                    "rss_mb": round(_rss_mb() - before, 1),
                }
            elif req["op"] == "eval":
                if req["keep"] is not None:
                    llm.n_tokens = req["keep"]  # eval drops the KV beyond n_tokens first
                t = time.perf_counter()
                llm.eval(req["ids"])
                reply = {"seconds": time.perf_counter() - t}
            else:
                reply = _generate(llm, req["ids"], req["max_new"], set(req["eos"]))
        except Exception as exc:  # reported to the benchmark, which stops with it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


def _generate(llm: Any, ids: list[int], max_new: int, eos: set[int]) -> dict[str, Any]:
    tokens: list[int] = []
    t0 = time.perf_counter()
    first = end = t0
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        end = time.perf_counter()
        if not tokens:
            first = end
        if tok in eos:
            break
        tokens.append(int(tok))
        if len(tokens) >= max_new:
            break
    return {"tokens": tokens, "ttft_s": first - t0, "decode_s": end - first, "total_s": end - t0}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    _serve(args.gguf, args.threads)
