"""SSE framing of both APIs when the generation fails after the stream began: an ``error`` event (or an
OpenAI-style error chunk) and then the proper end of the stream — driven by a planned answer's events on a real
scheduler job; and a stream's first bytes leave before it reads its answer's events (whose first read runs
retrieval and the prompt)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator

from sse_starlette import ServerSentEvent

from app.answering.events import AnswerEvent, Sources
from app.answering.pipeline import Plan, Question, answer_plan
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
    """What a planned answer touches on these paths: a real scheduler running an engine that fails after one token."""

    engine = FailingEngine()
    metrics = NoMetrics()

    def __init__(self, sched: GenerationScheduler) -> None:
        self.scheduler = sched


def a_plan() -> Plan:
    q = Question(question="Q?", document_ids=["d"], max_tokens=4, sampling=SamplingParams())
    source = Source(document_id="d", chunk_id="0", text="t", score=0.5, similarity=0.5, start=0, end=1)
    return Plan(
        tenant="t", question=q, prompt=Prompt([1], [2]), config=GenerationConfig(), drafters=(), sources=(source,),
        arrived=time.perf_counter(),
    )


def chunks() -> openai_route._Chunks:
    return openai_route._Chunks("target", "chatcmpl-1", 0, include_usage=False)


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
            answer = answer_plan(FailingServices(sched), a_plan())  # type: ignore[arg-type]
            return [encode(f) async for f in ask_route._stream(answer, "sid")]
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
            answer = answer_plan(FailingServices(sched), a_plan())  # type: ignore[arg-type]
            return [encode(f) async for f in openai_route._stream(answer, chunks())]
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


def test_first_bytes_leave_before_the_answer_is_read() -> None:
    """Both streams yield their first frame before reading their answer's events (the first read runs retrieval
    and the prompt: tests/app/test_answer_pipeline.py): a slow retrieval cannot hold back the first byte. An
    answer whose first event never comes shows it."""
    never = asyncio.Event()

    async def slow_answer() -> AsyncGenerator[AnswerEvent, None]:
        await never.wait()
        yield Sources(())  # never reached

    async def first(stream: AsyncIterator[ServerSentEvent]) -> str:
        try:
            return encode(await asyncio.wait_for(stream.__anext__(), timeout=30))
        finally:
            await stream.aclose()  # as when the client goes away: the answer is never read

    async def main() -> tuple[str, str]:
        ask_first = await first(ask_route._stream(slow_answer(), "sid"))
        chat_first = await first(openai_route._stream(slow_answer(), chunks()))
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
            answer = answer_plan(FailingServices(sched), a_plan())  # type: ignore[arg-type]
            frames = [encode(f) async for f in ask_route._stream(answer, "sid")]
            gate.set()
            assert [e async for e in holder.events()] == ["done"]
            return frames
        finally:
            sched.stop()

    events = parse(asyncio.run(main()))
    assert [e for e, _ in events] == [":", "sources", "error", "done"]
    assert json.loads(events[2][1])["code"] == "overloaded"


def test_a_generation_cancelled_before_it_ran_ends_both_streams_with_a_cancelled_error() -> None:
    """A generation still waiting when the service stops never runs: ``cancelled`` in band, then each stream's
    proper end."""

    async def frames_until_stopped(framed: AsyncIterator[ServerSentEvent], sched: GenerationScheduler) -> list[str]:
        frames = []
        async for f in framed:
            frames.append(encode(f))
            if f.event == "progress" or (f.event is None and f.comment and "queued" in f.comment):
                sched.stop()  # it waits behind the holder: the stop takes it off the queue
        return frames

    async def main(stream: str) -> list[str]:
        sched = GenerationScheduler(queue_size=1)
        gate, started = threading.Event(), threading.Event()

        def busy(cancel: threading.Event) -> Iterator[str]:
            started.set()
            while not gate.wait(0.01) and not cancel.is_set():
                pass
            yield "done"

        try:
            sched.submit(busy)
            assert started.wait(30)  # the engine is taken: the answer waits, next in line
            answer = answer_plan(FailingServices(sched), a_plan())  # type: ignore[arg-type]
            framed = ask_route._stream(answer, "sid") if stream == "ask" else openai_route._stream(answer, chunks())
            return await frames_until_stopped(framed, sched)
        finally:
            gate.set()
            sched.stop()

    ask_events = parse(asyncio.run(main("ask")))
    assert [e for e, _ in ask_events] == [":", "sources", "progress", "error", "done"]
    assert json.loads(ask_events[2][1]) == {"stage": "queued", "position": 1, "eta_s": None}
    assert json.loads(ask_events[3][1]) == {"code": "cancelled", "message": "the generation was cancelled"}
    assert json.loads(ask_events[4][1]) == {"session_id": "sid"}
    chat = parse(asyncio.run(main("chat")))
    assert [e for e, _ in chat] == [None, ":", None, None]  # the role chunk, the queued comment, the error, [DONE]
    assert json.loads(chat[1][1]) == {"stage": "queued", "position": 1, "eta_s": None}
    assert json.loads(chat[2][1]) == {"error": {"code": "cancelled", "message": "the generation was cancelled"}}
    assert chat[3][1] == "[DONE]"
