"""InputBatch: every running request's row, kept across steps (vLLM V1's persistent batch).

A request gets a row when it joins the running batch and keeps it until it leaves (finishes
or is preempted). The row holds what changes rarely: the block table (extended only by the
blocks a step adds), the sampling parameters, and on the device the penalty state (output
token counts, prompt-token mask), which the device updates itself from each step's sampled
ids. So a step costs the rows that changed plus O(1) Python per scheduled request; the rest
is a few numpy gathers into fresh per-step arrays.

Threads: the columns are written only on the event loop (``prepare``). The device state is
written only on the device (``execute``), in step order: a row's reset is queued by
``prepare`` and applied by the next ``execute``, after every earlier step has used the row.
Per-step arrays are copies, so the loop may change rows while a step it prepared still runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from asyncengine.core.request import Request
from asyncengine.executor.sampler.batch import GREEDY_EPS, min_tokens_stops


@dataclass
class RowReset:
    """Penalty state for a row that (re)joined: its prompt and the outputs it already has."""

    row: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # The same ids as tensors on the device, staged by ``prepare`` (prompt, outputs or None).
    staged: tuple[torch.Tensor, torch.Tensor | None] | None = None


@dataclass
class RowExtras:
    """Rarely used per-row parameters, kept as tensors once per join."""

    bias_cols: torch.Tensor | None = None
    bias_vals: torch.Tensor | None = None
    min_tokens_stops: list[int] = field(default_factory=list)


class InputBatch:
    def __init__(self, max_rows: int, max_blocks_per_row: int, vocab_size: int,
                 eos_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_blocks = max_blocks_per_row
        self.row_of: dict[str, int] = {}
        self.request_of: list[Request | None] = []
        self._free_rows: list[int] = []
        self.block_table = np.zeros((0, max_blocks_per_row), dtype=np.int64)
        # per row: how many of its table's entries are set
        self.num_blocks = np.zeros(0, dtype=np.int64)
        self.temperature = np.zeros(0, dtype=np.float32)
        self.top_p = np.zeros(0, dtype=np.float32)
        self.top_k = np.zeros(0, dtype=np.int64)
        self.min_p = np.zeros(0, dtype=np.float32)
        self.repetition = np.zeros(0, dtype=np.float32)
        self.presence = np.zeros(0, dtype=np.float32)
        self.frequency = np.zeros(0, dtype=np.float32)
        self.seed = np.zeros(0, dtype=np.int64)
        self.seeded = np.zeros(0, dtype=bool)
        self.penalized = np.zeros(0, dtype=bool)
        self.min_tokens = np.zeros(0, dtype=np.int64)
        self.num_logprobs = np.zeros(0, dtype=np.int64)  # -1: none
        self.any_logprobs = 0  # rows that asked for logprobs
        self.extras: dict[int, RowExtras] = {}
        self.pending_resets: list[RowReset] = []
        # Tensor parallelism: (row, first, block ids) of every table change since the last
        # step, for the workers' copies of the tables (None: not recorded).
        self.table_log: list[tuple[int, int, list[int]]] | None = None
        self._grow(max_rows)

    _COLUMNS = ("block_table", "num_blocks", "temperature", "top_p", "top_k", "min_p",
                "repetition", "presence", "frequency", "seed", "seeded", "penalized",
                "min_tokens", "num_logprobs")

    @property
    def capacity(self) -> int:
        return len(self.request_of)

    def _grow(self, rows: int) -> None:
        old = self.capacity
        for name in self._COLUMNS:
            col = getattr(self, name)
            grown = np.zeros((rows, *col.shape[1:]), dtype=col.dtype)
            grown[:old] = col
            setattr(self, name, grown)
        self.request_of += [None] * (rows - old)
        self._free_rows = list(range(rows - 1, old - 1, -1)) + self._free_rows

    # -- rows in and out (on the loop) -------------------------------------------------------
    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        self.request_of[row] = None
        self.extras.pop(row, None)
        if self.num_logprobs[row] >= 0:
            self.any_logprobs -= 1
        self._free_rows.append(row)

    def add(self, request: Request, block_ids: list[int]) -> int:
        if not self._free_rows:
            self._grow(max(1, 2 * self.capacity))
        row = self._free_rows.pop()
        self.row_of[request.request_id] = row
        self.request_of[row] = request
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        sp = request.sampling_params
        self.temperature[row] = sp.temperature
        self.top_p[row] = sp.top_p
        self.top_k[row] = sp.top_k
        self.min_p[row] = sp.min_p
        self.repetition[row] = sp.repetition_penalty
        self.presence[row] = sp.presence_penalty
        self.frequency[row] = sp.frequency_penalty
        self.num_logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        if sp.logprobs is not None:
            self.any_logprobs += 1
        self.seeded[row] = sp.seed is not None
        self.seed[row] = sp.seed or 0
        # The grammar decides when output may end; holding EOS back for min_tokens could leave
        # a complete grammar with no allowed token at all. (A reasoning gate without an inner
        # grammar, a thinking budget alone, never ends the output: min_tokens holds.)
        grammar = request.grammar
        ends = grammar is not None and getattr(grammar, "inner", grammar) is not None
        self.min_tokens[row] = 0 if ends else sp.min_tokens
        penalized = (sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0
                     or sp.frequency_penalty != 0.0)
        self.penalized[row] = penalized
        if penalized:
            self.pending_resets.append(RowReset(row, list(request.prompt_token_ids),
                                                list(request.output_token_ids)))
        extras = RowExtras()
        if sp.logit_bias:
            biased = [(int(t), float(v)) for t, v in sp.logit_bias.items()
                      if 0 <= int(t) < self.vocab_size]
            if biased:
                extras.bias_cols = torch.tensor([t for t, _ in biased], dtype=torch.long)
                extras.bias_vals = torch.tensor([v for _, v in biased], dtype=torch.float32)
        if self.min_tokens[row]:
            extras.min_tokens_stops = min_tokens_stops(sp, self.eos_token_ids, self.vocab_size)
        if extras.bias_cols is not None or extras.min_tokens_stops:
            self.extras[row] = extras
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        """Copy the blocks of ``block_ids`` (the request's whole table) this row lacks."""
        have = int(self.num_blocks[row])
        n = len(block_ids)
        if n > have:
            if n > self.max_blocks:
                raise ValueError(f"a request holds {n} blocks, more than the "
                                 f"{self.max_blocks} a row of the batch can hold")
            self.block_table[row, have:n] = block_ids[have:]
            self.num_blocks[row] = n
            if self.table_log is not None:
                self.table_log.append((row, have, list(block_ids[have:])))

    def is_greedy(self, rows: np.ndarray) -> np.ndarray:
        return self.temperature[rows] < GREEDY_EPS
