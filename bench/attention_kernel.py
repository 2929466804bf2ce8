"""Attention kernel micro-benchmark: old vs new ``rs_attention`` interleaved in one run.

Shapes of SmolLM2-135M (9 query heads, 3 KV heads, head dim 64, fp16 KV cache), 30 layers' worth of
separate KV buffers per measurement (a forward's attention: the cache streams from memory as in a real
verify), a verify over ``rows`` draft rows in a chain (row i sees the prefix plus path rows 0..i).

    .venv/bin/python -m bench.attention_kernel [--old REV] [--repeats 15] [--threads 2,1] [--out ...json]

``--old`` (default HEAD) is a git revision whose ``decoding/kernels/cpu_kernels.c`` is compiled into /tmp as
the baseline; the working tree's source is the new one. Both libraries must agree bit for bit with
themselves over row counts (checked: row i's output in an n-row call equals its output alone).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's BLAS threads must not spin beside the kernel's
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
KDIR = ROOT / "decoding" / "kernels"
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]
H, G, D, LAYERS = 9, 3, 64, 30


def build(src_text: str, name: str, tmp: Path) -> ctypes.CDLL:
    src = tmp / f"{name}.c"
    src.write_text(src_text)
    so = tmp / f"lib{name}.so"
    subprocess.run(["cc", *FLAGS, f"-I{KDIR}", str(src), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    p, i, f, lg = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    lib.rs_attention.argtypes = [p, lg, lg, i, i, i, p, p, lg, lg, i, i, p, p, f, p, lg, lg, p, i, i]
    lib.rs_attention.restype = None
    return lib


class Case:
    def __init__(self, past: int, rows: int, rng: np.random.Generator, layers: int = LAYERS):
        self.past, self.rows = past, rows
        length = past + rows
        self.k = [rng.standard_normal((G, length, D)).astype(np.float16) for _ in range(layers)]
        self.v = [rng.standard_normal((G, length, D)).astype(np.float16) for _ in range(layers)]
        self.q = [rng.standard_normal((H, rows, D)).astype(np.float32) for _ in range(layers)]
        self.path = np.concatenate([np.arange(past, past + i + 1) for i in range(rows)]).astype(np.int32)
        self.off = np.concatenate([[0], np.cumsum(np.arange(1, rows + 1))]).astype(np.int32)
        self.out = np.empty((rows, H, D), np.float32)
        nb = (length + 63) // 64
        self.work = np.empty(H * rows * nb * (D + 2) + 1024, np.float32)

    def call(self, lib: ctypes.CDLL, layer: int, threads: int, q=None, rows=None, path=None, off=None, out=None):
        q = self.q[layer] if q is None else q
        rows = self.rows if rows is None else rows
        path = self.path if path is None else path
        off = self.off if off is None else off
        out = self.out if out is None else out
        k, v = self.k[layer], self.v[layer]
        lib.rs_attention(
            q.ctypes.data, q.strides[0] // 4, q.strides[1] // 4, H, rows, D,
            k.ctypes.data, v.ctypes.data, k.strides[0] // 2, k.strides[1] // 2, G,
            self.past, path.ctypes.data, off.ctypes.data, ctypes.c_float(D**-0.5),
            out.ctypes.data, out.strides[0] // 4, out.strides[1] // 4, self.work.ctypes.data, 1, threads,
        )  # fmt: skip

    def forward_ms(self, lib: ctypes.CDLL, threads: int) -> float:
        t = time.perf_counter()
        for layer in range(len(self.k)):
            self.call(lib, layer, threads)
        return (time.perf_counter() - t) * 1e3

    def check_invariance(self, lib: ctypes.CDLL, threads: int) -> bool:
        """Each row's output in the n-row call equals the same row computed in a 1-row call."""
        self.call(lib, 0, threads)
        full = self.out.copy()
        for i in range(self.rows):
            qi = np.ascontiguousarray(self.q[0][:, i : i + 1, :])
            pi = np.arange(self.past, self.past + i + 1).astype(np.int32)
            oi = np.array([0, i + 1], np.int32)
            out = np.empty((1, H, D), np.float32)
            self.call(lib, 0, threads, q=qi, rows=1, path=pi, off=oi, out=out)
            if not np.array_equal(out[0].view(np.uint32), full[i].view(np.uint32)):
                return False
        return True


def measure(libs, cases, pasts, rows_list, threads, repeats) -> list[dict]:
    times: dict[tuple[int, int, str], list[float]] = {(p, r, n): [] for p in pasts for r in rows_list for n in libs}
    for case in cases.values():  # warm up
        for lib in libs.values():
            case.forward_ms(lib, threads)
    for rep in range(repeats):
        for (p, r), case in cases.items():
            order = list(libs.items()) if rep % 2 == 0 else list(libs.items())[::-1]
            for name, lib in order:
                times[(p, r, name)].append(case.forward_ms(lib, threads))
    results = []
    for p in pasts:
        base = {n: statistics.median(times[(p, 1, n)]) for n in libs}
        for r in rows_list:
            row = {"threads": threads, "past": p, "rows": r}
            for n in libs:
                ts = sorted(times[(p, r, n)])
                med = statistics.median(ts)
                row[n] = {
                    "median_ms": round(med, 3),
                    "p25_ms": round(ts[len(ts) // 4], 3),
                    "p75_ms": round(ts[(3 * len(ts)) // 4], 3),
                    "min_ms": round(ts[0], 3),
                    "per_extra_row_ms": round((med - base[n]) / (r - 1), 3) if r > 1 else None,
                }
            row["new_over_old"] = round(row["new"]["median_ms"] / row["old"]["median_ms"], 3)
            ratios = sorted(a / b for a, b in zip(times[(p, r, "new")], times[(p, r, "old")], strict=True))
            row["paired_ratio_median"] = round(statistics.median(ratios), 3)
            row["paired_ratio_p25_p75"] = [round(ratios[len(ratios) // 4], 3), round(ratios[(3 * len(ratios)) // 4], 3)]
            results.append(row)
            print(
                f"threads {threads} past {p:5d} rows {r:2d}: old {row['old']['median_ms']:7.2f} ms "
                f"[{row['old']['p25_ms']:.2f}-{row['old']['p75_ms']:.2f}]  new {row['new']['median_ms']:7.2f} ms "
                f"[{row['new']['p25_ms']:.2f}-{row['new']['p75_ms']:.2f}]  new/old {row['new_over_old']:.3f} "
                f"(paired {row['paired_ratio_median']:.3f} {row['paired_ratio_p25_p75']})  per extra row "
                f"old {row['old']['per_extra_row_ms']} new {row['new']['per_extra_row_ms']}",
                flush=True,
            )
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="HEAD")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", default="2,1", help="thread counts, each measured (interleaved old / new)")
    ap.add_argument("--pasts", default="3500,7500")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--out", default=str(ROOT / "bench/results/attention_kernel.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="attn_bench_"))
    old_src = subprocess.run(
        ["git", "show", f"{args.old}:decoding/kernels/cpu_kernels.c"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    libs = {"old": build(old_src, "old", tmp), "new": build((KDIR / "cpu_kernels.c").read_text(), "new", tmp)}
    rng = np.random.default_rng(0)
    pasts = [int(x) for x in args.pasts.split(",")]
    rows_list = [int(x) for x in args.rows.split(",")]
    cases = {(p, r): Case(p, r, rng) for p in pasts for r in rows_list}
    threads_list = [int(x) for x in args.threads.split(",")]
    invariant = {}
    for name, lib in libs.items():
        invariant[name] = all(Case(p, 5, rng, layers=1).check_invariance(lib, th) for p in pasts for th in threads_list)
    # old vs new agree? (only informative: the new kernel may round differently)
    c = cases[(pasts[0], rows_list[-1])]
    c.call(libs["old"], 0, threads_list[0])
    o_old = c.out.copy()
    c.call(libs["new"], 0, threads_list[0])
    max_diff = float(np.abs(o_old - c.out).max())
    results = []
    for threads in threads_list:
        results += measure(libs, cases, pasts, rows_list, threads, args.repeats)
    doc = {
        "what": "30 layers' attention of SmolLM2-135M shapes (H=9, G=3, D=64, fp16 KV), one verify forward over "
        "`rows` chained draft rows; ms per forward's attention (30 rs_attention calls, separate KV per layer)",
        "old": args.old,
        "new": "working tree",
        "threads": threads_list,
        "repeats": args.repeats,
        "cpu": platform.processor() or platform.machine(),
        "row_invariant_bitwise": invariant,
        "max_abs_diff_old_vs_new": max_diff,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print("invariant:", invariant, "max |old-new|:", max_diff)


if __name__ == "__main__":
    main()
