"""Rank 0's step message to the workers: only what changed, one int64 tensor.

Each worker keeps its own copy of the persistent batch's block tables
(:class:`BlockTableMirror`). Per step, rank 0 broadcasts a fixed header and then one body::

    header [8]: kind, T (tokens), R (requests), D (table-delta length), S (sampled rows),
                P (prompt-logprob ranges), 0, 0
    body:       input_ids [T] | rows [R] | starts [R] | lens [R] | table deltas [D]
                | sample indices [S] | prompt-logprob ranges [2P]

A table delta is ``row, first, count, block ids...``: the blocks a row gained this step
(a whole table when a request joins, one block now and then while it decodes). The worker
rebuilds positions, slot mapping and block tables from them with the same numpy gathers as
``runner.prepare``. ``input_ids`` is the only part filled at execute time, on the device's
thread: tokens still in flight (async scheduling) are known there, and only there, since
rank 0 alone samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncengine.executor.attention.base import AttentionBackend, AttentionMetadata

STEP, STOP = 1, 2
HEADER = 8


@dataclass
class StepMessage:
    """The part of a step message known when the step is prepared (all but the ids)."""

    header: np.ndarray  # [HEADER] int64
    tail: np.ndarray  # rows .. ranges, int64

    def body(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([input_ids.to("cpu", torch.int64), torch.from_numpy(self.tail)])


def encode_step(num_tokens: int, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                deltas: list[tuple[int, int, list[int]]], sample_indices: np.ndarray,
                ranges: list[tuple[int, int]]) -> StepMessage:
    flat: list[int] = []
    for row, first, ids in deltas:
        flat += (row, first, len(ids))
        flat += ids
    tail = np.concatenate([rows, starts, lens, np.asarray(flat, dtype=np.int64),
                           sample_indices.astype(np.int64, copy=False),
                           np.asarray(ranges, dtype=np.int64).reshape(-1)])
    header = np.array([STEP, num_tokens, len(rows), len(flat), len(sample_indices),
                       len(ranges), 0, 0], dtype=np.int64)
    return StepMessage(header, tail)


def stop_header() -> torch.Tensor:
    header = torch.zeros(HEADER, dtype=torch.int64)
    header[0] = STOP
    return header


@dataclass
class DecodedStep:
    input_ids: torch.Tensor
    rows: np.ndarray
    starts: np.ndarray
    lens: np.ndarray
    deltas: np.ndarray
    sample_indices: torch.Tensor
    ranges: list[tuple[int, int]]


def body_length(header: torch.Tensor) -> int:
    _, t, r, d, s, p = (int(x) for x in header[:6])
    return t + 3 * r + d + s + 2 * p


def decode_step(header: torch.Tensor, body: torch.Tensor) -> DecodedStep:
    _, t, r, d, s, p = (int(x) for x in header[:6])
    arr = body.numpy()
    cut = np.cumsum([t, r, r, r, d, s])
    ranges = arr[cut[5]:cut[5] + 2 * p].reshape(p, 2).tolist()
    return DecodedStep(input_ids=body[:t], rows=arr[cut[0]:cut[1]], starts=arr[cut[1]:cut[2]],
                       lens=arr[cut[2]:cut[3]], deltas=arr[cut[3]:cut[4]],
                       sample_indices=body[cut[4]:cut[5]], ranges=[tuple(x) for x in ranges])


class BlockTableMirror:
    """A worker's copy of the persistent batch's block tables, kept by the deltas."""

    def __init__(self, max_blocks: int) -> None:
        self.table = np.zeros((0, max_blocks), dtype=np.int64)

    def apply(self, deltas: np.ndarray) -> None:
        i = 0
        while i < len(deltas):
            row, first, count = (int(x) for x in deltas[i:i + 3])
            if row >= len(self.table):
                grown = np.zeros((max(row + 1, 2 * len(self.table)), self.table.shape[1]),
                                 dtype=np.int64)
                grown[:len(self.table)] = self.table
                self.table = grown
            self.table[row, first:first + count] = deltas[i + 3:i + 3 + count]
            i += 3 + count

    def metadata(self, step: DecodedStep, block_size: int, backend: AttentionBackend,
                 device: torch.device) -> tuple[torch.Tensor, AttentionMetadata]:
        """(positions, attention metadata) of the step, as ``runner.prepare`` builds them."""
        rows, starts, lens, bs = step.rows, step.starts, step.lens, block_size
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        total = int(cu[-1])
        positions = np.repeat(starts - cu[:-1], lens) + np.arange(total, dtype=np.int64)
        slots = self.table[np.repeat(rows, lens), positions // bs] * bs + positions % bs
        seq_lens = starts + lens
        width = int((seq_lens.max() + bs - 1) // bs) if len(rows) else 0
        table = self.table[rows, :width]
        # a verification's rows share their request's row, one after another
        requests = int(np.count_nonzero(rows[1:] != rows[:-1])) + 1 if len(rows) else 0
        meta = AttentionMetadata(
            query_start_loc=cu.tolist(), seq_lens=seq_lens.tolist(),
            block_tables=(torch.from_numpy(table).to(device)
                          if backend.needs_block_tables_tensor else None),
            slot_mapping=torch.from_numpy(slots).to(device), block_size=bs,
            block_tables_host=table, requests=requests if requests < len(rows) else None)
        backend.prepare(meta)
        return torch.from_numpy(positions).to(device), meta
