"""Per-request output streams: what ``AsyncEngine.generate`` iterates over.

The engine pushes into a stream after each step (on the loop, no queue, no copy of past
outputs); the consumer takes everything new since its last read. A slow consumer therefore
never makes a backlog grow: the steps it missed merge into one RequestOutput.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from asyncengine.core.request import Request
from asyncengine.engine.errors import EngineDeadError, RequestFailed
from asyncengine.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from asyncengine.text.detokenizer import IncrementalDetokenizer


class Group(Protocol):
    """What a stream needs of its group (``stream_group.StreamGroup``)."""

    def ready(self, stream: RequestStream) -> None: ...


@dataclass
class SampleState:
    """One of the n samples: the request (whose ``output_token_ids`` and ``logprobs`` hold the
    tokens), its detokenizer (which holds the emitted text, in chunks), how many tokens have
    been emitted, and what the consumer has been given. Nothing is kept twice."""

    request: Request
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool = False
    num_emitted: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_chunks: int = 0
    last_emit: float | None = None  # when tokens were last pushed (for inter-token latency)

    @property
    def has_news(self) -> bool:
        return self.sent_tokens < self.num_emitted or \
            self.sent_chunks < len(self.detokenizer.chunks)


class RequestStream:
    """Async iterator of RequestOutput for one request (all n samples). Leaving the iteration
    early (``aclose``, ``close``, a cancelled consumer) aborts the request.

    ``deltas_only``: every output carries only what is new (``text``, ``token_ids`` and
    ``logprobs`` equal the deltas), so a long stream costs O(new tokens) per output; the HTTP
    streaming routes use it. Otherwise (the default) they are cumulative, as the offline API
    returns them, and ``delta_*`` hold what is new.
    """

    #: The request's W3C trace context headers, set only when it is traced (tracing.py).
    trace_headers: Mapping[str, str] | None = None

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 samples: list[SampleState], on_abort: Callable[[str], None], *,
                 deltas_only: bool = False) -> None:
        self.deltas_only = deltas_only
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.samples = samples
        self._on_abort = on_abort
        # asyncio's own Event, set by the loop and cleared by the consumer: no allocation per
        # step (the engine runs on asyncio, as aiohttp does).
        self._event = asyncio.Event()
        self._error: BaseException | None = None
        self._delivered_final = False
        # Push mode (see set_push): the consumer's deliver function, and whether the consumer
        # is parked in __anext__ (the only moment pushing cannot interleave with its writes).
        self._push: Callable[[RequestStream], bool] | None = None
        self._waiting = False
        # Set by final(): the consumer wants the final output only (wake it at the end).
        self._final_only = False
        self._first = samples[0].request
        # Whether take_text() may stand in for take() (see there).
        self._plain = deltas_only and len(samples) == 1 and not samples[0].want_logprobs
        self.single = len(samples) == 1
        self.finished_time: float | None = None
        # A StreamGroup's member (stream_group.py): emission queues the stream on the group
        # (once until the group takes it: ``queued``) instead of waking a consumer of its own.
        self._group: Group | None = None
        self.queued = False

    # -- engine side ----------------------------------------------------------------------------
    def notify(self) -> None:
        """New outputs are ready. In a group, queue the stream on it; in push mode, while the
        consumer is parked, deliver them now from the loop (one synchronous write, no task
        switch); else wake the consumer."""
        group = self._group
        if group is not None:
            if not self.queued and (not self._final_only or self.finished
                                    or self._error is not None):
                self.queued = True
                group.ready(self)
            return
        if self._final_only and not self.finished:
            return  # final(): nothing to wake the consumer for before the end
        push = self._push
        if push is not None and self._waiting and self._error is None:
            try:
                if push(self):
                    return
            except BaseException as e:  # the consumer's own failure: raise it over there,
                # without its traceback here, which holds emission's frames up the stack and
                # would keep the engine alive (engine/cycles.py)
                self._error = e.with_traceback(None)
        self._event.set()

    def set_push(self, deliver: Callable[[RequestStream], bool]) -> None:
        """Push mode: ``deliver(stream)`` is called on the loop, from emission, when there is
        news and the consumer waits; it takes the output with :meth:`take` and writes it
        without awaiting. It returns False to have the consumer woken instead (a full socket
        buffer, the final output); an exception it raises is raised to the consumer."""
        self._push = deliver

    def take(self) -> RequestOutput | None:
        """What ``__anext__`` would return now, or None if there is nothing new."""
        if self._delivered_final:
            return None
        if self._plain:  # (as _take's own fast path)
            s = self.samples[0]
            if s.finish_reason is None:
                if s.sent_tokens == s.num_emitted and \
                        s.sent_chunks == len(s.detokenizer.chunks):
                    return None
                return self._take_plain(s)
        for s in self.samples:
            if s.finish_reason is not None or s.has_news:
                break
        else:
            return None
        return self._take()

    def plain_news(self) -> bool:
        """Whether the next output is a plain one with news: a single-sample delta stream,
        no logprobs, not finished, no error, something new. Then :meth:`take_plain` gives
        what :meth:`take` would."""
        if not self._plain or self._error is not None or self._delivered_final:
            return False
        s = self.samples[0]
        return s.finish_reason is None and (
            s.sent_tokens != s.num_emitted or s.sent_chunks != len(s.detokenizer.chunks))

    def take_plain(self) -> RequestOutput:
        return self._take_plain(self.samples[0])

    def take_text(self) -> str | None:
        """The fast path of :meth:`take` for what most streamed steps deliver: the new text of
        a single-sample delta stream that has not finished and wants no logprobs (possibly
        ""). It advances what was sent as ``take`` would. None: a full output is needed."""
        if not self._plain or self._delivered_final:
            return None
        s = self.samples[0]
        if s.finish_reason is not None:
            return None
        chunks = s.detokenizer.chunks
        sent, n = s.sent_chunks, len(chunks)
        s.sent_tokens, s.sent_chunks = s.num_emitted, n
        return "" if n == sent else chunks[sent] if n == sent + 1 else "".join(chunks[sent:])

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (an ``EngineDeadError`` or a ``RequestFailed``),
        raised to the consumer at its next read."""
        if not isinstance(error, (EngineDeadError, RequestFailed)):
            wrapped = EngineDeadError(str(error))
            wrapped.__cause__ = error
            error = wrapped
        self._error = error
        if self._group is not None:
            self.notify()
        self._event.set()

    def join_group(self, group: Group, *, final_only: bool = False) -> None:
        """Deliver through ``group`` from now on (before the request's first output); with
        ``final_only``, only the final output (as :meth:`final`)."""
        self._group = group
        self._final_only = final_only

    @property
    def error(self) -> BaseException | None:
        """What ended the stream with an error (raised to a consumer of its own)."""
        return self._error

    @property
    def delivered_final(self) -> bool:
        """Whether the consumer has been given the final output (or left)."""
        return self._delivered_final

    @property
    def finished(self) -> bool:
        for s in self.samples:
            if s.finish_reason is None:
                return False
        return True

    # -- consumer side --------------------------------------------------------------------------
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._error is not None:
                raise self._error
            if self._delivered_final:  # the end, possibly pushed while we waited
                raise StopAsyncIteration
            if self.finished or any(s.has_news for s in self.samples):
                break
            await self._wait()
        return self._take()

    async def _wait(self) -> None:
        """Park until the engine notifies (or fails) this stream."""
        self._waiting = True
        try:
            await self._event.wait()
        finally:
            self._waiting = False
        self._event.clear()

    async def final(self) -> RequestOutput:
        """The final output alone (vLLM's ``RequestOutputKind.FINAL_ONLY``, what ``LLM``
        uses): the consumer is woken once, when the request ends (or fails), not after every
        step, and no output is built before the last one. Raises what ``__anext__`` raises."""
        self._final_only = True
        while self._error is None and not self.finished:
            await self._wait()
        if self._error is not None:
            raise self._error
        return self._take()

    def _take(self) -> RequestOutput:
        if self._plain and self.samples[0].finish_reason is None:
            return self._take_plain(self.samples[0])
        outputs = []
        for i, s in enumerate(self.samples):
            chunks = s.detokenizer.chunks
            sent = s.sent_chunks
            n = len(chunks)
            new_text = "" if n == sent else chunks[sent] if n == sent + 1 else \
                "".join(chunks[sent:])
            req, emitted = s.request, s.num_emitted
            new_ids = req.output_token_ids[s.sent_tokens:emitted]
            if self.deltas_only:
                text, token_ids = new_text, new_ids
                logprobs = req.logprobs[s.sent_tokens:emitted] if s.want_logprobs else None
            else:
                text, token_ids = s.detokenizer.text, req.output_token_ids[:emitted]
                logprobs = req.logprobs[:emitted] if s.want_logprobs else None
            outputs.append(CompletionOutput(
                index=i,
                text=text,
                token_ids=token_ids,
                delta_text=new_text,
                delta_token_ids=new_ids,
                cumulative_logprob=req.cumulative_logprob if s.want_logprobs else None,
                logprobs=logprobs,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                num_output_tokens=emitted,
            ))
            s.sent_tokens, s.sent_chunks = emitted, n
        finished = self.finished
        self._delivered_final = finished
        r = self._first
        metrics = None
        if finished or not self.deltas_only:  # a delta stream's metrics come with its end
            metrics = RequestMetrics(r.arrival_time, r.first_scheduled_time, r.first_token_time,
                                     r.last_token_time, self.finished_time, r.num_cached_tokens)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             finished, r.prompt_logprobs, metrics, r.num_cached_tokens)

    def _take_plain(self, s: SampleState) -> RequestOutput:
        """``_take`` for what most outputs of a delta stream are: one sample, no logprobs,
        not finished (no metrics then): the same output, built without the general case's
        branches."""
        chunks = s.detokenizer.chunks
        sent, n = s.sent_chunks, len(chunks)
        text = "" if n == sent else chunks[sent] if n == sent + 1 else "".join(chunks[sent:])
        req, emitted = s.request, s.num_emitted
        ids = req.output_token_ids[s.sent_tokens:emitted]
        s.sent_tokens, s.sent_chunks = emitted, n
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [CompletionOutput(0, text, ids, text, ids, None, None, None, None,
                                               emitted)],
                             False, req.prompt_logprobs, None, req.num_cached_tokens)

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
