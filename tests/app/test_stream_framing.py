"""SSE framing of both APIs when the generation fails after the stream began: an ``error`` event (or an
OpenAI-style error chunk) and then the proper end of the stream — driven by a real scheduler job."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

from app.answering import Plan, Question
from app.routes import ask as ask_route
from app.routes import openai as openai_route
from app.scheduler import GenerationScheduler
from app.schemas import Source
from app.sse import frame
from decoding.generation import GenerationConfig, Prompt, SamplingParams, TokenEvent


def failing_job(cancel: threading.Event) -> Iterator[TokenEvent]:
    yield TokenEvent("Partial", [1])
    raise RuntimeError("the device went away")


class FakeTarget:
    name = "target"


class Services:  # only what the stream functions touch on the failure path
    target = FakeTarget()


def plan_with_failing_job(sched: GenerationScheduler) -> Plan:
    q = Question(question="Q?", document_ids=["d"], max_tokens=4, sampling=SamplingParams())
    source = Source(document_id="d", chunk_id="0", text="t", score=0.5, similarity=0.5, start=0, end=1)
    plan = Plan(
        tenant="t", question=q, prompt=Prompt([1], [2]), config=GenerationConfig(), drafters=[], sources=[source]
    )
    plan.handle = sched.submit(failing_job)
    return plan


def parse(frames: list[str]) -> list[tuple[str | None, str]]:
    out = []
    for raw in frames:
        event = None
        data = []
        for line in raw.strip("\n").split("\n"):
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                data.append(line[len("data: ") :])
        out.append((event, "\n".join(data)))
    return out


def test_ask_stream_reports_a_late_failure_in_band() -> None:
    async def main() -> list[str]:
        sched = GenerationScheduler(queue_size=1)
        try:
            plan = plan_with_failing_job(sched)
            return [f async for f in ask_route._stream(Services(), plan, "sid")]  # type: ignore[arg-type]
        finally:
            sched.stop()

    events = parse(asyncio.run(main()))
    assert [e for e, _ in events] == ["sources", "token", "error", "done"]
    assert json.loads(events[1][1]) == {"text": "Partial"}
    error = json.loads(events[2][1])
    assert error["code"] == "internal_error" and error["message"]
    assert json.loads(events[3][1]) == {"session_id": "sid"}


def test_chat_stream_reports_a_late_failure_then_done() -> None:
    async def main() -> list[str]:
        sched = GenerationScheduler(queue_size=1)
        try:
            plan = plan_with_failing_job(sched)
            stream = openai_route._stream(Services(), plan, "chatcmpl-1", 0)  # type: ignore[arg-type]
            return [f async for f in stream]
        finally:
            sched.stop()

    events = parse(asyncio.run(main()))
    datas = [d for _, d in events]
    assert json.loads(datas[0])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(datas[1])["choices"][0]["delta"]["content"] == "Partial"
    assert json.loads(datas[2])["error"]["code"] == "internal_error"
    assert datas[3] == "[DONE]" and len(datas) == 4


def test_frame_splits_multiline_data() -> None:
    assert frame("a\nb", "x") == "event: x\ndata: a\ndata: b\n\n"
    assert frame({"k": "é"}) == 'data: {"k":"é"}\n\n'
