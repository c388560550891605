"""What the engine hands back to callers: one RequestOutput per update of a request."""

from __future__ import annotations

import msgspec

from asyncengine.core.request import PositionLogprobs


# msgspec Structs, not dataclasses: one of each is made per request per step, and a Struct is
# made in about 40% of a slotted dataclass's time.
class CompletionOutput(msgspec.Struct):
    """One of the n samples of a request.

    ``text``/``token_ids``/``logprobs`` are cumulative; ``delta_text``/``delta_token_ids`` hold
    what is new since the previous RequestOutput the caller received (``logprobs[-len(delta
    _token_ids):]`` are the new logprobs). A stream opened with ``deltas_only`` (the HTTP
    streaming routes) gives only what is new in ``text``/``token_ids``/``logprobs`` too.
    ``num_output_tokens`` is the cumulative count either way.
    """

    index: int
    text: str = ""
    token_ids: list[int] = []
    delta_text: str = ""
    delta_token_ids: list[int] = []
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    num_output_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestMetrics(msgspec.Struct):
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0


class RequestOutput(msgspec.Struct):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
