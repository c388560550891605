"""One line of a batch, run: its body decoded as its route decodes it, then the route's own
function of (state, body), the one its HTTP handler calls (``chat_completion``,
``completion``, ``embeddings``), so a line answers exactly what the route answers.

Streaming is not a batch's (OpenAI's batches refuse it): a line that asks for it is answered
whole. A line runs ``BATCH_PRIORITY`` less urgently than its own ``priority`` says, which
``--scheduler priority`` honours; under ``fcfs`` the runner bounds the batch's share instead
(``runner.Admission``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncengine.core.limits import INT64_MAX
from asyncengine.entrypoints.batch.protocol import InputLine, LineError, LineResponse, OutputLine
from asyncengine.entrypoints.http.errors import APIError
from asyncengine.entrypoints.http.openai.chat import chat_completion
from asyncengine.entrypoints.http.openai.completions import completion, completion_allows
from asyncengine.entrypoints.http.openai.embeddings import EmbeddingRequest, embeddings
from asyncengine.entrypoints.http.protocol import ChatCompletionRequest, CompletionRequest
from asyncengine.entrypoints.http.serving import decode_body, random_id, to_api_error
from asyncengine.entrypoints.http.state import ServerState

logger = logging.getLogger("asyncengine.entrypoints.batch")

#: How much less urgent a batch line is than the same request sent alone (lower runs first).
BATCH_PRIORITY = 1 << 32


class Retry(Exception):
    """The line cannot run now (the engine is overloaded, shutting down or failed): nothing
    is written for it, and it runs again later, or after a restart."""


async def _embeddings(state: ServerState, body: Any, call_id: str, priority: int) -> Any:
    return await embeddings(state, body, call_id)  # embeddings do not queue


def _none(state: ServerState) -> frozenset[str]:
    return frozenset()


@dataclass(frozen=True)
class _Route:
    body: type
    prefix: str
    run: Callable[[ServerState, Any, str, int], Awaitable[Any]]
    allows: Callable[[ServerState], frozenset[str]] = _none


ROUTES = {
    "/v1/chat/completions": _Route(ChatCompletionRequest, "chatcmpl", chat_completion),
    "/v1/completions": _Route(CompletionRequest, "cmpl", completion, completion_allows),
    "/v1/embeddings": _Route(EmbeddingRequest, "embd", _embeddings),
}


def line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


async def execute(state: ServerState, line: InputLine, priority: int = BATCH_PRIORITY) -> \
        OutputLine:
    """The line's output line (``error`` set when the route refused it or failed). Raises
    ``Retry`` when the server, not the line, is why it could not run.

    In router mode the line's ``model`` picks the engine, loaded first when it is not (as
    for a request): the line holds a lease on it while it runs. A model unknown, or one that
    failed to load, is the line's error."""
    route = ROUTES[line.url]
    call_id = random_id(route.prefix)
    if state.registry is None:
        return await _execute(state, line, route, call_id, priority)
    from asyncengine.entrypoints.http.router import leased_state, named_model

    try:
        lease = leased_state(state, named_model(state.registry, bytes(line.body)))
        view = await lease.__aenter__()
    except APIError as e:
        return _error_line(line, call_id, e)
    try:
        return await _execute(view, line, route, call_id, priority)
    finally:
        await lease.__aexit__(None, None, None)


async def _execute(state: ServerState, line: InputLine, route: _Route, call_id: str,
                   priority: int) -> OutputLine:
    try:
        body = decode_body(bytes(line.body), route.body, route.allows(state))
        if getattr(body, "stream", None):
            body = msgspec.structs.replace(body, stream=None, stream_options=None)
        urgency = min(INT64_MAX, (getattr(body, "priority", None) or 0) + priority)
        result = await route.run(state, body, call_id, urgency)
    except Exception as e:
        error = to_api_error(e)
        if error.status == 503 or state.engine.error is not None:
            raise Retry(error.message) from e
        if not isinstance(e, APIError):
            logger.error("batch line %r failed", line.custom_id, exc_info=e)
        return _error_line(line, call_id, error)
    return OutputLine(id=line_id(), custom_id=line.custom_id,
                      response=LineResponse(status_code=200, request_id=call_id, body=result))


def _error_line(line: InputLine, call_id: str, error: APIError) -> OutputLine:
    code = error.code if isinstance(error.code, str) else error.type
    return OutputLine(id=line_id(), custom_id=line.custom_id,
                      response=LineResponse(status_code=error.status, request_id=call_id,
                                            body=error.body()),
                      error=LineError(code=code, message=error.message))
