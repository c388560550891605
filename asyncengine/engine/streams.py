"""Per-request output streams: what ``AsyncEngine.generate`` iterates over.

The engine pushes into a stream after each step (on the loop, no queue, no copy of past
outputs); the consumer takes everything new since its last read. A slow consumer therefore
never makes a backlog grow: the steps it missed merge into one RequestOutput.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from asyncengine.core.request import PositionLogprobs, Request
from asyncengine.engine.errors import EngineDeadError, RequestFailed
from asyncengine.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from asyncengine.text.detokenizer import IncrementalDetokenizer


@dataclass
class SampleState:
    """One of the n samples: the request, its detokenizer (which holds the text emitted so far,
    in chunks) and what the consumer has been given."""

    request: Request
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_chunks: int = 0
    last_emit: float | None = None  # when tokens were last pushed (for inter-token latency)

    @property
    def has_news(self) -> bool:
        return self.sent_tokens < len(self.token_ids) or \
            self.sent_chunks < len(self.detokenizer.chunks)


class RequestStream:
    """Async iterator of RequestOutput for one request (all n samples). Leaving the iteration
    early (``aclose``, ``close``, a cancelled consumer) aborts the request.

    ``deltas_only``: every output carries only what is new (``text``, ``token_ids`` and
    ``logprobs`` equal the deltas), so a long stream costs O(new tokens) per output; the HTTP
    streaming routes use it. Otherwise (the default) they are cumulative, as the offline API
    returns them, and ``delta_*`` hold what is new.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 samples: list[SampleState], on_abort: Callable[[str], None], *,
                 deltas_only: bool = False) -> None:
        self.deltas_only = deltas_only
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.samples = samples
        self._on_abort = on_abort
        self._event = anyio.Event()
        self._error: BaseException | None = None
        self._delivered_final = False
        self._first = samples[0].request
        self.finished_time: float | None = None

    # -- engine side ----------------------------------------------------------------------------
    def notify(self) -> None:
        self._event.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (an ``EngineDeadError`` or a ``RequestFailed``),
        raised to the consumer at its next read."""
        if not isinstance(error, (EngineDeadError, RequestFailed)):
            wrapped = EngineDeadError(str(error))
            wrapped.__cause__ = error
            error = wrapped
        self._error = error
        self._event.set()

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    # -- consumer side --------------------------------------------------------------------------
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._delivered_final:
            raise StopAsyncIteration
        while True:
            if self._error is not None:
                raise self._error
            if self.finished or any(s.has_news for s in self.samples):
                break
            await self._event.wait()
            self._event = anyio.Event()
        return self._take()

    def _take(self) -> RequestOutput:
        outputs = []
        for i, s in enumerate(self.samples):
            chunks = s.detokenizer.chunks
            new_text = "".join(chunks[s.sent_chunks:])
            new_ids = s.token_ids[s.sent_tokens:]
            if self.deltas_only:
                text, token_ids = new_text, new_ids
                logprobs = s.logprobs[s.sent_tokens:] if s.logprobs is not None else None
            else:
                text, token_ids = s.detokenizer.text, list(s.token_ids)
                logprobs = list(s.logprobs) if s.logprobs is not None else None
            outputs.append(CompletionOutput(
                index=i,
                text=text,
                token_ids=token_ids,
                delta_text=new_text,
                delta_token_ids=new_ids,
                cumulative_logprob=(s.request.cumulative_logprob
                                    if s.logprobs is not None else None),
                logprobs=logprobs,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                num_output_tokens=len(s.token_ids),
            ))
            s.sent_tokens, s.sent_chunks = len(s.token_ids), len(chunks)
        finished = self.finished
        self._delivered_final = finished
        r = self._first
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=r.prompt_logprobs,
            metrics=RequestMetrics(
                arrival_time=r.arrival_time,
                first_scheduled_time=r.first_scheduled_time,
                first_token_time=r.first_token_time,
                last_token_time=r.last_token_time,
                finished_time=self.finished_time,
                num_cached_tokens=r.num_cached_tokens,
            ),
            num_cached_tokens=r.num_cached_tokens,
        )

    def close(self) -> None:
        """Stop consuming; aborts the request if it is still running. Idempotent."""
        if not self.finished:
            self._on_abort(self.request_id)
        self._delivered_final = True

    async def aclose(self) -> None:
        self.close()

    def mark_finished_time(self) -> None:
        if self.finished and self.finished_time is None:
            self.finished_time = time.monotonic()
