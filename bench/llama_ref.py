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
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BUILDS_DIR = REPO / ".venv" / "llama-builds"
BUILDS = {"llama_cpp": "best", "llama_cpp_avx2": "avx2"}  # method name -> build directory under BUILDS_DIR


class LlamaWorker:
    """A worker process running one llama.cpp build on one GGUF file (``n_ctx`` tokens of context, ``threads``
    threads; ``flash_attn``: llama.cpp's flash attention, which llama-cpp-python leaves off unless asked and
    llama.cpp's own tools turn on where it runs)."""

    def __init__(self, lib_dir: Path, gguf: Path, threads: int, n_ctx: int = 8192, flash_attn: bool = False) -> None:
        env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(lib_dir)}
        cmd = [sys.executable, "-m", "bench.llama_ref", "--gguf", str(gguf), "--threads", str(threads),
               "--ctx", str(n_ctx), *(["--flash-attn"] if flash_attn else [])]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info: dict[str, Any] = self._call({"op": "info"})
        self.info["lib_dir"] = str(lib_dir)
        self.info["build_flags"] = build_flags(lib_dir)

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

    def batch(self, prompts: list[list[int]], prefix_len: list[int], max_new: int) -> dict[str, Any]:
        """Greedy decoding of several sequences in one batch (``_Batches``), ``max_new`` tokens each (EOS does not
        stop a sequence: the batch stays whole): per sequence its tokens, ttft_s and end_s from the start, and wall_s.
        Each prompt's first ``prefix_len`` tokens (its document) are evaluated before the clock starts, once for the
        prompts that share them."""
        return self._call({"op": "batch", "prompts": prompts, "prefix_len": prefix_len, "max_new": max_new})

    def top(self, ids: list[int], k: int = 2) -> list[tuple[int, float]]:
        """The ``k`` largest logits (token id, logit) after ``ids``, most likely first (its KV of a shared prefix
        reused)."""
        return [(int(t), float(v)) for t, v in self._call({"op": "top", "ids": ids, "k": k})["top"]]

    def eval(self, ids: list[int], keep: int | None = 0) -> float:
        """Seconds to evaluate ``ids`` after the first ``keep`` cached tokens (None: after all of them)."""
        return float(self._call({"op": "eval", "ids": ids, "keep": keep})["seconds"])

    def memory(self) -> dict[str, float]:
        """The worker's resident memory now over what it held before loading the model (``rss_mb``), and its peak
        (``peak_mb``, VmHWM: the whole process)."""
        return {k: float(v) for k, v in self._call({"op": "rss"}).items()}

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def build_flags(lib_dir: Path) -> list[str] | None:
    """What ``scripts/build-llama-cpp`` recorded of a build (``build-flags.txt``): its header lines (the variant,
    what ``best`` resolved to and the CPU flags it read, the cmake command, the AMX patch), without the cmake
    cache's options that follow them. None where the build has no such file."""
    flags = lib_dir / "build-flags.txt"
    if not flags.is_file():
        return None
    return [line for line in flags.read_text().splitlines() if not re.match(r"^[A-Z0-9_]+:[A-Z]+=", line)]


def quantize(lib_dir: Path, src: Path, dst: Path, ftype: str, threads: int) -> None:
    """llama.cpp's own quantizer (``llama_model_quantize``, requantizing allowed) run by the build in ``lib_dir``, in a
    process of its own: ``src`` into ``dst`` as ``ftype`` (a ``llama_ftype`` name: ``LLAMA_FTYPE_MOSTLY_Q4_K_M``)."""
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(lib_dir)}
    cmd = [sys.executable, "-m", "bench.llama_ref", "--quantize", str(src), str(dst), "--ftype", ftype,
           "--threads", str(threads)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not dst.is_file():
        raise RuntimeError(f"llama.cpp could not quantize {src.name} to {ftype} (exit {done.returncode}): "
                           f"{done.stderr.strip()[-1500:]}")


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


def _rss_mb(key: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _serve(gguf: str, threads: int, n_ctx: int = 8192, flash_attn: bool = False) -> None:
    import llama_cpp
    from llama_cpp import Llama

    batches = _Batches(threads)

    before = _rss_mb()
    llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False,
                flash_attn=flash_attn)
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
            elif req["op"] == "rss":
                reply = {"rss_mb": round(_rss_mb() - before, 1), "peak_mb": round(_rss_mb("VmHWM"), 1)}
            elif req["op"] == "top":
                reply = {"top": _top(llm, req["ids"], req["k"])}
            elif req["op"] == "batch":
                reply = batches.run(llm, req["prompts"], req["prefix_len"], req["max_new"])
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


class _Batches:
    """llama.cpp's own batched decoding through its low-level API, as its server's parallel slots do: one sequence id
    per sequence; a prefix several sequences share evaluated once and given to the others with
    ``llama_memory_seq_cp`` (a unified KV cache, where that labels cells instead of copying them), otherwise one KV
    stream per sequence; every step one ``llama_decode`` with one token per sequence."""

    BATCH = 2048  # tokens one llama_decode takes (the questions of every sequence at once)

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.ctx: Any = None
        self.shape: tuple[int, int, bool] = (0, 0, False)

    def _context(self, llm: Any, sequences: int, tokens: int, unified: bool) -> Any:
        """A context for ``sequences`` sequences of up to ``tokens`` cells each: one KV stream per sequence (its
        server's slots: a sequence attends over its own stream), or one unified stream whose cells several
        sequences share (a document every user asks about: evaluated once, its cells labelled with each one's id)."""
        import llama_cpp as lc

        shape = (sequences, -(-tokens // 256) * 256, unified)
        if self.ctx is not None and self.shape == shape:
            return self.ctx
        if self.ctx is not None:
            lc.llama_free(self.ctx)
        params = lc.llama_context_default_params()
        params.n_ctx = shape[1] * (1 if unified else sequences)
        params.n_batch, params.n_ubatch, params.n_seq_max = self.BATCH, 512, sequences
        params.n_threads = params.n_threads_batch = self.threads
        params.kv_unified = unified
        self.ctx = lc.llama_init_from_model(llm.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp made no context of {tokens} tokens for {sequences} sequences")
        self.shape = shape
        return self.ctx

    def _decode(self, ctx: Any, rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) rows."""
        import llama_cpp as lc

        batch = lc.llama_batch_init(len(rows), 0, 1)
        try:
            for i, (tok, pos, seq, logits) in enumerate(rows):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, logits
                batch.seq_id[i][0] = seq
            batch.n_tokens = len(rows)
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
        finally:
            lc.llama_batch_free(batch)

    def _evaluate(self, ctx: Any, rows: list[tuple[int, int, int, bool]]) -> None:
        """Rows of any number, ``BATCH`` at a time (no logits read after)."""
        for i in range(0, len(rows), self.BATCH):
            self._decode(ctx, rows[i : i + self.BATCH])

    def run(self, llm: Any, prompts: list[list[int]], prefix_len: list[int], max_new: int) -> dict[str, Any]:
        import llama_cpp as lc
        import numpy as np

        n = len(prompts)
        owners: dict[tuple[int, ...], int] = {}  # a distinct prefix -> the sequence that evaluates it
        for s, (ids, k) in enumerate(zip(prompts, prefix_len, strict=True)):
            owners.setdefault(tuple(ids[:k]), s)
        shared = len(owners) < n
        tokens = max(len(ids) for ids in prompts) + max_new + 64
        if shared:  # the shared documents once, then every sequence's own rows, in one stream
            tokens = sum(len(p) for p in owners)
            tokens += sum(len(ids) - k + max_new for ids, k in zip(prompts, prefix_len, strict=True))
        ctx = self._context(llm, n, tokens + 64, shared)
        memory = lc.llama_get_memory(ctx)
        lc.llama_memory_clear(memory, True)
        for prefix, s in owners.items():  # the documents, before the clock (as warmed at upload)
            self._evaluate(ctx, [(tok, pos, s, False) for pos, tok in enumerate(prefix)])
        for s, (ids, k) in enumerate(zip(prompts, prefix_len, strict=True)):
            owner = owners[tuple(ids[:k])]
            if owner != s:  # a unified cache: the cells gain the sequence's id, nothing is copied
                lc.llama_memory_seq_cp(memory, owner, s, -1, -1)
        vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(llm.model))
        t0 = time.perf_counter()
        rows: list[tuple[int, int, int, bool]] = []
        for s, (ids, k) in enumerate(zip(prompts, prefix_len, strict=True)):
            rest = ids[k:]
            rows += [(tok, k + j, s, j == len(rest) - 1) for j, tok in enumerate(rest)]
        if len(rows) > self.BATCH:
            raise ValueError(f"the questions take {len(rows)} tokens, one batch {self.BATCH}")
        out: list[list[int]] = [[] for _ in range(n)]
        ttft, end = [0.0] * n, [0.0] * n
        pos = [len(ids) for ids in prompts]
        self._decode(ctx, rows)
        logits_row = [i for i, row in enumerate(rows) if row[3]]  # sequence s's logits: its row in the batch
        # every sequence decodes max_new tokens, EOS or not: its batches stay whole (a sequence leaving would split
        # llama.cpp's per-stream batches into several passes over the weights), and every token counts
        for step in range(max_new):
            now = time.perf_counter() - t0
            nxt = []
            for s in range(n):
                tok = int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, logits_row[s]),
                                                shape=(vocab,)).argmax())
                if step == 0:
                    ttft[s] = now
                end[s] = now
                out[s].append(tok)
                nxt.append((tok, pos[s], s, True))
                pos[s] += 1
            if step + 1 < max_new:
                self._decode(ctx, nxt)
                logits_row = list(range(n))
        wall = time.perf_counter() - t0
        lc.llama_memory_clear(memory, True)
        return {"tokens": out, "ttft_s": ttft, "end_s": end, "wall_s": wall}


def _top(llm: Any, ids: list[int], k: int) -> list[tuple[int, float]]:
    """The last row's ``k`` largest logits after ``ids``, evaluating only what its KV does not hold yet (at least
    the last token, whose logits are wanted)."""
    import numpy as np

    held = [int(t) for t in llm.input_ids[: llm.n_tokens]]
    keep = next((i for i, (a, b) in enumerate(zip(held, ids, strict=False)) if a != b), min(len(held), len(ids)))
    llm.n_tokens = min(keep, len(ids) - 1)
    llm.eval(ids[llm.n_tokens :])
    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    best = np.argsort(-logits, kind="stable")[:k]
    return [(int(i), float(logits[i])) for i in best]


def _quantize(src: str, dst: str, ftype: str, threads: int) -> int:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = getattr(llama_cpp, ftype)
    params.allow_requantize = True
    return int(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))


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
    parser.add_argument("--gguf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=8192, help="the context's tokens (n_ctx)")
    parser.add_argument("--flash-attn", action="store_true", help="llama.cpp's flash attention on")
    parser.add_argument("--quantize", nargs=2, metavar=("SRC", "DST"), help="quantize SRC into DST and exit")
    parser.add_argument("--ftype", default="LLAMA_FTYPE_MOSTLY_Q4_K_M", help="the llama_ftype --quantize writes")
    args = parser.parse_args()
    if args.quantize:
        src, dst = args.quantize
        sys.exit(_quantize(src, dst, args.ftype, args.threads))
    if not args.gguf:
        parser.error("--gguf is required")
    _serve(args.gguf, args.threads, args.ctx, args.flash_attn)
