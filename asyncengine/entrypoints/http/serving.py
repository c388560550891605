"""What both generation endpoints do: read the body, check the model, start the engine
requests, and consume their streams until they finish or the client goes away.

Invariant: every engine request a handler starts is closed by ``consume`` (or by
``open_streams`` when a later one fails) however the handler ends — normally, by an error,
by a failed write to a client that left, or by cancellation (aiohttp cancels the handler of
a disconnected client). Closing an unfinished stream aborts the request and frees its blocks.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import msgspec
from aiohttp import web

from asyncengine.core.limits import MAX_JSON_DEPTH
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.engine.engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloaded,
    EngineShuttingDown,
    RequestFailed,
)
from asyncengine.engine.outputs import RequestOutput
from asyncengine.engine.streams import RequestStream
from asyncengine.entrypoints.http import tolerant
from asyncengine.entrypoints.http.errors import (
    OVERLOADED_RETRY_AFTER_S,
    APIError,
    bad_request,
    from_decode_error,
    from_value_error,
)
from asyncengine.entrypoints.http.params import KNOWN_PARAMS
from asyncengine.entrypoints.http.protocol import Body, unsupported
from asyncengine.entrypoints.http.sse import ClientGone, SSEStream, encode_json
from asyncengine.entrypoints.http.state import STATE, served_model_names
from asyncengine.entrypoints.http.tenancy import current_tenant
from asyncengine.entrypoints.http.trace_context import current_trace_headers
from asyncengine.executor.lora.manager import LoRANotFound

B = TypeVar("B", bound=Body)

logger = logging.getLogger("asyncengine.entrypoints.http")
#: --enable-log-requests sets this logger to INFO.
request_logger = logging.getLogger("asyncengine.requests")

REQUEST_ID_HEADER = "X-Request-Id"

SHUTDOWN_ABORT = "The request was aborted: the server is shutting down."


def aborted(engine: AsyncEngine) -> APIError:
    """The error of a request its engine aborted: the server shuts down, or (router mode)
    the engine's model was unloaded or put to sleep (``engine.aborts.reason`` says)."""
    reason = getattr(getattr(engine, "aborts", None), "reason", None)
    return APIError(503, reason or SHUTDOWN_ABORT, code="model_unloaded" if reason else None)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode_json(obj), content_type="application/json")


async def read_body(request: web.Request, type_: type[B],
                    allow: frozenset[str] = frozenset()) -> B:
    """Decode and validate a JSON body (413 past --max-request-body, 400 when invalid: not
    JSON, not UTF-8, nested too deeply for the decoder, or not the shape of ``type_``).
    Unknown fields are ignored (and logged once per name); options the server knows but
    cannot honour are a 400 naming them."""
    return decode_body(await request.read(), type_, allow)


def decode_body(data: bytes, type_: type[B], allow: frozenset[str] = frozenset()) -> B:
    """``read_body`` of bytes already read (a batch line's body)."""
    try:
        body = tolerant.decode(data, type_)
    except msgspec.DecodeError as e:
        raise from_decode_error(e) from None
    except UnicodeDecodeError as e:
        raise bad_request(f"The request body is not valid UTF-8: {e.reason} at byte "
                          f"{e.start}.") from None
    except RecursionError:
        raise bad_request("The request body nests arrays and objects too deeply (JSON "
                          f"schemas may nest {MAX_JSON_DEPTH} levels).") from None
    refused = unsupported(body, allow)
    if refused is not None:
        raise bad_request(refused[1], refused[0])
    if getattr(body, "stream_options", None) is not None and not getattr(body, "stream", None):
        raise bad_request("Stream options can only be defined when `stream=True`.",
                          "stream_options")
    return body


def check_model(engine: AsyncEngine, name: str | None, *, lora: bool = True) -> str | None:
    """404 ``model_not_found`` unless ``name`` is a served model name or (``lora``) a LoRA
    adapter's; returns the adapter's name for an adapter, else None (the base model)."""
    names = served_model_names(engine)
    if name is None or name in names:
        return None
    adapters = lora_names(engine)
    if name in adapters:
        if not lora:
            raise APIError(400, f"The model `{name}` is a LoRA adapter: this endpoint serves "
                                "the base model only.", param="model")
        return name
    raise APIError(404, f"The model `{name}` does not exist (this server serves "
                        f"{', '.join(f'`{n}`' for n in [*names, *adapters])}).", param="model",
                   code="model_not_found")


def lora_names(engine: AsyncEngine) -> list[str]:
    """The LoRA adapters served (--enable-lora), by name."""
    names = getattr(engine, "lora_names", None)
    return names() if names is not None else []


def request_id(request: web.Request, prefix: str) -> str:
    """``prefix-<X-Request-Id>`` when the client sent one (it is echoed back), else random."""
    given = request.headers.get(REQUEST_ID_HEADER)
    return f"{prefix}-{given}" if given else random_id(prefix)


def to_api_error(error: Exception) -> APIError:
    """An engine error (from ``add_request`` or while streaming) in OpenAI's shape."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineShuttingDown):
        return APIError(503, "The server is shutting down.")
    if isinstance(error, EngineOverloaded):
        return APIError(503, f"The server is overloaded: {error}", code="overloaded",
                        retry_after=OVERLOADED_RETRY_AFTER_S)
    if isinstance(error, EngineDeadError):
        return APIError(500, f"The engine failed: {error}")
    if isinstance(error, RequestFailed):
        # This request alone could not go on (its grammar left no valid token, its logit
        # biases masked every one...): the request's own constraints, not the server.
        return APIError(400, f"The request could not be completed: {error}",
                        code="request_failed")
    if isinstance(error, LoRANotFound):  # unloaded after check_model
        return APIError(404, str(error), param="model", code="model_not_found")
    if isinstance(error, ValueError):
        return from_value_error(error, KNOWN_PARAMS)
    return APIError(500, "Internal server error (see the server log).")


async def open_streams(engine: AsyncEngine, prompts: list[str | list[int]],
                       params: SamplingParams, base_id: str,
                       priority: int, *, deltas_only: bool = False,
                       lora_name: str | None = None) -> list[RequestStream]:
    """One engine request per prompt, all or none: every prompt is checked before any starts
    (``AsyncEngine.add_requests``), so a refused call leaves the engine as it was.
    ``deltas_only`` for streamed responses: each output holds only what is new.
    ``lora_name``: the LoRA adapter the requests run with (None: the base model)."""
    if request_logger.isEnabledFor(logging.INFO):
        request_logger.info("request %s: %d prompt(s), %s", base_id, len(prompts), params)
    extra: dict[str, object] = {} if lora_name is None else {"lora_name": lora_name}
    trace = current_trace_headers.get()  # None unless traced (trace_context.py)
    if trace is not None:
        extra["trace_headers"] = trace
    try:
        streams = await engine.add_requests(prompts, params, request_id=base_id,
                                            priority=priority, deltas_only=deltas_only,
                                            tenant=current_tenant.get(), **extra)
    except (ValueError, EngineShuttingDown, EngineOverloaded, EngineDeadError) as e:
        raise to_api_error(e) from None
    return streams


Handler = Callable[[int, RequestOutput], Awaitable[None]]


async def consume(streams: list[RequestStream], handle: Handler) -> None:
    """Call ``handle(prompt_index, output)`` for every output of every stream, from this task
    (so a handler may write to the client without locking); close every stream at the end."""
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                await handle(0, out)
            return
        await _consume_many(streams, handle)
    finally:
        for s in streams:
            s.close()


async def _consume_many(streams: list[RequestStream], handle: Handler) -> None:
    send, receive = anyio.create_memory_object_stream[tuple[int, object]](math.inf)

    async def pump(i: int, stream: RequestStream, send) -> None:
        async with send:
            try:
                async for out in stream:
                    await send.send((i, out))
            except Exception as e:  # forwarded: the consumer raises it
                await send.send((i, e))

    error: BaseException | None = None
    async with anyio.create_task_group() as tg:
        for i, stream in enumerate(streams):
            tg.start_soon(pump, i, stream, send.clone())
        send.close()
        async with receive:
            try:
                async for i, item in receive:
                    if isinstance(item, Exception):
                        raise item
                    await handle(i, item)
            except Exception as e:
                error = e
                tg.cancel_scope.cancel()
    if error is not None:
        raise error


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of each stream (non-streaming responses)."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def keep(i: int, out: RequestOutput) -> None:
        finals[i] = out

    try:
        await consume(streams, keep)
    except (EngineDeadError, RequestFailed) as e:
        raise to_api_error(e) from None
    return finals  # type: ignore[return-value]


async def run_sse(request: web.Request, streams: list[RequestStream],
                  render: Callable[[int, RequestOutput], bytes],
                  on_end: Callable[[SSEStream], Awaitable[None]], *,
                  done_marker: bool = True,
                  render_text: Callable[[str], bytes] | None = None,
                  render_error: Callable[[APIError], bytes] | None = None) -> web.StreamResponse:
    """Stream the outputs of ``streams`` as server-sent events; ``render(i, out)`` turns an
    output of stream ``i`` into event bytes. A client that leaves ends it quietly (its requests
    are aborted by ``consume``); an error becomes an error event.

    One stream (the common case) is pushed: the engine's emission renders and writes each
    step's events itself, synchronously, while this handler stays parked, so a step costs one
    write per stream and no task switch. The handler takes over whenever a write would have to
    wait for the client (the socket's buffer is full: later steps merge into one event), and
    for the end of the stream.

    ``render_text(text)``, when the call can give it, renders a step that brings nothing but
    new text (no finish, no logprobs, no tool-call parsing): pushed steps then skip building a
    ``RequestOutput`` altogether. It is used only after the stream's first output, which goes
    through ``render`` (a chat stream's role chunk, a completion's echo).

    ``render_error`` renders an error that ends a started stream (default: OpenAI's error
    event; Anthropic's API sends its own)."""
    try:
        state = request.app.get(STATE)
        sse = await SSEStream.open(request, done_marker,
                                   state.sender if state is not None else None)
    except BaseException:
        for s in streams:
            s.close()
        raise

    async def write(i: int, out: RequestOutput) -> None:
        data = render(i, out)
        if data:
            await sse.write(data)

    if len(streams) == 1:
        streams[0].set_push(_Pusher(sse, render, render_text))
    try:
        await consume(streams, write)
        await on_end(sse)
        await sse.done()
    except ClientGone:
        logger.debug("client left %s before the end of its stream", request.path)
    except Exception as e:
        if isinstance(e, RequestFailed):
            logger.warning("request failed while streaming %s: %s", request.path, e)
        elif not isinstance(e, APIError | EngineDeadError):
            logger.exception("unexpected error while streaming %s", request.path)
        try:
            if render_error is None:
                await sse.error(to_api_error(e))
            else:
                await sse.write(render_error(to_api_error(e)))
                await sse.done()
        except ClientGone:
            pass
        # A stream's error (its ``error``): its traceback's frames hold the stream, a cycle
        # that would keep the engine alive after an unload (engine/cycles.py).
        e.__traceback__ = None
    finally:
        sse.release()
    return sse.response


class _Pusher:
    """What emission calls for a parked handler's stream (``RequestStream.set_push``)."""

    def __init__(self, sse: SSEStream, render: Callable[[int, RequestOutput], bytes],
                 render_text: Callable[[str], bytes] | None = None) -> None:
        self.sse = sse
        self.render = render
        self.render_text = render_text
        self.started = False  # whether an output went through render() yet

    def __call__(self, stream: RequestStream) -> bool:
        sse = self.sse
        conn = sse.conn
        if conn is not None and conn.inflight and not conn.broken and self.started and \
                self.render_text is not None:
            # The usual step of a busy stream, can_write_now inlined: its frames are with the
            # sending thread, so this one follows them there.
            text = stream.take_text()
            if text is not None:
                if text and not sse.transport.is_closing():
                    sse.write_now(self.render_text(text), checked=True)
                return True
        if not sse.can_write_now():
            return False  # the handler writes, and waits for the client
        if self.started and self.render_text is not None:
            text = stream.take_text()
            if text is not None:
                if text:
                    sse.write_now(self.render_text(text), checked=True)
                return True
        out = stream.take()
        if out is None:
            return True
        self.started = True
        data = self.render(0, out)
        if data and not sse.write_now(data):
            raise ClientGone()
        return not out.finished  # the handler ends the stream
