"""The persistent batch's penalty state on the device: per row, output-token counts and the
prompt's tokens, kept by the device itself from each step's sampled ids.

Written only on the device side, in step order: a row's reset (queued by ``prepare`` when a
penalized request joins) is applied by the next step, after every earlier step used the row.
"""

from __future__ import annotations

import torch

from asyncengine.executor.sampler import NO_TOKEN, Penalties
from asyncengine.executor.step.input_batch import RowReset


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts: torch.Tensor | None = None  # [rows, V] int32 output-token counts
        self.prompt_mask: torch.Tensor | None = None  # [rows, V] bool

    def reset(self, resets: list[RowReset], capacity: int) -> None:
        """(Re)start the rows of requests that joined; grow to ``capacity`` rows first."""
        if self.counts is None or self.counts.shape[0] < capacity:
            counts = torch.zeros(capacity, self.vocab_size, dtype=torch.int32,
                                 device=self.device)
            mask = torch.zeros(capacity, self.vocab_size, dtype=torch.bool, device=self.device)
            if self.counts is not None:
                counts[:self.counts.shape[0]] = self.counts
                mask[:self.prompt_mask.shape[0]] = self.prompt_mask
            self.counts, self.prompt_mask = counts, mask
        for r in resets:
            self.counts[r.row].zero_()
            self.prompt_mask[r.row].zero_()
            if r.staged is not None:
                prompt, out = r.staged
            else:
                prompt = torch.tensor(r.prompt_token_ids, dtype=torch.long, device=self.device)
                out = torch.tensor(r.output_token_ids, dtype=torch.long, device=self.device) \
                    if r.output_token_ids else None
            self.prompt_mask[r.row, prompt] = True
            if out is not None:
                self.counts[r.row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def gather(self, penalties: Penalties, rows: torch.Tensor) -> None:
        """Give the step's ``penalties`` the state of its persistent ``rows``."""
        penalties.counts = self.counts.index_select(0, rows)
        if penalties.repetition is not None:
            penalties.prompt_mask = self.prompt_mask.index_select(0, rows)

    def count(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Add the sampled ``ids`` to the ``rows``' counts (rows with no token add nothing)."""
        ok = ids != NO_TOKEN
        self.counts.index_put_((rows[ok], ids[ok]),
                               torch.ones(1, dtype=torch.int32, device=ids.device),
                               accumulate=True)

    def count_no_sync(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """:meth:`count` without a boolean mask (whose size the host would have to read, a
        sync on CUDA): a row with no token adds 0."""
        ok = (ids != NO_TOKEN).to(torch.int32)
        self.counts.index_put_((rows, ids.clamp(min=0)), ok, accumulate=True)
