"""Many requests' outputs for one consumer: one wake-up per step, whatever the number of
requests (``AsyncEngine.generate_many``).

One task per request costs the loop a task switch per request per step (its event set, its
wake-up, its ``__anext__``), which at hundreds of streams is most of the loop's time. A
group's requests still have their own :class:`~asyncengine.engine.streams.RequestStream`,
but emission does not wake them: ``notify`` puts a stream on the group's ready list, and the
group's one consumer is woken once per step, when its first stream has news. It then takes
each ready stream's output (``RequestStream.take``), so what a consumer receives per request
is what iterating that request's stream would have given it, merged over the steps it
missed.

Faults stay per request: a request that fails (its grammar, its detokenization) ends with
``finish_reason == "error"`` and its error in :attr:`StreamGroup.errors`; the others go on.
Only the engine's own death (``EngineDeadError``) is raised to the consumer. Leaving early
(``close``: a ``break``, a cancelled consumer) aborts every request still running.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from asyncengine.core.sampling_params import RequestOutputKind, SamplingParams
from asyncengine.engine.errors import EngineDeadError
from asyncengine.engine.outputs import RequestOutput
from asyncengine.engine.streams import RequestStream


class StreamGroup:
    """The streams of many requests, read together. Async iterator of ``list[RequestOutput]``:
    each item holds the outputs of the requests that had news since the previous one (never
    empty), in the order their news came; it ends when every request has ended."""

    def __init__(self, streams: Iterable[RequestStream], *, final_only: bool = False) -> None:
        self.streams: dict[str, RequestStream] = {}  # the ones not yet delivered in full
        #: Requests that failed alone: their request id -> the error (``RequestFailed``).
        self.errors: dict[str, BaseException] = {}
        self._ready: list[RequestStream] = []
        self._event = asyncio.Event()
        for stream in streams:
            self.streams[stream.request_id] = stream
            stream.join_group(self, final_only=final_only)
            if stream.error is not None or stream.finished or \
                    any(s.has_news for s in stream.samples):
                stream.notify()  # it had news before it joined: queued now

    # -- engine side (emission, on the loop) --------------------------------------------------
    def ready(self, stream: RequestStream) -> None:
        """``stream`` has news (or failed): queue it, and wake the consumer on the first."""
        ready = self._ready
        ready.append(stream)
        if len(ready) == 1:
            self._event.set()

    # -- consumer side --------------------------------------------------------------------------
    def __aiter__(self) -> StreamGroup:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        while True:
            if not self.streams:
                raise StopAsyncIteration
            if self._ready:
                outputs = self._take_ready()
                if outputs:
                    return outputs
                continue
            await self._event.wait()
            self._event.clear()

    def _take_ready(self) -> list[RequestOutput]:
        ready, self._ready = self._ready, []
        outputs: list[RequestOutput] = []
        streams, errors = self.streams, self.errors
        for stream in ready:
            stream.queued = False
            if stream.plain_news():  # the usual stream-step: its new text and ids
                outputs.append(stream.take_plain())
                continue
            error = stream.error
            if error is not None:
                if isinstance(error, EngineDeadError):
                    self._ready = ready  # nothing was lost: the caller may look again
                    raise error
                errors[stream.request_id] = error
            out = stream.take()
            if out is not None:
                outputs.append(out)
            if stream.delivered_final or (error is not None and out is None):
                streams.pop(stream.request_id, None)
        return outputs

    def close(self) -> None:
        """Stop reading: every request still running is aborted. Idempotent."""
        for stream in self.streams.values():
            stream.close()
        self.streams.clear()
        self._ready.clear()


class GenerateMany:
    """``AsyncEngine.generate_many`` (a mixin: the engine's ``add_requests`` does the work)."""

    add_requests: Any

    async def generate_many(self, prompts: Sequence[str | list[int]],
                            params: SamplingParams | None = None, *,
                            request_id: str | None = None, priority: int = 0,
                            lora_name: str | None = None,
                            ) -> AsyncIterator[list[RequestOutput]]:
        """Many prompts, one consumer: queue every prompt (all or none, as ``add_requests``),
        then yield, once per step with news, the outputs of the requests that have some. Each
        request's outputs are as ``params.output_kind`` says (``FINAL_ONLY``: its final output
        alone). Request ids are ``request_id-i``, ``i`` the prompt's index, as
        ``RequestOutput.request_id`` gives them. Leaving early aborts the requests still
        running."""
        params = params or SamplingParams()
        kind = params.output_kind
        prompts = list(prompts)
        rid = request_id or uuid.uuid4().hex
        streams = await self.add_requests(  # which names a lone prompt's request rid alone
            prompts, params, request_id=rid if len(prompts) > 1 else f"{rid}-0",
            priority=priority, deltas_only=kind == RequestOutputKind.DELTA, lora_name=lora_name)
        group = StreamGroup(streams, final_only=kind == RequestOutputKind.FINAL_ONLY)
        try:
            async for outputs in group:
                yield outputs
        finally:
            group.close()
