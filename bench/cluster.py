"""Cluster mode, 1 vs 2 engine replicas on this box: aggregate tokens/s and first-token times under load.

Each configuration is ``ragspec serve --cluster`` started as a user would (one command, a local Ray on loopback),
with a real PostgreSQL catalogue and Redis, the bundled model, and the same cores split among the replicas
(``--threads`` per replica: 1 replica x 2 threads against 2 replicas x 1 thread on a 2-core box). The run:
upload ``--docs`` documents, ask each once (its owner computes the document's KV: the cold first token), then
``--clients`` concurrent streaming clients each ask ``--asks`` questions over the documents. Every answer must
equal the one the same question got in the first configuration (greedy decoding: which replica answers, and how
many there are, changes no byte). Writes one JSON with both configurations side by side.

    python -m bench.cluster --json bench/results/cluster.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx

from bench.load import machine, percentile

REPO = Path(__file__).resolve().parent.parent
TOPICS = ("granite quarry", "tidal mill", "beekeeping guild", "glass furnace", "salt marsh", "rope walk")
QUESTIONS = ("How many crates did the tidal mill report?", "What did the salt marsh report on day 3?",
             "Which records mention the glass furnace?", "What did the rope walk report?")


def document(seed: int, words: int) -> str:
    lines = []
    for i in range(words // 12):
        topic = TOPICS[(i * 7 + seed) % len(TOPICS)]
        lines.append(f"Record {seed}-{i}: the {topic} reported {(i * 13 + seed) % 97} crates on day {i % 28 + 1}.")
    return " ".join(lines)


@contextmanager
def cluster(replicas: int, threads: int, database: str, redis_url: str, work: Path) -> Iterator[str]:
    """``ragspec serve --cluster`` with ``replicas`` engine replicas of ``threads`` threads; its URL."""
    from decoding.runtime.bundled import bundled_gguf_dir
    from tests.conftest import free_port

    port = free_port()
    ray_dir = Path(tempfile.mkdtemp(prefix="rs-ray-"))
    models = Path(os.environ.get("RAGSPEC_MODELS_DIR", REPO / "data" / "models"))
    env = {**os.environ, "RAGSPEC_DATA_DIR": str(work), "RAGSPEC_MODELS_DIR": str(models),
           "RAGSPEC_TARGET_MODEL": str(bundled_gguf_dir(models)), "RAGSPEC_DATABASE_URL": database,
           "RAGSPEC_REDIS_URL": redis_url, "RAGSPEC_CLUSTER_REPLICAS": str(replicas),
           "RAGSPEC_THREADS": str(threads), "RAGSPEC_CALIBRATE": "false", "RAGSPEC_RAY_TEMP_DIR": str(ray_dir),
           "RAY_USAGE_STATS_ENABLED": "0"}
    log = (work / "cluster.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli.main", "serve", "--cluster", "--port", str(port)], cwd=REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while b"serving on" not in (work / "cluster.log").read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not start; see {work / 'cluster.log'}")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        with suppress(ProcessLookupError):  # Ray's own processes, if the command could not stop them
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


async def ask(http: httpx.AsyncClient, question: str, doc: str, max_tokens: int) -> dict[str, Any]:
    body = {"question": question, "document_ids": [doc], "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    ttft, text, event, stats, error = None, [], None, {}, None
    async with http.stream("POST", "/v1/ask", json=body) as response:
        response.raise_for_status()
        replica = response.headers.get("x-ragspec-replica")
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "token":
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(json.loads(line[5:])["text"])
            elif line.startswith("data:") and event == "stats":
                stats = json.loads(line[5:])
            elif line.startswith("data:") and event == "error":
                error = line[5:].strip()
    return {"question": question, "doc": doc, "text": "".join(text), "ttft_s": ttft, "error": error,
            "total_s": time.perf_counter() - t0, "replica": replica, "cached": stats.get("prefix_cache_hit")}


def token_counter() -> Any:
    """Answer tokens counted with the target's tokenizer (SSE token events may carry several)."""
    from transformers import AutoTokenizer

    from decoding.runtime.bundled import bundled_gguf_dir

    models = Path(os.environ.get("RAGSPEC_MODELS_DIR", REPO / "data" / "models"))
    tokenizer = AutoTokenizer.from_pretrained(str(bundled_gguf_dir(models)), local_files_only=True)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


async def run(url: str, texts: list[str], clients: int, asks: int, max_tokens: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        docs = []
        for i, text in enumerate(texts):
            response = await http.post("/v1/documents", json={"text": text, "title": f"ledger {i}"})
            response.raise_for_status()
            docs.append(response.json()["id"])
        for doc in docs:
            while (await http.get(f"/v1/documents/{doc}")).json()["status"] in ("queued", "indexing"):
                await asyncio.sleep(0.3)
        cold = [await ask(http, QUESTIONS[0], doc, max_tokens) for doc in docs]  # each document's first question

        async def client(c: int) -> list[dict[str, Any]]:
            return [await ask(http, QUESTIONS[(c + k) % len(QUESTIONS)], docs[(c * 3 + k) % len(docs)], max_tokens)
                    for k in range(asks)]

        t0 = time.perf_counter()
        answers = [a for batch in await asyncio.gather(*(client(c) for c in range(clients))) for a in batch]
        wall = time.perf_counter() - t0
    ttfts = [a["ttft_s"] for a in answers if a["ttft_s"] is not None]
    doc_index = {doc: i for i, doc in enumerate(docs)}
    count = token_counter()
    tokens = sum(count(a["text"]) for a in answers)
    texts_by_key: dict[str, set[str]] = {}
    for a in cold + answers:
        texts_by_key.setdefault(f"{doc_index[a['doc']]}:{a['question']}", set()).add(a["text"])
    return {
        "cold_first_token_s": [round(a["ttft_s"], 3) for a in cold],
        "load": {
            "clients": clients, "asks_per_client": asks, "max_tokens": max_tokens, "wall_s": round(wall, 3),
            "tokens": tokens, "aggregate_tokens_per_s": round(tokens / wall, 2),
            "errors": sum(a["error"] is not None for a in answers),
            "prefix_cache_hits": sum(bool(a["cached"]) for a in answers),
            "ttft_s": {"p50": percentile(ttfts, 0.5), "p95": percentile(ttfts, 0.95)},
            "completion_s_median": statistics.median(a["total_s"] for a in answers),
            "requests_per_replica": dict(Counter(a["replica"] for a in answers)),
            "replicas_per_document": {i: len({a["replica"] for a in answers if a["doc"] == d})
                                      for d, i in doc_index.items()},
        },
        "answers": {key: sorted(texts) for key, texts in texts_by_key.items()},
    }


def answers_agree(one: dict[str, list[str]], two: dict[str, list[str]]) -> bool:
    """One text per question and document in each configuration, the same in both, for the same questions."""
    return bool(one) and one.keys() == two.keys() and all(len(v) == 1 and two[k] == v for k, v in one.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--words", type=int, default=1100, help="words a document")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--asks", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 2, help="split among the replicas")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from tests.conftest import running_postgres, running_redis

    texts = [document(seed, args.words) for seed in range(args.docs)]
    configs: dict[str, Any] = {}
    with ExitStack() as stack:
        pg = stack.enter_context(running_postgres())
        redis = stack.enter_context(running_redis(Path(tempfile.mkdtemp(prefix="rs-redis-"))))
        for replicas in (1, 2):
            threads = max(1, args.cores // replicas)
            database = pg.create_database(f"bench{replicas}")
            work = Path(tempfile.mkdtemp(prefix=f"rs-cluster{replicas}-"))
            with cluster(replicas, threads, database, redis.url, work) as url:
                result = asyncio.run(run(url, texts, args.clients, args.asks, args.max_tokens))
            configs[f"replicas_{replicas}"] = {"replicas": replicas, "threads_per_replica": threads, **result}
            print(json.dumps({k: v for k, v in configs[f"replicas_{replicas}"].items() if k != "answers"}), flush=True)
    one, two = configs["replicas_1"], configs["replicas_2"]
    out = {
        "bench": "cluster",
        "machine": machine(),
        "command": "python -m bench.cluster " + " ".join(argv if argv is not None else sys.argv[1:]),
        "documents": args.docs, "words_per_document": args.words,
        "configs": configs,
        "ratios": {
            "aggregate_2_vs_1": round(two["load"]["aggregate_tokens_per_s"] / one["load"]["aggregate_tokens_per_s"], 3),
            "ttft_p50_2_vs_1": round(two["load"]["ttft_s"]["p50"] / one["load"]["ttft_s"]["p50"], 3),
        },
        "answers_equal": answers_agree(one["answers"], two["answers"]),
    }
    print(json.dumps(out["ratios"]), "answers equal:", out["answers_equal"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if out["answers_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
