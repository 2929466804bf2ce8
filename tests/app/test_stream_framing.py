"""SSE framing of both APIs when the generation fails after the stream began: an ``error`` event (or an
OpenAI-style error chunk) and then the proper end of the stream — driven by a real scheduler job; and a
stream's first bytes leave before its plan (retrieval, the prompt) is built."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator

from sse_starlette import ServerSentEvent

from app.answering.pipeline import Plan, Question
from app.api.routes import ask as ask_route
from app.api.routes import openai as openai_route
from app.api.sse import comment, encode, frame
from app.schemas import Source
from app.serving.scheduler import GenerationScheduler
from decoding.speculative.generation import GenerationConfig, Prompt, SamplingParams, TokenEvent


def failing_job(cancel: threading.Event) -> Iterator[TokenEvent]:
    yield TokenEvent("Partial", [1])
    raise RuntimeError("the device went away")


class FakeTarget:
    name = "target"


class Services:  # only what the stream functions touch on the failure path
    target = FakeTarget()


class FailingEngine:
    def kv_bytes(self, tokens: int) -> int:  # what admission counts: nothing here
        return 0

    def cache_rows(self, prompt_tokens: int, config: GenerationConfig) -> int:
        return prompt_tokens + config.max_new_tokens

    def generate(self, prompt: Prompt, config: GenerationConfig, drafters: object, cancel: threading.Event):  # type: ignore[no-untyped-def]
        return failing_job(cancel)


class NoCounter:
    def inc(self) -> None:
        pass


class NoMetrics:
    rejected = NoCounter()

    def observe_generation(self, *args: object) -> None:
        pass


class FailingServices(Services):
    """What ``answering.start`` touches: a real scheduler running an engine that fails after one token."""

    engine = FailingEngine()
    metrics = NoMetrics()

    def __init__(self, sched: GenerationScheduler) -> None:
        self.scheduler = sched


def a_plan() -> Plan:
    q = Question(question="Q?", document_ids=["d"], max_tokens=4, sampling=SamplingParams())
    source = Source(document_id="d", chunk_id="0", text="t", score=0.5, similarity=0.5, start=0, end=1)
    return Plan(
        tenant="t", question=q, prompt=Prompt([1], [2]), config=GenerationConfig(), drafters=[], sources=[source]
    )


async def prepare() -> Plan:
    return a_plan()


def parse(frames: list[str]) -> list[tuple[str | None, str]]:
    """(event, data) of each frame; a comment frame is (":", its text)."""
    out = []
    for raw in frames:
        event = None
        data = []
        for line in raw.strip("\n").split("\n"):
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                data.append(line[len("data: ") :])
            elif line.startswith(": "):
                event = ":"
                data.append(line[len(": ") :])
        out.append((event, "\n".join(data)))
    return out


def test_ask_stream_reports_a_late_failure_in_band() -> None:
    async def main() -> list[str]:
        sched = GenerationScheduler(queue_size=1)
        try:
            stream = ask_route._stream(FailingServices(sched), prepare, "sid")  # type: ignore[arg-type]
            return [encode(f) async for f in stream]
        finally:
            sched.stop()

    events = parse(asyncio.run(main()))
    assert [e for e, _ in events] == [":", "sources", "token", "error", "done"]
    assert json.loads(events[2][1]) == {"text": "Partial"}
    error = json.loads(events[3][1])
    assert error["code"] == "internal_error" and error["message"]
    assert json.loads(events[4][1]) == {"session_id": "sid"}


def test_chat_stream_reports_a_late_failure_then_done() -> None:
    async def main() -> list[str]:
        sched = GenerationScheduler(queue_size=1)
        try:
            stream = openai_route._stream(FailingServices(sched), prepare, "chatcmpl-1", 0)  # type: ignore[arg-type]
            return [encode(f) async for f in stream]
        finally:
            sched.stop()

    events = parse(asyncio.run(main()))
    datas = [d for _, d in events]
    assert json.loads(datas[0])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(datas[1])["choices"][0]["delta"]["content"] == "Partial"
    assert json.loads(datas[2])["error"]["code"] == "internal_error"
    assert datas[3] == "[DONE]" and len(datas) == 4


def test_frame_splits_multiline_data() -> None:
    assert encode(frame("a\nb", "x")) == "event: x\ndata: a\ndata: b\n\n"
    assert encode(frame({"k": "é"})) == 'data: {"k":"é"}\n\n'
    assert encode(comment("ping")) == ": ping\n\n"


def test_first_bytes_leave_before_the_plan_is_built() -> None:
    """Both streams yield their first frame before awaiting ``prepare`` (retrieval, the prompt): a slow
    retrieval cannot hold back the first byte. A prepare that never finishes shows it."""
    never = asyncio.Event()

    async def slow_prepare() -> Plan:
        await never.wait()
        raise AssertionError("unreachable")

    async def first(stream: AsyncIterator[ServerSentEvent]) -> str:
        try:
            return encode(await asyncio.wait_for(stream.__anext__(), timeout=30))
        finally:
            await stream.aclose()  # as when the client goes away: the pending prepare is dropped

    async def main() -> tuple[str, str]:
        services = FailingServices(None)  # type: ignore[arg-type]
        ask_first = await first(ask_route._stream(services, slow_prepare, "sid"))  # type: ignore[arg-type]
        chat_first = await first(openai_route._stream(services, slow_prepare, "c", 0))  # type: ignore[arg-type]
        return ask_first, chat_first

    ask_first, chat_first = asyncio.run(main())
    assert ask_first == ": accepted\n\n"
    assert json.loads(parse([chat_first])[0][1])["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_a_queue_that_filled_after_the_stream_began_is_an_overloaded_error_in_band() -> None:
    """The queue is checked before the response starts, but it can fill during retrieval: the stream then
    ends with an ``overloaded`` error (and ``done``) instead of a 5xx or a cut connection."""

    async def main() -> list[str]:
        sched = GenerationScheduler(queue_size=0)
        gate = threading.Event()

        def busy(cancel: threading.Event) -> Iterator[str]:
            while not gate.wait(0.01) and not cancel.is_set():
                pass
            yield "done"

        try:
            holder = sched.submit(busy)  # the engine is taken and nothing may wait
            stream = ask_route._stream(FailingServices(sched), prepare, "sid")  # type: ignore[arg-type]
            frames = [encode(f) async for f in stream]
            gate.set()
            assert [e async for e in holder.events()] == ["done"]
            return frames
        finally:
            sched.stop()

    events = parse(asyncio.run(main()))
    assert [e for e, _ in events] == [":", "sources", "error", "done"]
    assert json.loads(events[2][1])["code"] == "overloaded"
