"""What the built-in schedulers do to one request's state: apply a step's results (a sampled
token, and whether it ends the request; verified drafts; prompt logprobs), and the two
questions they ask of a request (is its in-flight token its last; does it need every prompt
position computed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncengine.core.request import PositionLogprobs, Request, RequestStatus
from asyncengine.core.sched.interface import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from asyncengine.core.kv.manager import KVCacheManager

#: ``finish(request, status)``: the scheduler ends a request (frees its blocks).
Finish = Callable[[Request, RequestStatus], None]


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


def apply_step_results(scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                       kv: KVCacheManager, finish: Finish) -> list[Request]:
    """``update_from_output`` of the built-in schedulers: each running request's computed
    blocks indexed, its token (or verified drafts) and logprobs applied, its stop conditions
    checked (``finish`` ends it). Returns the requests that got a token or finished."""
    updated: list[Request] = []
    add = updated.append
    now = time.monotonic()
    cache_full_blocks = kv.cache_full_blocks
    # Without a sliding window, a step adds full blocks to index only when it crosses a
    # block boundary, or starts on one (after a prefix hit or a KV-connector load).
    bs = kv.block_size if kv.sliding_window is None else 1
    prompt_logprobs = runner_output.prompt_logprobs
    sampled = runner_output.sampled_token_ids
    logprobs = runner_output.logprobs
    running = RequestStatus.RUNNING
    for scheduled in scheduler_output.scheduled:  # O(1) Python per request
        request = scheduled.request
        if request.status is not running:
            continue  # finished, aborted or preempted while the step ran: dropped
        rid = request.request_id
        if scheduled.spec_token_ids:
            apply_spec(request, scheduled, runner_output, now, kv, finish)
            add(request)
            continue
        start = scheduled.start
        end = start + scheduled.num_new_tokens
        if bs == 1 or not start % bs or end // bs != start // bs:
            cache_full_blocks(request, end)
        if prompt_logprobs:
            entries = prompt_logprobs.get(rid)
            if entries:
                store_prompt_logprobs(request, start + 1, entries)
        if not scheduled.samples:
            continue
        token = sampled.get(rid)
        if token is None:
            raise RuntimeError(f"the runner sampled no token for request {rid!r}")
        request.num_output_placeholders -= 1
        if token >= 0 and request.grammar is None and (not logprobs or rid not in logprobs):
            # apply_sampled's plain case, inlined, and check_stop only where it may stop
            out, tokens = request.output_token_ids, request.all_token_ids
            out.append(token)
            tokens.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            sp = request.sampling_params
            status = request.check_stop() if (
                len(out) >= request.max_tokens or len(tokens) >= request.max_model_len
                or ((token in request.eos_token_ids or token in sp.stop_token_ids)
                    and len(out) >= sp.min_tokens)) else None
        else:
            status = apply_sampled(request, token, logprobs.get(rid) if logprobs else None, now)
        if status is not None:
            finish(request, status)
        add(request)
    return updated


def apply_spec(request: Request, scheduled: ScheduledRequest, runner_output: ModelRunnerOutput,
               now: float, kv: KVCacheManager, finish: Finish) -> None:
    """A step that verified drafts: its accepted drafts and the token after them."""
    rid = request.request_id
    tokens = runner_output.spec_token_ids.get(rid)
    if not tokens:
        raise RuntimeError(f"the runner returned no tokens for request {rid!r}, which "
                           "was scheduled with draft tokens")
    lps = runner_output.spec_logprobs.get(rid)
    request.num_output_placeholders -= 1 + len(scheduled.spec_token_ids)
    # KV is valid for the last token and the accepted drafts; rejected slots are reused.
    request.num_computed_tokens = scheduled.start + len(tokens)
    status = None
    for i, token in enumerate(tokens):
        status = apply_sampled(request, token, lps[i] if lps else None, now)
        if status is not None:
            break
    if status is not None:
        finish(request, status)
    else:
        kv.cache_full_blocks(request, request.num_computed_tokens)
