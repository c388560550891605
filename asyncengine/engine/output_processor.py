"""Emission: from the requests a step updated to the deltas their streams deliver.

Runs on the event loop, during the next step's forward pass. For each updated request it
detokenizes the new tokens (``tokenizers``' ``DecodeStream``: O(new tokens)), holds back text
that may begin a stop string, records finish reasons, and wakes the stream once.

Faults are per request: an exception while handling one request's output (its detokenizer, a
stop check, its logprobs) fails that request's stream with ``RequestFailed`` and is reported to
the engine, which finishes it in the scheduler; the rest of the batch goes on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from asyncengine.core.request import Request, RequestStatus
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.engine.errors import RequestFailed
from asyncengine.engine.streams import RequestStream, SampleState
from asyncengine.text.detokenizer import IncrementalDetokenizer
from asyncengine.text.tokenizer import Tokenizer

logger = logging.getLogger("asyncengine")


@dataclass
class Emitted:
    """Requests emission ended, which the engine must finish in the scheduler."""

    stopped: list[str] = field(default_factory=list)  # a stop string matched
    failed: list[str] = field(default_factory=list)  # handling their output raised


class OutputProcessor:
    """The streams of the requests in flight, and emission into them."""

    def __init__(self, tokenizer: Tokenizer, metrics: Any = None) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.streams: dict[str, RequestStream] = {}
        self._stream_of: dict[str, RequestStream] = {}  # sample's request id -> its stream
        # Inter-token latency in bulk: the previous emission's time (the very float object
        # every sample emitted then holds) and how many samples this one found there.
        self._last_now: float | None = None
        self._same_itl = 0

    def make_sample(self, request: Request, params: SamplingParams) -> SampleState:
        return SampleState(
            request=request,
            detokenizer=IncrementalDetokenizer.from_params(
                self.tokenizer, request.prompt_token_ids, params),
            want_logprobs=params.logprobs is not None,
        )

    def add(self, stream: RequestStream) -> None:
        for s in stream.samples:
            self._stream_of[s.request.request_id] = stream
        self.streams[stream.request_id] = stream

    def unfinished_ids(self, request_id: str) -> list[str]:
        """The scheduler ids of the samples of ``request_id`` that have not finished."""
        stream = self.streams.get(request_id)
        if stream is None:
            return []
        return [s.request.request_id for s in stream.samples if s.finish_reason is None]

    def emit(self, requests: list[Request]) -> Emitted:
        """Detokenize new tokens, apply stop strings, wake the streams (on the loop)."""
        result = Emitted()
        if not requests:
            return result
        now = time.monotonic()
        self._same_itl = 0
        stream_of, emit_one = self._stream_of, self._emit_one
        touched: dict[str, RequestStream] = {}  # streams of several samples, woken once
        running, last_now = RequestStatus.RUNNING, self._last_now
        timed = self.metrics is not None
        for req in requests:
            stream = stream_of.get(req.request_id)
            if stream is None:
                continue
            if req.status is running and stream.single:
                # The usual step, without _emit_one's general case: one sample still running,
                # one new token whose text is plain (Detokenizer.push_plain), and (metrics)
                # one inter-token interval since the last emission.
                sample = stream.samples[0]
                tokens, emitted = req.output_token_ids, sample.num_emitted
                if len(tokens) == emitted + 1 and (not timed or (
                        last_now is not None and sample.last_emit is last_now)) and \
                        sample.detokenizer.push_plain(tokens[emitted]):
                    self._same_itl += 1
                    sample.num_emitted = emitted + 1
                    sample.last_emit = now
                    stream.notify()
                    continue
            try:
                emit_one(stream, req, now, result)
            except RequestFailed as e:
                self._fail(stream, e, result)
                continue
            except Exception as e:  # this request's fault alone
                logger.exception("request %s failed while emitting its output", req.request_id)
                self._fail(stream, RequestFailed(f"processing the output failed: "
                                                 f"{type(e).__name__}: {e}"), result)
                continue
            if len(stream.samples) > 1:
                touched[stream.request_id] = stream
                continue
            if stream.samples[0].finish_reason is not None:
                self._close(stream, now)
            stream.notify()
        for stream in touched.values():
            if stream.finished:
                self._close(stream, now)
            stream.notify()
        if self._same_itl and timed:  # one token each since the previous emission: one observation
            self.metrics.on_token(now - self._last_now, self._same_itl)
        self._last_now = now
        return result

    def _emit_one(self, stream: RequestStream, req: Request, now: float,
                  result: Emitted) -> None:
        sample = stream.samples[req.index]
        if sample.finish_reason is not None:
            return
        status = req.status
        if status is RequestStatus.FINISHED_ERROR:
            raise RequestFailed(f"request {req.request_id} failed: {req.error}")
        tokens = req.output_token_ids
        emitted, num = sample.num_emitted, len(tokens)
        if num > emitted:
            new = tokens[emitted:]
            metrics = self.metrics
            if metrics is not None:  # TTFT and inter-token latencies, as the caller sees them
                last = sample.last_emit
                if last is None:
                    metrics.on_first_token(now - req.arrival_time)
                elif last is self._last_now and num - emitted == 1:
                    self._same_itl += 1  # the usual case, observed once per step (see emit)
                else:
                    metrics.on_token((now - last) / (num - emitted), num - emitted)
            sample.last_emit = now
            sample.num_emitted = num
            detok = sample.detokenizer
            stop_terminated = (status is RequestStatus.FINISHED_STOPPED
                               and _ended_by_stop_token(req))
            if num - emitted > 1 and req.sampling_params.stop:
                # Several tokens at once (speculative decoding): a stop string ends the
                # output at the token that completes it, as it would one token at a time.
                last = len(new) - 1
                for j, token in enumerate(new):
                    detok.update((token,), stop_terminated=stop_terminated and j == last)
                    if detok.finished:
                        sample.num_emitted = emitted + j + 1
                        break
            else:
                detok.update(new, stop_terminated=stop_terminated)
            if detok.finished:  # a stop string: it wins over any other reason
                sample.finish_reason, sample.stop_reason = "stop", detok.stop_reason
                if not status.finished:
                    result.stopped.append(req.request_id)
        if status.finished and sample.finish_reason is None:
            sample.detokenizer.flush()
            sample.finish_reason = status.finish_reason
            sample.stop_reason = req.stop_reason

    def _fail(self, stream: RequestStream, error: RequestFailed, result: Emitted) -> None:
        result.failed += [s.request.request_id for s in stream.samples
                          if not s.request.is_finished]
        for s in stream.samples:
            if s.finish_reason is None:
                s.finish_reason = "error"
        stream.fail(error)
        self._close(stream, time.monotonic())

    def fail_all(self, error: BaseException) -> None:
        """The engine died: every stream ends with ``error``."""
        for stream in self.streams.values():
            stream.fail(error)
        self.streams.clear()
        self._stream_of.clear()

    def _close(self, stream: RequestStream, now: float) -> None:
        stream.mark_finished_time()
        self.streams.pop(stream.request_id, None)
        for s in stream.samples:
            r = s.request
            self._stream_of.pop(r.request_id, None)
            if self.metrics is not None:
                self.metrics.on_request_finished(now - r.arrival_time, s.finish_reason,
                                                 r.num_prompt_tokens, s.num_emitted,
                                                 request=r)


def _ended_by_stop_token(req: Request) -> bool:
    """Whether the request ended on an EOS or stop_token_ids token (whose text is left out)."""
    if req.status != RequestStatus.FINISHED_STOPPED or not req.output_token_ids:
        return False
    last = req.output_token_ids[-1]
    return last in req.sampling_params.stop_token_ids or (
        last in req.eos_token_ids and not req.sampling_params.ignore_eos)
