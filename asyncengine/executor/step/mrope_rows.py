"""A step's M-RoPE positions (Qwen2-VL): what ``runner.prepare`` hands the model instead of
the tokens' sequence positions, for a model whose decoder turns by M-RoPE
(``models/mrope.py``). Only such a model's runner has one; every other model's step is
untouched.

A request's prompt positions were computed once, when its prompt was prepared
(``models/mrope_positions.RopePositions``: a ``[3, P]`` table and the ``delta`` past it).
Per step:

* every token at its sequence position plus its row's delta (one gather over the step's
  tokens: a decode step is this alone);
* the requests whose prompt is not all computed yet (``pending``, few: those prefilling)
  take their chunk's slice of their table instead;
* the positions are ``[T]`` unless the step computes image placeholders, whose three
  positions differ: then ``[3, T]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class MRopeRows:
    def __init__(self, capacity: int) -> None:
        self.delta = np.zeros(capacity, dtype=np.int64)  # by persistent row
        self.pending: dict[str, Any] = {}  # request id -> the request (its table to read)

    def join(self, req: Any, row: int) -> None:
        """A request took persistent ``row`` (it joined, or came back after preemption)."""
        rope = req.rope_positions
        if row >= len(self.delta):  # (the persistent batch grew)
            self.delta = np.concatenate([self.delta, np.zeros(max(row + 1, 2 * len(
                self.delta)) - len(self.delta), dtype=np.int64)])
        self.delta[row] = 0 if rope is None else rope.delta
        if rope is not None:
            self.pending[req.request_id] = req

    def leave(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def positions(self, positions: np.ndarray, row_of_token: np.ndarray, rows: np.ndarray,
                  starts: np.ndarray, lens: np.ndarray, firsts: np.ndarray,
                  row_of: dict[str, int]) -> np.ndarray:
        """The step's positions for the model: ``positions`` (sequence positions, ``[T]``)
        shifted by each row's delta, prompt chunks from their tables; ``[3, T]`` when an
        image's placeholders are among them. ``rows``, ``starts``, ``lens``, ``firsts``:
        per attention row, its persistent row, first position, tokens and first index in
        the step; ``row_of``: request id -> persistent row."""
        out = positions + self.delta[row_of_token]
        if not self.pending:
            return out
        three: np.ndarray | None = None
        for rid, req in list(self.pending.items()):
            found = np.flatnonzero(rows == row_of.get(rid, -1))
            if not len(found):
                continue  # not in this step
            i = int(found[0])
            table = req.rope_positions.table
            start, end = int(starts[i]), int(starts[i] + lens[i])
            if end >= table.shape[1]:
                del self.pending[rid]  # its prompt is computed with this chunk
            stop = min(end, table.shape[1])
            if start >= stop:
                continue
            piece = table[:, start:stop]
            first = int(firsts[i])
            if three is None and (piece[1:] != piece[0]).any():
                three = np.broadcast_to(out, (3, len(out))).copy()
            if three is not None:
                three[:, first:first + stop - start] = piece
            out[first:first + stop - start] = piece[0]
        return out if three is None else three
