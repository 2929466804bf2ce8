"""GPU check: what the engine's decoding step, verify passes and RAPID drafter steps cost on a long-context model
shape, and whether speculative decoding stays exact on the device. Made to run unattended, once, on a lent GPU.

Nothing is downloaded: models are ``LlamaConfig`` shapes (Llama-3.1-8B by default) with random weights, built
directly on the device in the working dtype (no full-precision host copy). Costs do not depend on the weights'
values, and a random KV cache costs what a real one does, so caches are filled with random rows instead of a
prefill (a 128K prefill would take the whole time budget). Everything runs through the engine's own code:
``Engine.verify`` for a plain step (an empty tree) and for chains and a branchy tree, ``DraftLM.feed`` for a
``rapid`` drafter token on its own cache, ``RapidKVDrafter.propose`` for a ``rapid_kv`` token (the target
attending to a subset of its cached rows through a mask). Every cost is also given as a ratio to the plain step
at the same context: what the budget policy weighs.

The correctness section runs first: a small fp32 random Llama on the device, speculative decoding through the
engine with random draft trees that hold the right tokens must equal autoregressive greedy (and a no-cache
recomputation); in bf16 the share of tokens on which they agree is reported.

Times are wall-clock around a synchronised device (host work of a step included, as the engine sees it);
medians over repeats after warm-ups. A time guard skips what would overrun the budget, noting it in the JSON; an
out-of-memory or other failure of one measurement is recorded and the rest goes on.

    python -m bench.gpu_check [--smoke] [--json PATH] [--budget-s 450] [--contexts 8192,32768]

``--smoke``: tiny shapes on whatever device there is (CPU in CI), the same code path, in seconds.
Exit status 1 when the correctness section failed or a measurement raised.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.common import REPO, machine_info, median, out, write_json
from bench.gpu_correctness import correctness
from bench.gpu_models import SHAPES, branchy_tree, build_model, fill_random, target_of
from decoding.cache.slot import SlotCache
from decoding.drafters.rapid import DraftLM, RapidKVDrafter
from decoding.runtime.torch_runtime import TorchRuntime
from decoding.speculative.drafter import DraftRequest, PromptInfo
from decoding.speculative.engine import Engine, EngineConfig
from decoding.speculative.metadata import SamplingMetadata
from decoding.speculative.tree import DraftTree


@dataclass(frozen=True)
class Plan:
    """What one run measures. ``drafters``: "same" (the target's weights) or a name in ``SHAPES``."""

    shape: str
    drafters: tuple[str, ...]
    contexts: tuple[int, ...]
    draft_rows: tuple[int, ...]  # rows of a rapid drafter's own cache
    kv_rows: int  # cached rows a rapid_kv step attends to
    repeats: int
    warmup: int
    nodes: tuple[int, ...] = (2, 4, 8, 16, 32, 64)  # verify chains
    tree: tuple[int, int] = (4, 8)  # the branchy tree: branches x depth below the root
    prompts: int = 6  # correctness: prompts, new tokens each, the model's shape
    new_tokens: int = 64
    correctness_shape: str = "tiny"


# 128K = the window less room for a 64-node verify (131072 - 128)
FULL = Plan("llama-3.1-8b", ("same", "llama-3.2-1b"), (8192, 32768, 130944), (1024, 4096), 4096, 20, 3)
SMOKE = Plan("smoke", ("same", "smoke-1layer"), (64, 256), (32, 128), 32, 3, 1, prompts=2, new_tokens=16,
             correctness_shape="smoke")
GREEDY = SamplingMetadata()  # a greedy verify that reports nothing beside its tokens


class Skip(Exception):  # noqa: N818  (not an error: a measurement left out)
    pass


class Run:
    """The time budget, the device, and what was skipped or failed."""

    def __init__(self, device: torch.device, plan: Plan, budget_s: float) -> None:
        self.device, self.plan, self.budget_s = device, plan, budget_s
        self.t0 = time.perf_counter()
        self.skipped: list[dict[str, str]] = []
        self.errors: list[dict[str, str]] = []

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def peak_gib(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)

    def guarded(self, label: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, or None with the reason recorded: out of time, out of memory, or an error."""
        if self.left() <= 0:
            self.skipped.append({"what": label, "why": "time budget spent"})
            return None
        try:
            return fn()
        except Skip as exc:
            self.skipped.append({"what": label, "why": str(exc)})
        except torch.cuda.OutOfMemoryError as exc:
            self.errors.append({"what": label, "error": "out of memory", "detail": str(exc)[:400]})
        except Exception as exc:  # one failed measurement must not end an unattended run
            self.errors.append({"what": label, "error": f"{type(exc).__name__}: {exc}"[:400],
                                "traceback": traceback.format_exc()[-2000:]})
        self.free()
        return None

    def timed(self, fn: Callable[[], object]) -> dict[str, Any]:
        """Median wall time of ``fn`` (synchronised) after warm-ups; skipped when the repeats would not fit."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.sync()
        t = time.perf_counter()
        for _ in range(self.plan.warmup):
            fn()
        self.sync()
        one = (time.perf_counter() - t) / max(1, self.plan.warmup)
        if one * self.plan.repeats > self.left():
            raise Skip(f"{self.plan.repeats} repeats of {one:.3f} s exceed the {self.left():.0f} s left")
        times = []
        for _ in range(self.plan.repeats):
            self.sync()
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        times.sort()
        return {"median_ms": round(median(times) * 1e3, 3), "p25_ms": round(times[len(times) // 4] * 1e3, 3),
                "p75_ms": round(times[3 * len(times) // 4] * 1e3, 3), "repeats": len(times),
                "peak_gib": self.peak_gib()}  # fmt: skip


def subset_rows(context: int, rows: int, chunks: int = 8) -> list[tuple[int, int]]:
    """``rows`` cached rows as ``chunks`` evenly spread ranges (retrieved chunks of a long document)."""
    size = max(1, min(rows, context) // chunks)
    starts = [round(i * (context - size) / max(1, chunks - 1)) for i in range(chunks)]
    return [(s, s + size) for s in starts]


def measure_context(run: Run, engine: Engine, context: int, rng: random.Random) -> dict[str, Any]:
    """A plain step, verify chains, the branchy tree and a rapid_kv token over a random ``context``-row cache."""
    plan, model = run.plan, engine.model
    vocab = model.vocab_size
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)  # the row's peak: weights + this cache
    t = time.perf_counter()
    cache = SlotCache(engine.num_layers, context + max(plan.nodes) + 2)
    fill_random(cache, model, context)
    run.sync()
    row: dict[str, Any] = {"context": context, "fill_s": round(time.perf_counter() - t, 3), "peak_gib": run.peak_gib()}
    root = rng.randrange(vocab)

    def verify(tree: DraftTree) -> Callable[[], dict[str, Any]]:
        def step() -> None:
            engine.verify(root, tree, cache, GREEDY)
            cache.truncate(context)

        return lambda: run.timed(step)

    with torch.inference_mode():
        row["plain"] = run.guarded(f"plain@{context}", verify(DraftTree()))
        trees = [(f"chain{n}", DraftTree.chain([rng.randrange(vocab) for _ in range(n)], "gpu_check"))
                 for n in plan.nodes]  # fmt: skip
        branches, depth = plan.tree
        trees.append((f"tree{branches}x{depth}", branchy_tree(branches, depth, vocab, rng)))
        row["verify"] = [{"tree": name, "nodes": len(tree), **(run.guarded(f"{name}@{context}", verify(tree)) or {})}
                         for name, tree in trees]  # fmt: skip
        rows = subset_rows(context, plan.kv_rows)
        drafter = RapidKVDrafter(model, threshold=0.0)
        drafter.begin(PromptInfo(prompt_ids=range(context), draft_rows=rows, target_cache=cache))
        request = DraftRequest(root=root, generated=[root], budget=1)
        row["rapid_kv"] = {"rows": sum(b - a for a, b in rows),
                           **(run.guarded(f"rapid_kv@{context}", lambda: run.timed(lambda: drafter.propose(request)))
                              or {})}  # fmt: skip
        if cache.length != context:
            raise RuntimeError(f"a measurement left {cache.length} rows in a {context}-row cache")
    plain = (row["plain"] or {}).get("median_ms")
    for entry in [*row["verify"], row["rapid_kv"]]:
        if plain and "median_ms" in entry:
            entry["ratio_to_plain"] = round(entry["median_ms"] / plain, 3)
    return row


def measure_rapid(run: Run, target: Any, drafter_shape: str, rng: random.Random) -> list[dict[str, Any]]:
    """One rapid drafter token (``DraftLM.feed``) on its own random cache of each ``plan.draft_rows`` size."""
    model = TorchRuntime(target if drafter_shape == "same" else build_model(drafter_shape, run.device, target.dtype))
    lm = DraftLM(model, run.device)
    token = rng.randrange(model.vocab_size)
    results = []
    for rows in run.plan.draft_rows:
        def one(rows: int = rows) -> dict[str, Any]:
            lm.start(rows + 16)
            fill_random(lm.cache, model, rows)

            def step() -> None:
                lm.feed([token])
                lm.truncate(rows)

            with torch.inference_mode():
                return run.timed(step)

        results.append({"drafter": drafter_shape, "rows": rows, **(run.guarded(f"rapid[{drafter_shape}]@{rows}", one)
                                                                   or {})})  # fmt: skip
    lm.start(16)  # the cache goes now; the model when this returns
    return results


# ---- the run ----------------------------------------------------------------------------------------------------


def summary(doc: dict[str, Any]) -> list[str]:
    lines = [f"device {doc['device']}  dtype {doc['dtype']}  shape {doc['shape']}  torch {doc['torch']}  "
             f"transformers {doc['transformers']}"]  # fmt: skip
    c = doc.get("correctness") or {}
    if c:
        lines.append(f"correctness: passed={c.get('passed')}  fp32 identical {c['float32']['identical']}/"
                     f"{c['prompts']}  bf16 agreement {c['bfloat16']['agreement_rate']}")  # fmt: skip
    for row in doc["contexts"]:
        plain = row.get("plain") or {}
        lines.append(f"context {row['context']:>6}: plain {plain.get('median_ms', '-')} ms  peak {row['peak_gib']} GiB")
        for e in [*row.get("verify", []), {"tree": f"rapid_kv({row.get('rapid_kv', {}).get('rows')} rows)",
                                           **row.get("rapid_kv", {})}]:  # fmt: skip
            lines.append(f"    {e['tree']:<22} {e.get('median_ms', '-'):>10} ms  x{e.get('ratio_to_plain', '-')}")
    for e in doc["rapid"]:
        ratios = {r["context"]: round(e["median_ms"] / r["plain"]["median_ms"], 3) for r in doc["contexts"]
                  if "median_ms" in e and (r.get("plain") or {}).get("median_ms")}  # fmt: skip
        lines.append(f"rapid[{e['drafter']}] on {e['rows']} rows: {e.get('median_ms', '-')} ms  "
                     f"x plain by context {ratios}")
    lines += [f"skipped: {s['what']} ({s['why']})" for s in doc["skipped"]]
    lines += [f"ERROR: {e['what']}: {e['error']}" for e in doc["errors"]]
    lines.append(f"passed={doc['passed']}  elapsed {doc['elapsed_s']} s of {doc['budget_s']} s")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, seconds, any device (CI)")
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "gpu_check.json")
    ap.add_argument("--budget-s", type=float, default=None, help="time budget (default 450; smoke 120)")
    ap.add_argument("--device", default="auto", help="auto: cuda when there is one")
    ap.add_argument("--contexts", default=None, help="comma-separated cache lengths (default: the plan's)")
    args = ap.parse_args(argv)
    plan = SMOKE if args.smoke else FULL
    contexts = tuple(int(c) for c in args.contexts.split(",")) if args.contexts else plan.contexts
    room = int(SHAPES[plan.shape]["max_position_embeddings"]) - max(plan.nodes) - 2  # a verify's rows fit the window
    plan = Plan(**{**asdict(plan), "contexts": tuple(min(c, room) for c in contexts)})
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type != "cuda" and not args.smoke and args.device == "auto":
        out("no CUDA device: the full check builds an 8B model (16 GB) and 16 GiB of KV; --smoke runs the same path "
            "on tiny shapes here, --device cpu forces the full one")
        return 2
    dtype = torch.bfloat16
    run = Run(device, plan, args.budget_s if args.budget_s is not None else (120.0 if args.smoke else 450.0))
    info = machine_info()
    doc: dict[str, Any] = {
        "what": "decode-step, verify and RAPID drafter-step costs on random caches (ms, medians) and speculative "
                "vs autoregressive exactness on the device; ratio_to_plain: cost / plain step at that context",
        "mode": "smoke" if args.smoke else "full", "device": torch.cuda.get_device_name(device) if device.type ==
        "cuda" else info["cpu"], "dtype": str(dtype).removeprefix("torch."), "torch": info["torch"],
        "transformers": info["transformers"], "machine": info, "shape": plan.shape, "config": SHAPES[plan.shape],
        "plan": asdict(plan), "budget_s": run.budget_s, "contexts": [], "rapid": [], "correctness": None,
    }  # fmt: skip

    def save() -> None:  # after every section: a run killed from outside still leaves what it measured
        doc.update(skipped=run.skipped, errors=run.errors, elapsed_s=round(time.perf_counter() - run.t0, 1))
        doc["passed"] = bool((doc["correctness"] or {}).get("passed")) and not run.errors
        write_json(args.json, doc)

    out(f"gpu_check ({doc['mode']}) on {doc['device']}, budget {run.budget_s:.0f} s")
    doc["correctness"] = run.guarded("correctness", partial(correctness, device, plan.prompts, plan.new_tokens,
                                                                plan.correctness_shape))
    save()
    out(f"correctness: {'passed' if (doc['correctness'] or {}).get('passed') else 'FAILED'} "
        f"({time.perf_counter() - run.t0:.1f} s)")  # fmt: skip
    rng = random.Random(1)
    t = time.perf_counter()
    target = run.guarded("build target", lambda: build_model(plan.shape, device, dtype))
    if target is not None:
        doc["build_s"] = round(time.perf_counter() - t, 2)
        engine = Engine(target_of(target, device, plan.shape), config=EngineConfig(max_budget=max(plan.nodes)))
        for context in plan.contexts:
            row = run.guarded(f"context {context}", partial(measure_context, run, engine, context, rng))
            doc["contexts"].append(row or {"context": context, "peak_gib": None, "plain": None})
            run.free()  # the context's cache is gone with measure_context's frame
            save()
            out(f"context {context} done ({time.perf_counter() - run.t0:.1f} s)")
        for shape in plan.drafters:
            rapid = run.guarded(f"rapid drafter {shape}", partial(measure_rapid, run, target, shape, rng))
            doc["rapid"] += rapid or []
            run.free()
            save()
    save()
    for line in summary(doc):
        out(line)
    out(f"wrote {args.json}")
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
