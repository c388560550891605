"""A step's rows as arrays: what ``ModelRunner.prepare`` reads from the scheduler's output.

Most requests of a step continue a decode: the last step sampled them, and this one computes
one token, the one the last step sampled (still on the device), at the position after the last
one, and samples again. Such a row's arrays follow from the last step's with numpy: its
persistent row, its output position plus one, its input fed from the last step's ids. So
:func:`gather_rows` reads each scheduled request's few fields with list comprehensions (C
speed, no Python statement per request), finds the continuing rows with numpy, and runs Python
only for the others: a request that joins, a prefill chunk, a decode whose token is already
known, a row that needs new blocks (the append only). It holds for any scheduler: the check
is on the ``SchedulerOutput``, never on how it was made.

A step with draft tokens (speculative decoding: a request is several attention rows), and a
step of a few requests, take the request-by-request path, :func:`_gather_each`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter
from typing import Any

import numpy as np

from asyncengine.core.sched.interface import SchedulerOutput
from asyncengine.executor.step.input_batch import InputBatch

#: Up to this many requests, a step's rows are gathered one by one: the array path's fixed
#: numpy work (~30 calls) costs more than its Python saves.
FEW_ROWS = 16

_REQUEST = attrgetter("request")
_START = attrgetter("start")
_NUM_NEW = attrgetter("num_new_tokens")
_DRAFTS = attrgetter("spec_token_ids")
_BLOCK_IDS = attrgetter("block_ids")
_ID = attrgetter("request_id")


@dataclass(slots=True)
class StepRows:
    """The step's attention rows (a request's drafts are one row each), its input ids and
    the rows it samples, in step order."""

    rows: np.ndarray  # [R] the persistent row of each attention row
    starts: np.ndarray  # [R] its first position
    lens: np.ndarray  # [R] its query tokens
    input_ids: np.ndarray  # [T] (0 where the token is fed from the previous step)
    sample_flat: np.ndarray  # [S] the sampled tokens' indices in the step
    sample_req_ids: list[str]
    sample_rows: np.ndarray  # [S] their persistent rows
    counters: np.ndarray  # [S] the output position of each sampled token
    sample_next: np.ndarray  # [S] the position each sampled token takes in its sequence
    sample_pos: dict[str, int]  # request id -> its index among the sampled rows (no drafts)
    prev_dst: np.ndarray | None = None  # input_ids[dst] = the previous step's ids[src]
    prev_src: np.ndarray | None = None
    prompt_tasks: list[Any] = field(default_factory=list)
    spec: list[tuple[str, int, list[int]]] = field(default_factory=list)
    num_prompt_tokens: int = 0  # prompt tokens the step computes (for the metrics)
    # When every request of the step samples once, in step order (no drafts): the requests,
    # for the next step's check that it schedules the same ones (else None).
    requests: list[Any] | None = None


def gather_rows(prev: StepRows | None, out: SchedulerOutput, ib: InputBatch, on_join: Any,
                prompt_task: Any) -> StepRows:
    """The rows of ``out`` after ``prev`` (the last prepared step's). Joining requests get a
    persistent row (``on_join(req)`` is called for each); rows get their new blocks.
    ``prompt_task(req, start, n, first)``: the request's prompt-logprobs task for a chunk,
    or None."""
    scheduled = out.scheduled
    n = len(scheduled)
    if prev is None or n <= FEW_ROWS or any(map(_DRAFTS, scheduled)):
        return _gather_each(prev.sample_pos if prev else {}, out, ib, on_join, prompt_task)
    requests = list(map(_REQUEST, scheduled))
    lens = np.fromiter(map(_NUM_NEW, scheduled), np.int64, n)
    starts = np.fromiter(map(_START, scheduled), np.int64, n)
    if requests == prev.requests and not out.preempted_req_ids:
        # The same requests in the same order (by identity), none of them re-admitted: the
        # last step's rows and ids.
        ids, sample_pos = prev.sample_req_ids, prev.sample_pos
        pidx = np.arange(n, dtype=np.int64)
        rows = prev.sample_rows
        cont = (lens == 1) & (starts == prev.sample_next)
        counters = prev.counters + 1
    else:
        ids = list(map(_ID, requests))
        sample_pos = None
        pidx = np.fromiter(map(prev.sample_pos.get, ids, repeat(-1, n)), np.int64, n)
        # A request keeps its row while it runs: one whose row went (it finished or was
        # preempted, and maybe came back under the same id) has none now, or another.
        rows = np.fromiter(map(ib.row_of.get, ids, repeat(-1, n)), np.int64, n)
        known = pidx >= 0
        pi = np.where(known, pidx, 0)
        cont = known & (lens == 1) & (starts == prev.sample_next[pi]) & \
            (rows == prev.sample_rows[pi]) if len(prev.sample_next) else np.zeros(n, dtype=bool)
        counters = prev.counters[pi] + 1 if len(prev.counters) else np.zeros(n, dtype=np.int64)
    num_blocks = np.fromiter(map(len, map(_BLOCK_IDS, scheduled)), np.int64, n)
    for i in np.flatnonzero(cont & (num_blocks > ib.num_blocks[rows])).tolist():
        ib.append_blocks(int(rows[i]), scheduled[i].block_ids)  # ~1 in block_size rows
    others = np.flatnonzero(~cont).tolist()
    if not others:  # the steady decode: every row continues
        index = np.arange(n, dtype=np.int64)
        return StepRows(
            rows=rows, starts=starts, lens=lens, input_ids=np.zeros(n, dtype=np.int64),
            sample_flat=index, sample_req_ids=ids, sample_rows=rows, counters=counters,
            sample_next=starts + 1,
            sample_pos=sample_pos or dict(zip(ids, range(n), strict=True)),
            prev_dst=index, prev_src=pidx, requests=requests)
    # Continuing rows as above; the others one by one.
    rows = rows.copy()  # (it may be the last step's)
    ends = np.cumsum(lens)
    firsts = ends - lens
    input_ids = np.zeros(int(ends[-1]), dtype=np.int64)
    samples = cont.copy()
    prev_dst, prev_src = firsts[cont].tolist(), pidx[cont].tolist()
    prompt_tasks: list[Any] = []
    prev_pos = prev.sample_pos
    num_prompt = 0
    for i in others:
        s = scheduled[i]
        req, start, m = s.request, s.start, s.num_new_tokens
        rid = req.request_id
        num_prompt += _prompt_tokens(req, start, m)
        rows[i] = _row(ib, s, on_join)
        first = int(firsts[i])
        tokens = req.all_token_ids
        known_end = min(start + m, len(tokens))
        input_ids[first:first + known_end - start] = tokens[start:known_end]
        if known_end < start + m:  # the last input token is the in-flight one
            prev_dst.append(first + m - 1)
            prev_src.append(prev_pos[rid])
        if req.sampling_params.prompt_logprobs is not None:
            task = prompt_task(req, start, m, first)
            if task is not None:
                prompt_tasks.append(task)
        if s.samples:
            samples[i] = True
            # This token's output position: the ones known, plus earlier in-flight ones.
            counters[i] = len(req.output_token_ids) + req.num_output_placeholders - 1
    sample_req_ids = list(compress(ids, samples.tolist()))
    result = StepRows(
        rows=rows, starts=starts, lens=lens, input_ids=input_ids,
        sample_flat=(ends - 1)[samples], sample_req_ids=sample_req_ids,
        sample_rows=rows[samples], counters=counters[samples],
        sample_next=(starts + lens)[samples],
        sample_pos=dict(zip(sample_req_ids, range(len(sample_req_ids)), strict=True)),
        prompt_tasks=prompt_tasks, num_prompt_tokens=num_prompt,
        requests=requests if len(sample_req_ids) == n else None)
    if prev_dst:
        result.prev_dst = np.array(prev_dst, dtype=np.int64)
        result.prev_src = np.array(prev_src, dtype=np.int64)
    return result


def _gather_each(prev_pos: dict[str, int], out: SchedulerOutput, ib: InputBatch,
                 on_join: Any, prompt_task: Any) -> StepRows:
    """The rows of ``out``, request by request (drafts, or no previous step)."""
    rows_l: list[int] = []
    starts_l: list[int] = []
    lens_l: list[int] = []
    input_ids: list[int] = []
    prev_dst: list[int] = []
    prev_src: list[int] = []
    sample_flat: list[int] = []
    sample_req_ids: list[str] = []
    sample_rows: list[int] = []
    sample_next: list[int] = []
    counters: list[int] = []
    prompt_tasks: list[Any] = []
    spec: list[tuple[str, int, list[int]]] = []
    sample_pos: dict[str, int] = {}
    add_id = input_ids.append
    num_prompt = 0
    for s in out.scheduled:
        req, start, n = s.request, s.start, s.num_new_tokens
        rid = req.request_id
        num_prompt += _prompt_tokens(req, start, n)
        row = _row(ib, s, on_join)
        first = len(input_ids)
        tokens = req.all_token_ids
        drafts = s.spec_token_ids
        if drafts:  # verification: the last token and the drafts, one query row each
            add_id(tokens[start])
            input_ids.extend(drafts)
            m = len(drafts) + 1
            rows_l += [row] * m
            starts_l += range(start, start + m)
            lens_l += [1] * m
            spec.append((rid, len(sample_req_ids), drafts))
            sample_flat += range(first, first + m)
            sample_req_ids += [rid] * m
            sample_rows += [row] * m
            sample_next += range(start + 1, start + m + 1)
            out_pos = len(req.output_token_ids)
            counters += range(out_pos, out_pos + m)
            continue
        rows_l.append(row)
        starts_l.append(start)
        lens_l.append(n)
        if start + n <= len(tokens):
            input_ids.extend(tokens[start:start + n])
        else:  # the last input token was sampled by the step still in flight
            input_ids.extend(tokens[start:start + n - 1])
            add_id(0)
            prev_dst.append(first + n - 1)
            prev_src.append(prev_pos[rid])
        if req.sampling_params.prompt_logprobs is not None:
            task = prompt_task(req, start, n, first)
            if task is not None:
                prompt_tasks.append(task)
        if s.samples:
            sample_pos[rid] = len(sample_req_ids)
            sample_flat.append(first + n - 1)
            sample_req_ids.append(rid)
            sample_rows.append(row)
            sample_next.append(start + n)
            counters.append(len(req.output_token_ids) + req.num_output_placeholders - 1)
    rows = StepRows(
        rows=np.array(rows_l, dtype=np.int64), starts=np.array(starts_l, dtype=np.int64),
        lens=np.array(lens_l, dtype=np.int64), input_ids=np.array(input_ids, dtype=np.int64),
        sample_flat=np.array(sample_flat, dtype=np.int64), sample_req_ids=sample_req_ids,
        sample_rows=np.array(sample_rows, dtype=np.int64),
        counters=np.array(counters, dtype=np.int64),
        sample_next=np.array(sample_next, dtype=np.int64), sample_pos=sample_pos,
        prompt_tasks=prompt_tasks, spec=spec, num_prompt_tokens=num_prompt,
        requests=None if spec or len(sample_req_ids) != len(out.scheduled)
        else [s.request for s in out.scheduled])
    if prev_dst:
        rows.prev_dst = np.array(prev_dst, dtype=np.int64)
        rows.prev_src = np.array(prev_src, dtype=np.int64)
    return rows


def _row(ib: InputBatch, s: Any, on_join: Any) -> int:
    """The scheduled request's persistent row: a new one when it joins (``on_join`` told),
    with the blocks it has gained since the last step appended."""
    req = s.request
    row = ib.row_of.get(req.request_id)
    if row is None:
        row = ib.add(req, s.block_ids)
        on_join(req)
    elif len(s.block_ids) > ib.num_blocks[row]:
        ib.append_blocks(row, s.block_ids)
    return row


def _prompt_tokens(req: Any, start: int, n: int) -> int:
    """How many of the tokens ``[start, start + n)`` are the request's prompt's."""
    num_prompt = req.num_prompt_tokens
    return min(start + n, num_prompt) - start if start < num_prompt else 0
