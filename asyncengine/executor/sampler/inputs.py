"""A step's SamplingBatch, gathered from the persistent batch's columns with numpy.

The common cases cost a few vectorized gathers: an all-greedy step with no logit processing
returns at once; seeds, filters and penalty coefficients are column gathers. Only rows that
use rare features (logit bias, min_tokens still in force) are visited one by one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from asyncengine.executor.sampler.batch import Penalties, SamplingBatch, default_method
from asyncengine.executor.step.input_batch import InputBatch

_NUMPY = {torch.bool: np.bool_, torch.long: np.int64, torch.float32: np.float32}


def gather_sampling_batch(ib: InputBatch, rows: np.ndarray, counters: np.ndarray,
                          device: torch.device,
                          put: Callable[[np.ndarray], torch.Tensor] | None = None,
                          method: str | None = None
                          ) -> tuple[SamplingBatch, torch.Tensor | None]:
    """The batch for the persistent ``rows`` being sampled (in step order), and the persistent
    rows of those with penalties (to gather the device's penalty state), or None.
    ``counters[i]``: the output position of the token row ``i`` samples. ``put`` turns an
    array into a tensor on ``device`` (the runner's staging; default: a copy). ``method``:
    how sampled rows draw (default: ``race`` on CUDA, ``cdf`` on the CPU)."""
    n = len(rows)
    logprobs = [None if k < 0 else int(k) for k in ib.num_logprobs[rows].tolist()] \
        if ib.any_logprobs else [None] * n

    if put is None:
        def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)
    else:
        def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return put(np.ascontiguousarray(a, dtype=_NUMPY[dtype]))

    temperature = ib.temperature[rows]
    greedy = ib.is_greedy(rows)
    if method is None:
        method = default_method(device)
    batch = SamplingBatch(num_rows=n, all_greedy=bool(greedy.all()), logprobs=logprobs,
                          method=method)
    if not batch.all_greedy:
        if greedy.any():
            batch.greedy = t(greedy, torch.bool)
        temps = np.where(greedy, 1.0, temperature)
        if (temps != 1.0).any():
            batch.temperature = t(temps, torch.float32).unsqueeze(1)
        top_k = ib.top_k[rows]
        if (top_k > 0).any():
            batch.top_k = t(top_k, torch.long)
            batch.max_top_k = int(top_k.max())
        top_p = ib.top_p[rows]
        cut = top_p < 1.0
        if cut.any():
            batch.top_p = t(np.where(cut, top_p, np.inf), torch.float32).unsqueeze(1)
            batch.top_p_within_top_k = bool((top_k[cut] > 0).all())
        min_p = ib.min_p[rows]
        if (min_p > 0).any():
            batch.min_p = t(min_p, torch.float32).unsqueeze(1)
        seeded = np.nonzero(ib.seeded[rows] & ~greedy)[0]
        if len(seeded):
            batch.seeded_rows = t(seeded, torch.long)
            batch.seeds = t(ib.seed[rows[seeded]], torch.long)
            batch.counters = t(counters[seeded], torch.long)
    if ib.extras:
        _rare_rows(ib, rows, counters, batch, device, put)
    penalty_rows = None
    pen = np.nonzero(ib.penalized[rows])[0]
    if len(pen):
        prow = rows[pen]
        batch.penalties = Penalties(
            rows=t(pen, torch.long),
            repetition=_column(ib.repetition[prow], 1.0, t),
            presence=_column(ib.presence[prow], 0.0, t),
            frequency=_column(ib.frequency[prow], 0.0, t),
        )
        penalty_rows = t(prow, torch.long)
    return batch, penalty_rows


def _column(values: np.ndarray, neutral: float, t) -> torch.Tensor | None:
    if (values == neutral).all():
        return None
    return t(values, torch.float32).unsqueeze(1)


def _rare_rows(ib: InputBatch, rows: np.ndarray, counters: np.ndarray, batch: SamplingBatch,
               device: torch.device,
               put: Callable[[np.ndarray], torch.Tensor] | None) -> None:
    """Logit bias and min_tokens masks: flat (row, token) pairs for the rows that have them."""
    mask_rows: list[torch.Tensor] = []
    mask_cols: list[torch.Tensor] = []
    bias_rows: list[torch.Tensor] = []
    bias_cols: list[torch.Tensor] = []
    bias_vals: list[torch.Tensor] = []
    for i, row in enumerate(rows.tolist()):
        extras = ib.extras.get(row)
        if extras is None:
            continue
        if extras.min_tokens_stops and counters[i] < ib.min_tokens[row]:
            cols = torch.tensor(extras.min_tokens_stops, dtype=torch.long)
            mask_rows.append(torch.full_like(cols, i))
            mask_cols.append(cols)
        if extras.bias_cols is not None:
            bias_rows.append(torch.full_like(extras.bias_cols, i))
            bias_cols.append(extras.bias_cols)
            bias_vals.append(extras.bias_vals)
    def dev(parts: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat(parts)
        return flat.to(device) if put is None else put(flat.numpy())

    if mask_rows:
        batch.masked = (dev(mask_rows), dev(mask_cols))
    if bias_rows:
        batch.bias = (dev(bias_rows), dev(bias_cols), dev(bias_vals))
