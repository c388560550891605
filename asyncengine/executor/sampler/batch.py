"""SamplingBatch: one step's sampling parameters as tensors, one row per sampled request.

Two ways to make one: :meth:`SamplingBatch.build` from per-row ``SamplingParams`` and token
lists (the offline path, and tests), and the persistent input batch
(``asyncengine.executor.step.input_batch``), which keeps every request's parameters in preallocated
columns and its penalty state on the device, and gathers a step's rows with a few indexing
ops. Either way the sampler sees the same fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import NamedTuple

import torch

from asyncengine.core.sampling_params import SamplingParams
from asyncengine.executor.kernels.where import on_host

#: ``temperature`` below this is greedy (as ``SamplingParams.greedy``).
GREEDY_EPS = 1e-5
#: How sampled rows draw (see ``SamplingBatch.method``).
METHODS = ("race", "cdf", "flashinfer")


def default_method(device: torch.device | str) -> str:
    """How a batch draws unless the runner says: the inverse CDF in host memory (one pass,
    the cheapest there), the exponential race elsewhere (no host sync: ``sampler.py``)."""
    return "cdf" if on_host(device) else "race"


class SamplingRow(NamedTuple):
    """One row of the logits: the request's params and its tokens so far. A seeded row draws
    its noise from (seed, number of output tokens so far)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass
class Penalties:
    """Repetition (prompt + output tokens), presence and frequency (output tokens) penalties
    of the rows that have any. Token occurrences come either dense (``counts`` [P, V] and
    ``prompt_mask`` [P, V], the persistent batch's device state) or as flat (row, token) index
    pairs (``output_index``, ``prompt_index``), made dense when applied."""

    rows: torch.Tensor  # [P] row indices
    repetition: torch.Tensor | None = None  # [P, 1]
    presence: torch.Tensor | None = None  # [P, 1]
    frequency: torch.Tensor | None = None  # [P, 1]
    counts: torch.Tensor | None = None  # [P, V] output-token occurrences
    prompt_mask: torch.Tensor | None = None  # [P, V] bool: in the prompt
    output_index: tuple[torch.Tensor, torch.Tensor] | None = None
    prompt_index: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class SamplingBatch:
    num_rows: int
    all_greedy: bool
    greedy: torch.Tensor | None = None  # [N] bool, when some rows are greedy
    temperature: torch.Tensor | None = None  # [N, 1]
    top_k: torch.Tensor | None = None  # [N]; <= 0 = disabled
    max_top_k: int = 0
    top_p: torch.Tensor | None = None  # [N, 1]; inf = disabled
    top_p_within_top_k: bool = False
    min_p: torch.Tensor | None = None  # [N, 1]
    # Entries set to -inf (min_tokens) and entries biased: flat (row, token) index pairs.
    masked: tuple[torch.Tensor, torch.Tensor] | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None
    # Seeded rows: their indices, seeds and counters (output tokens so far), int64 [K].
    seeded_rows: torch.Tensor | None = None
    seeds: torch.Tensor | None = None
    counters: torch.Tensor | None = None
    # Requested number of top logprobs per row (None: no logprobs).
    logprobs: list[int | None] = field(default_factory=list)
    # How sampled rows draw: "race" (exponential race, one noise value per token: no host
    # sync, the CUDA default) or "cdf" (inverse CDF, one uniform per row: the CPU default,
    # where generating noise for the whole vocabulary costs more than the rest together), or
    # "flashinfer" (CUDA: FlashInfer's kernels where the batch allows, else "race").
    method: str = "cdf"

    @property
    def needs_processing(self) -> bool:
        return self.masked is not None or self.bias is not None or self.penalties is not None

    @classmethod
    def build(cls, rows: Sequence[SamplingRow | tuple], *, device: torch.device | str = "cpu",
              eos_token_ids: frozenset[int] | set[int] = frozenset(),
              vocab_size: int | None = None, method: str | None = None) -> SamplingBatch:
        """Rows are ``(params, prompt_token_ids, output_token_ids)``. ``eos_token_ids`` are
        masked, with ``params.stop_token_ids``, until a row has ``min_tokens`` outputs (unless
        ``ignore_eos``). Token ids at or past ``vocab_size`` in ``logit_bias`` or
        ``stop_token_ids`` are ignored."""
        rows = [SamplingRow(*r[:3]) for r in rows]
        params = [r.params for r in rows]

        def tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype, device=device)

        batch = cls.from_columns(
            temperature=[p.temperature for p in params], top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params], min_p=[p.min_p for p in params],
            seeds=[p.seed for p in params], counters=[len(r.output_token_ids) for r in rows],
            logprobs=[p.logprobs for p in params], device=device, method=method)
        mask_rows: list[int] = []
        mask_cols: list[int] = []
        for i, (p, r) in enumerate(zip(params, rows, strict=True)):
            if len(r.output_token_ids) < p.min_tokens:
                cols = min_tokens_stops(p, eos_token_ids, vocab_size)
                mask_rows += [i] * len(cols)
                mask_cols += cols
        if mask_rows:
            batch.masked = (tensor(mask_rows, torch.long), tensor(mask_cols, torch.long))
        biased = [(i, t, v) for i, p in enumerate(params) if p.logit_bias
                  for t, v in p.logit_bias.items()
                  if 0 <= int(t) and (vocab_size is None or int(t) < vocab_size)]
        if biased:
            b_rows, b_cols, b_vals = zip(*biased, strict=True)
            batch.bias = (tensor(list(b_rows), torch.long), tensor([int(c) for c in b_cols],
                                                                   torch.long),
                          tensor([float(v) for v in b_vals], torch.float32))
        batch.penalties = _penalties_from_lists(rows, tensor)
        return batch

    @classmethod
    def from_columns(cls, *, temperature: Sequence[float], top_k: Sequence[int],
                     top_p: Sequence[float], min_p: Sequence[float],
                     seeds: Sequence[int | None], counters: Sequence[int],
                     logprobs: list[int | None], device: torch.device | str = "cpu",
                     method: str | None = None) -> SamplingBatch:
        """The filters and seeds of a batch from per-row values (no masks or penalties)."""
        if method is None:
            method = default_method(device)
        elif method not in METHODS:
            raise ValueError(f"sampling method must be one of {', '.join(METHODS)}, got "
                             f"{method!r}")
        greedy = [t < GREEDY_EPS for t in temperature]
        batch = cls(num_rows=len(greedy), all_greedy=all(greedy), logprobs=logprobs,
                    method=method)
        if batch.all_greedy:
            return batch

        def tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype, device=device)

        if any(greedy):
            batch.greedy = tensor(greedy, torch.bool)
        temps = [1.0 if g else t for t, g in zip(temperature, greedy, strict=True)]
        if any(t != 1.0 for t in temps):
            batch.temperature = tensor(temps, torch.float32).unsqueeze(1)
        if any(k > 0 for k in top_k):
            batch.top_k = tensor(list(top_k), torch.long)
            batch.max_top_k = max(top_k)
        if any(p < 1.0 for p in top_p):
            # inf for disabled rows: a float cumsum may exceed 1.0 and must not cut their tail.
            batch.top_p = tensor([p if p < 1.0 else float("inf") for p in top_p],
                                 torch.float32).unsqueeze(1)
            batch.top_p_within_top_k = all(k > 0 for k, p in zip(top_k, top_p, strict=True)
                                           if p < 1.0)
        if any(m > 0.0 for m in min_p):
            batch.min_p = tensor(list(min_p), torch.float32).unsqueeze(1)
        seeded = [i for i, s in enumerate(seeds) if s is not None and not greedy[i]]
        if seeded:
            batch.seeded_rows = tensor(seeded, torch.long)
            batch.seeds = tensor([seeds[i] for i in seeded], torch.long)
            batch.counters = tensor([counters[i] for i in seeded], torch.long)
        return batch


def min_tokens_stops(params: SamplingParams, eos_token_ids: frozenset[int] | set[int],
                     vocab_size: int | None) -> list[int]:
    """The tokens held back until a request has ``min_tokens`` outputs."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    return [t for t in stops if 0 <= t and (vocab_size is None or t < vocab_size)]


def _penalties_from_lists(rows: list[SamplingRow], tensor) -> Penalties | None:
    idx = [i for i, r in enumerate(rows)
           if r.params.repetition_penalty != 1.0 or r.params.presence_penalty != 0.0
           or r.params.frequency_penalty != 0.0]
    if not idx:
        return None
    ps = [rows[i].params for i in idx]

    def column(values: list[float], neutral: float) -> torch.Tensor | None:
        if all(v == neutral for v in values):
            return None
        return tensor(values, torch.float32).unsqueeze(1)

    def pairs(seqs: list[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not any(seqs):
            return None
        row = list(chain.from_iterable([j] * len(s) for j, s in enumerate(seqs)))
        return tensor(row, torch.long), tensor(list(chain.from_iterable(seqs)), torch.long)

    repetition = column([p.repetition_penalty for p in ps], 1.0)
    return Penalties(
        rows=tensor(idx, torch.long),
        repetition=repetition,
        presence=column([p.presence_penalty for p in ps], 0.0),
        frequency=column([p.frequency_penalty for p in ps], 0.0),
        prompt_index=pairs([rows[i].prompt_token_ids for i in idx]) if repetition is not None
        else None,
        output_index=pairs([rows[i].output_token_ids for i in idx]),
    )
