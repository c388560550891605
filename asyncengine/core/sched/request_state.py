"""What the built-in schedulers do to one request's state: apply a sampled token (and say
whether it ends the request), keep prompt logprobs, and the two questions they ask of a request
(is its in-flight token its last; does it need every prompt position computed)."""

from __future__ import annotations

from asyncengine.core.request import PositionLogprobs, Request, RequestStatus


def finishes_in_flight(request: Request) -> bool:
    """The tokens in flight bring the request to its length limit."""
    num_out = request.num_output_tokens + request.num_output_placeholders
    return num_out >= request.max_tokens or \
        request.num_tokens + request.num_output_placeholders >= request.max_model_len


def needs_every_position(request: Request) -> bool:
    """Prompt logprobs need every prompt position computed, at least once."""
    return request.sampling_params.prompt_logprobs is not None and \
        len(request.prompt_logprobs or ()) < request.num_prompt_tokens


def append_token(request: Request, token: int, logprobs: PositionLogprobs | None,
                  now: float) -> None:
    request.append_output_token(token)
    if logprobs is not None:
        request.logprobs.append(logprobs)
        request.cumulative_logprob += logprobs[token].logprob
    if request.grammar is not None and not request.grammar.accept_token(token):
        raise ValueError(f"the grammar does not allow token {token} here")
    if request.first_token_time is None:
        request.first_token_time = now
    request.last_token_time = now


def apply_sampled(request: Request, token: int, logprobs: PositionLogprobs | None,
                  now: float) -> RequestStatus | None:
    """Append a sampled token; returns the status that ends the request (a stop condition met,
    no valid token, its grammar failing), or None while it goes on. A failure here belongs to
    this request alone: it is its status, never an exception."""
    if token < 0:
        request.error = ("the model produced no valid next token (its logits were NaN or "
                         "infinite after the sampling parameters were applied, or the "
                         "structured-output grammar allowed no token)")
        return RequestStatus.FINISHED_ERROR
    try:
        append_token(request, token, logprobs, now)
        return request.check_stop()
    except Exception as e:  # this request's grammar (a plugin) failed: it alone ends
        request.error = f"its structured-output grammar failed: {type(e).__name__}: {e}"
        return RequestStatus.FINISHED_ERROR


def store_prompt_logprobs(
    request: Request, start: int, entries: list[PositionLogprobs | None]
) -> None:
    """Entries are for prompt tokens ``start, start + 1, ...``; a recompute after preemption
    sends positions again, which are kept from the first time."""
    if request.prompt_logprobs is None:
        request.prompt_logprobs = [None]
    have = len(request.prompt_logprobs)
    if start <= have:
        request.prompt_logprobs.extend(entries[have - start:])
