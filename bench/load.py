"""Bounded loopback load test: N concurrent streaming clients against one server.

Every client must either complete its stream (sources, tokens, stats, done; text equal to the answer the
same question gets alone, since decoding is greedy) or be refused at once: 429 + Retry-After, or, when the queue
filled after its stream began, an in-band ``overloaded`` error before any token. None may
hang (a per-client deadline) and no answer may be lost or cut. The result goes to a JSON file; the exit
code is non-zero when any client hung, failed or lost text.

    python -m bench.load --json bench/results/load.json            # starts its own server (bundled models)
    python -m bench.load --max-batch 1 --queue-size 8 ...          # the server as it was: one generation at a time
    python -m bench.load --url http://127.0.0.1:8000 --doc ID      # against a running server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import aconnect_sse

logger = logging.getLogger("bench.load")

DOCUMENT = (
    "The Eiffel Tower stands in Paris. It was completed in 1889 and is 330 metres tall.\n\n"
    "The Colosseum is an amphitheatre in Rome. Its construction began under the emperor Vespasian in 72 AD.\n\n"
    "The Great Wall of China is more than 21,000 kilometres long. Parts of it are over 2,000 years old.\n\n"
    "Big Ben is the nickname of the great bell of the clock at the Palace of Westminster in London."
)
QUESTIONS = (
    "When was the Eiffel Tower completed?",
    "Who began the construction of the Colosseum?",
    "How long is the Great Wall of China?",
    "What is Big Ben?",
)


@dataclass
class ClientResult:
    client: int
    question: str
    outcome: str = "pending"  # completed | refused | failed | hung | lost
    status: int | None = None
    retry_after: str | None = None
    events: list[str] = field(default_factory=list)
    tokens: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0
    detail: str = ""


async def one_client(
    http: httpx.AsyncClient, index: int, doc: str, max_tokens: int, reference: dict[str, str], deadline_s: float
) -> ClientResult:
    question = QUESTIONS[index % len(QUESTIONS)]
    result = ClientResult(client=index, question=question)
    body = {"question": question, "document_ids": [doc], "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    text: list[str] = []

    async def run() -> None:
        async with aconnect_sse(http, "POST", "/v1/ask", json=body) as source:
            result.status = source.response.status_code
            if result.status == 429:
                await source.response.aread()
                result.retry_after = source.response.headers.get("Retry-After")
                result.outcome = "refused" if result.retry_after else "failed"
                return
            if result.status != 200:
                await source.response.aread()
                result.outcome, result.detail = "failed", source.response.text[:300]
                return
            async for sse in source.aiter_sse():
                result.events.append(sse.event)
                if sse.event == "token":
                    if result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - t0
                    text.append(json.loads(sse.data)["text"])
                elif sse.event == "error":
                    result.detail = sse.data

    try:
        await asyncio.wait_for(run(), deadline_s)
    except TimeoutError:
        result.outcome = "hung"
    except httpx.HTTPError as exc:
        result.outcome, result.detail = "failed", f"{type(exc).__name__}: {exc}"
    result.total_s = time.perf_counter() - t0
    result.tokens = len(text)
    if result.outcome == "pending":
        shape_ok = result.events[:1] == ["sources"] and result.events[-2:] == ["stats", "done"]
        overloaded = result.detail and json.loads(result.detail).get("code") == "overloaded"
        if result.events == ["sources", "error", "done"] and overloaded:  # the queue filled after its stream began
            result.outcome = "refused"
        elif not shape_ok or "error" in result.events:
            result.outcome = "failed"
        elif "".join(text) != reference[question]:
            result.outcome, result.detail = "lost", f"got {''.join(text)!r}, alone {reference[question]!r}"
        else:
            result.outcome = "completed"
    return result


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def machine() -> dict[str, Any]:
    import torch

    from bench.common import cpu_model

    cpu = cpu_model()
    return {
        "cpu": cpu,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "cuda": torch.cuda.is_available(),
    }


async def run_load(url: str, doc: str | None, clients: int, max_tokens: int, deadline_s: float) -> dict[str, Any]:
    timeout = httpx.Timeout(deadline_s, connect=30.0)
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        if doc is None:
            response = await http.post("/v1/documents", json={"text": DOCUMENT, "title": "landmarks"})
            response.raise_for_status()
            doc = str(response.json()["id"])
            while (await http.get(f"/v1/documents/{doc}")).json()["status"] in ("queued", "indexing"):
                await asyncio.sleep(0.2)
        reference = {}
        for question in QUESTIONS:  # each question alone, one at a time: the expected text
            body = {"question": question, "document_ids": [doc], "max_tokens": max_tokens}
            response = await http.post("/v1/ask", json=body)
            response.raise_for_status()
            reference[question] = response.json()["answer"]
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(one_client(http, i, doc, max_tokens, reference, deadline_s) for i in range(clients))
        )
        wall = time.perf_counter() - t0
        metrics = (await http.get("/metrics")).text
    outcomes = {k: sum(r.outcome == k for r in results) for k in ("completed", "refused", "failed", "hung", "lost")}
    done = [r for r in results if r.outcome == "completed"]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    return {
        "clients": clients,
        "max_tokens": max_tokens,
        "wall_s": round(wall, 3),
        "outcomes": outcomes,
        "ok": outcomes["failed"] == outcomes["hung"] == outcomes["lost"] == 0,
        "ttft_s": {"p50": percentile(ttfts, 0.5), "p95": percentile(ttfts, 0.95), "max": max(ttfts, default=None)},
        "completion_s": {"median": statistics.median([r.total_s for r in done]) if done else None},
        "refused_retry_after_s": sorted({r.retry_after for r in results if r.retry_after}),
        "server_overloaded_total": _sample(metrics, "ragspec_overloaded_total"),
        "results": [asdict(r) for r in results],
    }


def _sample(metrics: str, name: str) -> float | None:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


@contextmanager
def local_server(data_dir: Path, overrides: dict[str, Any]) -> Iterator[str]:
    """The service with the bundled models on a free loopback port, in a thread of this process."""
    import uvicorn

    from app.main import create_app
    from app.settings import Settings
    from decoding.runtime.bundled import bundled_gguf_dir

    models_dir = Settings().models_dir  # type: ignore[call-arg]  # RAGSPEC_DATA_DIR or ./data
    settings = Settings(  # type: ignore[call-arg]
        data_dir=data_dir, target_model=str(bundled_gguf_dir(models_dir)), calibrate=False, **overrides
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server (default: start one with bundled models)")
    parser.add_argument("--doc", default=None, help="document id to ask over (default: upload a small one)")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--queue-size", type=int, default=None,
                        help="queue size of the server this script starts (default: the setting's default)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="generations at once on the server this script starts (default: the setting's default)")
    parser.add_argument("--deadline-s", type=float, default=900.0, help="a client still open after this hung")
    parser.add_argument("--json", type=Path, default=Path("bench/results/load.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    with ExitStack() as stack:
        url = args.url
        server_settings: dict[str, Any] | None = None
        if url is None:
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ragspec-load-")))
            overrides = {k: v for k, v in (("queue_size", args.queue_size), ("max_batch", args.max_batch))
                         if v is not None}
            url = stack.enter_context(local_server(data_dir, overrides))
            server_settings = {"target_model": "bundled SmolLM2-135M", "overrides": overrides}
        report = asyncio.run(run_load(url, args.doc, args.clients, args.max_tokens, args.deadline_s))
    report.update(
        machine=machine(), server=server_settings or {"url": url}, created=time.strftime("%Y-%m-%dT%H:%M:%S%z")
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    logger.info("outcomes %s in %.1f s -> %s", report["outcomes"], report["wall_s"], args.json)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
