"""A step's rows (``executor/step/step_rows.py``): the array path, which derives continuing
decode rows from the last step's arrays and runs Python only for the others, must give what
the request-by-request path gives, in every mix the built-in scheduler makes under async
scheduling (joins, prefill chunks, new blocks, finishes, preemption, prefix hits)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from asyncengine.core.request import RequestStatus
from asyncengine.core.sched import FCFSScheduler
from asyncengine.core.sched.interface import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from asyncengine.executor.step import step_rows
from asyncengine.executor.step.input_batch import InputBatch
from asyncengine.executor.step.step_rows import StepRows, _gather_each, gather_rows
from tests.core.test_scheduler import make_config, make_request

FIELDS = ("rows", "starts", "lens", "input_ids", "sample_flat", "sample_rows", "counters",
          "sample_next", "prev_dst", "prev_src")


def assert_same(a: StepRows, b: StepRows) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None, name
        else:
            np.testing.assert_array_equal(x, y, err_msg=name)
    assert a.sample_req_ids == b.sample_req_ids
    assert a.sample_pos == b.sample_pos
    assert a.num_prompt_tokens == b.num_prompt_tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_array_rows_equal_request_by_request_rows(seed, monkeypatch):
    monkeypatch.setattr(step_rows, "FEW_ROWS", 0)  # the array path for every step
    rng = random.Random(seed)
    sched = FCFSScheduler(make_config(block_size=4, max_num_seqs=12,
                                      max_num_batched_tokens=40), num_blocks=48)
    # Two persistent batches fed the same steps: one through each path.
    fast, slow = (InputBatch(16, 64, 1000, frozenset({0})) for _ in range(2))
    prev_fast: StepRows | None = None
    prev_slow: StepRows | None = None
    in_flight = None
    shared = list(range(500, 508))  # a prefix some prompts share: prefix-cache hits
    n, steps, mixes = 0, 0, {"steady": 0, "mixed": 0}
    while steps < 300:
        if n < 40 and rng.random() < 0.3:
            prompt = (shared if rng.random() < 0.3 else []) + \
                [rng.randrange(1, 400) for _ in range(rng.randrange(1, 20))]
            sched.add_request(make_request(f"r{n}", prompt, max_tokens=rng.randrange(1, 30)))
            n += 1
        out = sched.schedule()
        for rid in (*out.finished_req_ids, *out.preempted_req_ids):
            fast.remove(rid)
            slow.remove(rid)
        if out.scheduled:
            a = gather_rows(prev_fast, out, fast, lambda r: None, lambda *a: None)
            b = _gather_each(prev_slow.sample_pos if prev_slow else {}, out, slow,
                             lambda r: None, lambda *a: None)
            assert_same(a, b)
            np.testing.assert_array_equal(fast.block_table, slow.block_table)
            np.testing.assert_array_equal(fast.num_blocks, slow.num_blocks)
            mixes["steady" if a.prev_dst is not None and len(a.prev_dst) == len(a.lens)
                  else "mixed"] += 1
            prev_fast, prev_slow = a, b
        if in_flight is not None:  # async scheduling: N's results after N+1 is scheduled
            done, ids = in_flight
            sched.update_from_output(done, ModelRunnerOutput(
                sampled_token_ids={rid: rng.randrange(1, 400) for rid in ids}))
        in_flight = (out, list(b.sample_req_ids)) if out.scheduled else None
        if sched.running and rng.random() < 0.05:  # an abort between steps
            victim = rng.choice(sched.running)
            sched.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED)
        if not sched.has_unfinished_requests() and n >= 40:
            break
        steps += 1
    assert mixes["steady"] > 10 and mixes["mixed"] > 10, mixes


def test_a_request_id_back_under_a_new_request_is_not_taken_for_the_old_one(monkeypatch):
    """An aborted request's id, reused at once by a request whose one new token sits where
    the old one's next token would have: its input is its own prompt token, not the last
    step's sample, and it gets a row of its own."""
    monkeypatch.setattr(step_rows, "FEW_ROWS", 0)
    ib = InputBatch(4, 16, 1000, frozenset({0}))
    old = make_request("x", list(range(1, 17)), max_tokens=8)
    other = make_request("y", list(range(100, 110)), max_tokens=8)
    step1 = SchedulerOutput(scheduled=[ScheduledRequest(old, 0, 16, [1, 2, 3, 4]),
                                       ScheduledRequest(other, 0, 10, [5, 6, 7])])
    prev = gather_rows(None, step1, ib, lambda r: None, lambda *a: None)
    assert prev.sample_pos == {"x": 0, "y": 1} and prev.sample_next.tolist() == [16, 10]
    ib.remove("x")  # aborted; a new "x" has 17 tokens, 16 of them a prefix hit
    new = make_request("x", list(range(1, 18)), max_tokens=8)
    other.num_output_placeholders = 1
    step2 = SchedulerOutput(scheduled=[ScheduledRequest(new, 16, 1, [1, 2, 3, 4, 8]),
                                       ScheduledRequest(other, 10, 1, [5, 6, 7])])
    rows = gather_rows(prev, step2, ib, lambda r: None, lambda *a: None)
    assert rows.input_ids.tolist() == [17, 0]  # x: its own token; y: fed from the device
    assert rows.prev_dst.tolist() == [1] and rows.prev_src.tolist() == [1]
    assert ib.row_of["x"] == rows.rows[0] and ib.request_of[rows.rows[0]] is new
    assert ib.block_table[rows.rows[0], :5].tolist() == [1, 2, 3, 4, 8]
