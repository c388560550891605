"""Streams pushed from the loop: emission writes a parked handler's events itself; a full
socket buffer hands the writing back to the handler, and the steps it missed merge."""

from __future__ import annotations

import anyio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.core.request import Request
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.engine.streams import RequestStream, SampleState
from asyncengine.entrypoints.http.responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
)
from asyncengine.entrypoints.http.serving import run_sse
from asyncengine.entrypoints.http.sse import PUSH_HIGH_WATER, event, text_template


class FakeDetokenizer:
    def __init__(self) -> None:
        self.chunks: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.chunks)


def make_stream() -> tuple[RequestStream, SampleState]:
    req = Request("r", [1, 2], SamplingParams(max_tokens=100))
    sample = SampleState(req, FakeDetokenizer())  # type: ignore[arg-type]
    stream = RequestStream("r", None, [1, 2], [sample], lambda rid: None, deltas_only=True)
    return stream, sample


def emit(stream: RequestStream, sample: SampleState, token: int, text: str,
         finish: str | None = None) -> None:
    """What the output processor does for one new token."""
    sample.request.output_token_ids.append(token)
    sample.num_emitted += 1
    sample.detokenizer.chunks.append(text)
    sample.finish_reason = finish
    stream.notify()


def test_emission_writes_for_a_parked_handler_and_merges_when_the_socket_is_full():
    stream, sample = make_stream()
    async def handler(request: web.Request) -> web.StreamResponse:
        def render(i, out):
            return f"{out.outputs[0].text}|".encode()

        response = await run_sse(request, [stream], render, on_end)
        return response

    async def on_end(sse):
        pass

    async def main():
        app = web.Application()
        app.router.add_get("/s", handler)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/s")
            await anyio.sleep(0.05)  # the handler is parked in the stream
            transport = resp.connection.transport if resp.connection else None
            assert stream._waiting and transport is not None
            emit(stream, sample, 5, "a")
            emit(stream, sample, 6, "b")
            # Pushed synchronously: already written, the handler never woke.
            assert stream._waiting and not stream._event.is_set()
            # A congested socket: the handler takes over; the two steps it gets merge.
            server_transport = stream._push.sse.transport
            real = server_transport.get_write_buffer_size
            server_transport.get_write_buffer_size = lambda: PUSH_HIGH_WATER + 1
            emit(stream, sample, 7, "c")
            emit(stream, sample, 8, "d")
            server_transport.get_write_buffer_size = real
            await anyio.sleep(0.05)
            emit(stream, sample, 9, "e", finish="length")
            body = await resp.read()
            return body.decode()

    body = anyio.run(main)
    assert body.startswith("a|b|cd|e|")
    assert body.endswith("data: [DONE]\n\n")


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_text_template_renders_the_same_bytes_as_the_full_event(text):
    """The fast path of a text-only step writes byte for byte what the full render writes."""
    completion = text_template(lambda t: Completion("cmpl-1", 7, "m", [CompletionChoice(0, t)]))
    assert completion(text) == event(Completion("cmpl-1", 7, "m", [CompletionChoice(0, text)]))
    chunk = text_template(lambda t: ChatCompletionChunk(
        "chat-1", 7, "m", [ChatChunkChoice(0, Delta(content=t))]))
    assert chunk(text) == event(ChatCompletionChunk(
        "chat-1", 7, "m", [ChatChunkChoice(0, Delta(content=text))]))


def test_text_only_steps_skip_the_full_render_but_not_the_first_or_last():
    stream, sample = make_stream()
    full: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        def render(i, out):
            c = out.outputs[0]
            full.append(c.delta_text)
            return f"[{c.delta_text}:{c.finish_reason}]".encode()

        return await run_sse(request, [stream], render, on_end,
                             render_text=lambda text: f"<{text}>".encode())

    async def on_end(sse):
        pass

    async def main():
        app = web.Application()
        app.router.add_get("/s", handler)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/s")
            await anyio.sleep(0.05)
            for i, piece in enumerate(["a", "", "b", "c"]):
                emit(stream, sample, 5 + i, piece)
            emit(stream, sample, 9, "d", finish="length")
            return (await resp.read()).decode()

    body = anyio.run(main)
    # The first output and the final one are rendered in full; the text-only steps between
    # them are templated, and a step with no new text writes nothing.
    assert body.startswith("[a:None]<b><c>[d:length]")
    assert full == ["a", "d"]
    assert sample.sent_tokens == 5 and sample.sent_chunks == 5
