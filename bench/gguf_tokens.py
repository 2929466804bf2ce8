"""GGUF tokenizers against llama.cpp: ``decoding.runtime.gguf.tokenizer``'s token ids against llama.cpp's own.

The test vocabularies and texts are ``tests/decoding/runtime/gguf_vocabs.py``'s (byte-level BPE under ``pre``
llama-bpe, qwen2, smollm, default and gpt-2 with the bundled SmolLM2 vocabulary; SentencePiece-style as Mistral, Gemma
and Phi-3 files have them); ``--gguf`` adds real files, tokenizing ``TEXTS``.

    python -m bench.gguf_tokens                     # ours against llama.cpp -> bench/results/gguf_tokens.json
    python -m bench.gguf_tokens --gguf a.gguf ...   # the same on real files too (llama.cpp's models/ggml-vocab-*.gguf)
    python -m bench.gguf_tokens --write-expected    # llama.cpp's ids -> tests/decoding/runtime/gguf_tokenizer_ids.json

llama.cpp is llama-cpp-python (the ``bench`` extra) with a library ``scripts/build-llama-cpp`` built
(``.venv/llama-builds/best``, or ``LLAMA_CPP_LIB_PATH``), run in a worker process (the library is bound at import).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.decoding.runtime.gguf_vocabs import EXPECTED, TEXTS, VOCABS, ours, texts_of, vocab_digest, write_vocab

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "bench" / "results" / "gguf_tokens.json"


# ---- llama.cpp ---------------------------------------------------------------------------------------------


def llama_cpp_lib() -> Path | None:
    """The directory of a llama.cpp build for llama-cpp-python (None where it, or the package, is missing):
    ``LLAMA_CPP_LIB_PATH``, else ``scripts/build-llama-cpp``'s ``best`` build in this checkout's venv or the venv
    this Python runs in."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    env = os.environ.get("LLAMA_CPP_LIB_PATH")
    candidates = [Path(env)] if env else []
    candidates += [REPO / ".venv" / "llama-builds" / "best", Path(sys.prefix) / "llama-builds" / "best"]
    return next((c for c in candidates if any(c.glob("libllama.so*"))), None)


def llama_cpp_ids(requests: dict[str, list[str]], lib: Path) -> dict[str, dict[str, Any]]:
    """llama.cpp's ids for {GGUF path: texts}: ``ids`` (BOS as the file says, special tokens parsed), ``plain``
    (no BOS, special tokens as text) and ``eog`` (every id ``llama_vocab_is_eog`` takes), run in a worker."""
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(lib)}
    done = subprocess.run([sys.executable, "-m", "bench.gguf_tokens", "--worker"], cwd=REPO, env=env,
                          input=json.dumps(requests), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the llama.cpp worker failed ({done.returncode}): {done.stderr.strip()[-1500:]}")
    out: dict[str, dict[str, Any]] = json.loads(done.stdout)
    return out


def _worker() -> None:
    import llama_cpp

    out = {}
    for path, texts in json.load(sys.stdin).items():
        llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        n = llama_cpp.llama_vocab_n_tokens(vocab)
        out[path] = {
            "ids": [llm.tokenize(t.encode(), add_bos=True, special=True) for t in texts],
            "plain": [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts],
            "eog": [i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)],
            "version": str(getattr(llama_cpp, "__version__", "?")),
        }
        del llm
    print(json.dumps(out))


def _write_expected(lib: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: write_vocab(name, Path(tmp)) for name in VOCABS}
        ref = llama_cpp_ids({str(p): texts_of(n) for n, p in paths.items()}, lib)
        data: dict[str, Any] = {
            "about": "token ids llama.cpp gives for the test vocabularies of gguf_vocabs.py; regenerate with "
                     "`python -m bench.gguf_tokens --write-expected` (needs the bench extra and a llama.cpp build)",
            "llama_cpp_python": ref[str(paths["qwen2"])]["version"],
            "vocabs": {},
        }
        for name, p in paths.items():
            r = ref[str(p)]
            data["vocabs"][name] = {
                "digest": vocab_digest(p),
                "eog": r["eog"],
                "cases": [{"text": t, "ids": i, "plain": q} for t, i, q in
                          zip(texts_of(name), r["ids"], r["plain"], strict=True)],
            }
    text = _compact_cases(data)
    EXPECTED.write_text(text)
    print(f"wrote {EXPECTED.relative_to(REPO)} ({len(text)} bytes)")


def _compact_cases(data: dict[str, Any]) -> str:
    """The expected-ids JSON with one line per case (a changed id shows as one changed line)."""
    out = ["{", f' "about": {json.dumps(data["about"])},',
           f' "llama_cpp_python": {json.dumps(data["llama_cpp_python"])},', ' "vocabs": {']
    names = list(data["vocabs"])
    for n, name in enumerate(names):
        v = data["vocabs"][name]
        out.append(f'  {json.dumps(name)}: {{"digest": {json.dumps(v["digest"])}, "eog": {json.dumps(v["eog"])}, '
                   '"cases": [')
        for c, case in enumerate(v["cases"]):
            comma = "," if c < len(v["cases"]) - 1 else ""
            out.append(f"   {json.dumps(case, ensure_ascii=False)}{comma}")
        out.append("  ]}" + ("," if n < len(names) - 1 else ""))
    out += [" }", "}", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", nargs="*", default=[], help="real GGUF files to compare too")
    parser.add_argument("--write-expected", action="store_true", help=f"write llama.cpp's ids to {EXPECTED.name}")
    parser.add_argument("--json", type=Path, default=RESULT)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker()
        return
    lib = llama_cpp_lib()
    if lib is None:
        raise SystemExit("llama.cpp is not available: install the bench extra and build it (make bench)")
    if args.write_expected:
        _write_expected(lib)
        return
    from bench.common import machine_info

    with tempfile.TemporaryDirectory() as tmp:
        files = {name: write_vocab(name, Path(tmp)) for name in VOCABS} | {Path(g).name: Path(g) for g in args.gguf}
        texts = {name: texts_of(name) if name in VOCABS else list(TEXTS) for name in files}
        ref = llama_cpp_ids({str(p): texts[n] for n, p in files.items()}, lib)
        report: dict[str, Any] = {"machine": machine_info(), "llama_cpp": str(lib), "vocabs": {}}
        failed = 0
        for name, path in files.items():
            got, want = ours(path, texts[name]), ref[str(path)]
            wrong = [{"text": t, "kind": kind, "ours": a, "llama_cpp": b}
                     for kind in ("ids", "plain") for t, a, b in zip(texts[name], got[kind], want[kind], strict=True)
                     if a != b]
            report["vocabs"][name] = {"texts": len(texts[name]), "different": wrong,
                                      "eog_equal": got["eog"] == want["eog"]}
            failed += len(wrong) + (got["eog"] != want["eog"])
            print(f"{name:32s} {len(texts[name]):3d} texts x 2: {len(wrong)} different, end-of-generation ids "
                  f"{'equal' if got['eog'] == want['eog'] else 'DIFFERENT'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    if failed:
        raise SystemExit(f"{failed} differences from llama.cpp")


if __name__ == "__main__":
    main()
