"""The persistent batch (``executor/step/input_batch.py``): a row outlives many steps and is
reused by the next request, so what a bug would leave behind is the previous request's state in
a reused row, a column lost when the batch grows, or a block table that drifts from the
request's."""

from __future__ import annotations

import numpy as np
import pytest

from asyncengine.core.request import Request
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.executor.step.input_batch import InputBatch

VOCAB = 100
EOS = frozenset({2})


def request(rid: str, **params) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(max_tokens=8, **params), eos_token_ids=EOS)


def test_a_reused_row_keeps_nothing_of_the_request_before_it():
    ib = InputBatch(max_rows=2, max_blocks_per_row=4, vocab_size=VOCAB, eos_token_ids=EOS)
    a = ib.add(request("a", temperature=0.7, top_k=5, logprobs=3, seed=11,
                       repetition_penalty=1.2, logit_bias={4: 2.0, 500: 1.0}, min_tokens=2),
               [7, 8])
    assert ib.any_logprobs == 1 and ib.penalized[a] and ib.seeded[a]
    assert [r.row for r in ib.pending_resets] == [a]
    extras = ib.extras[a]
    assert extras.bias_cols.tolist() == [4]  # an id past the vocabulary is dropped
    assert extras.min_tokens_stops == [2]  # EOS is held back for min_tokens
    ib.pending_resets.clear()
    ib.remove("a")
    ib.remove("a")  # twice: a no-op, not a double free
    assert ib.any_logprobs == 0 and a not in ib.extras
    b = ib.add(request("b", temperature=0.0), [3])
    assert b == a  # the freed row is taken again
    assert ib.num_blocks[b] == 1 and ib.block_table[b, 0] == 3
    assert ib.num_logprobs[b] == -1 and not ib.penalized[b] and not ib.seeded[b]
    assert ib.top_k[b] == SamplingParams().top_k and ib.min_tokens[b] == 0
    assert b not in ib.extras and ib.pending_resets == []
    assert ib.is_greedy(np.array([b])).tolist() == [True]
    assert ib.request_of[b].request_id == "b" and ib.row_of == {"b": b}


def test_growing_keeps_every_row():
    ib = InputBatch(max_rows=1, max_blocks_per_row=3, vocab_size=VOCAB, eos_token_ids=EOS)
    rows = [ib.add(request(f"r{i}", temperature=0.1 * (i + 1), top_p=0.5 + 0.1 * i),
                   [10 * i, 10 * i + 1]) for i in range(5)]
    assert ib.capacity >= 5 and sorted(rows) == list(range(5))
    for i, row in enumerate(rows):
        assert ib.block_table[row, :2].tolist() == [10 * i, 10 * i + 1]
        assert ib.temperature[row] == pytest.approx(0.1 * (i + 1))
        assert ib.top_p[row] == pytest.approx(0.5 + 0.1 * i)
        assert ib.request_of[row].request_id == f"r{i}"


def test_blocks_are_appended_not_rewritten_and_logged_for_the_workers():
    ib = InputBatch(max_rows=2, max_blocks_per_row=3, vocab_size=VOCAB, eos_token_ids=EOS)
    ib.table_log = []
    row = ib.add(request("a"), [4])
    ib.append_blocks(row, [4, 9])
    ib.append_blocks(row, [4, 9])  # nothing new
    assert ib.block_table[row].tolist()[:2] == [4, 9] and ib.num_blocks[row] == 2
    assert ib.table_log == [(row, 0, [4]), (row, 1, [9])]
    with pytest.raises(ValueError, match="more than the 3"):
        ib.append_blocks(row, [4, 9, 1, 2])


def test_a_grammar_that_can_end_the_output_lifts_min_tokens():
    class Grammar:
        inner = object()

    req = request("a", min_tokens=4)
    req.grammar = Grammar()
    ib = InputBatch(max_rows=1, max_blocks_per_row=2, vocab_size=VOCAB, eos_token_ids=EOS)
    row = ib.add(req, [1])
    assert ib.min_tokens[row] == 0 and row not in ib.extras
