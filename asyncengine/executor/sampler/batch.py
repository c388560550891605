"""SamplingBatch: a step's sampling parameters as tensors, built from one row per request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import NamedTuple

import torch

from asyncengine.core.sampling_params import SamplingParams

# Candidates searched for the top-p nucleus on the CPU before falling back to a full sort.
_TOP_P_CANDIDATES = 1024


class SamplingRow(NamedTuple):
    """One row of the logits: the request's params, tokens so far and seeded generator."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None


@dataclass
class _Penalties:
    rows: torch.Tensor  # [P] row indices
    repetition: torch.Tensor | None  # [P, 1]
    presence: torch.Tensor | None  # [P, 1]
    frequency: torch.Tensor | None  # [P, 1]
    prompt_index: tuple[torch.Tensor, torch.Tensor] | None  # (penalty row, token id) pairs
    output_index: tuple[torch.Tensor, torch.Tensor] | None


@dataclass
class SamplingBatch:
    """The per-step sampling tensors of a batch, built once by :meth:`build`. A field is None
    when no row needs it, so a plain batch (greedy, or temperature only) costs almost nothing."""

    num_rows: int
    all_greedy: bool
    greedy: torch.Tensor | None = None  # [N] bool, when greedy and sampled rows are mixed
    temperature: torch.Tensor | None = None  # [N, 1]; 1.0 for greedy rows
    top_k: torch.Tensor | None = None  # [N] int64; 0 = disabled
    max_top_k: int = 0
    top_p_within_top_k: bool = False  # every row with top-p also has a top-k
    top_p: torch.Tensor | None = None  # [N, 1]; inf = disabled
    min_p: torch.Tensor | None = None  # [N, 1]
    # Entries set to -inf (min_tokens) and entries biased: flat (row, token) index pairs.
    masked: tuple[torch.Tensor, torch.Tensor] | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: _Penalties | None = None
    generators: list[tuple[int, torch.Generator]] = field(default_factory=list)
    # Requested number of top logprobs per row (None: no logprobs).
    logprobs: list[int | None] = field(default_factory=list)
    # How sampled rows draw: "race" (exponential race, one noise value per token: no host
    # sync, the CUDA default) or "cdf" (inverse CDF, one uniform per row: the CPU default,
    # where generating noise for the whole vocabulary costs more than the rest together).
    method: str = "cdf"

    @property
    def needs_processing(self) -> bool:
        return self.masked is not None or self.bias is not None or self.penalties is not None

    @classmethod
    def build(cls, rows: Sequence[SamplingRow | tuple], *, device: torch.device | str = "cpu",
              eos_token_ids: frozenset[int] | set[int] = frozenset(),
              vocab_size: int | None = None, method: str | None = None) -> SamplingBatch:
        """Rows are ``(params, prompt_token_ids, output_token_ids, generator)``.
        ``eos_token_ids`` are masked, with ``params.stop_token_ids``, until a row has
        ``min_tokens`` outputs (unless ``ignore_eos``). Token ids at or past ``vocab_size`` in
        ``logit_bias`` or ``stop_token_ids`` are ignored."""
        rows = [r if isinstance(r, SamplingRow) else SamplingRow(*r) for r in rows]
        n = len(rows)
        params = [r.params for r in rows]
        greedy = [p.greedy for p in params]
        if method is None:
            method = "race" if torch.device(device).type == "cuda" else "cdf"
        elif method not in ("race", "cdf"):
            raise ValueError(f"sampling method must be 'race' or 'cdf', got {method!r}")
        batch = cls(num_rows=n, all_greedy=all(greedy), logprobs=[p.logprobs for p in params],
                    method=method)

        def in_vocab(t: int) -> bool:
            return 0 <= t and (vocab_size is None or t < vocab_size)

        def tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype, device=device)

        # min_tokens and logit bias
        mask_rows: list[int] = []
        mask_cols: list[int] = []
        bias_rows: list[int] = []
        bias_cols: list[int] = []
        bias_vals: list[float] = []
        for i, (p, r) in enumerate(zip(params, rows, strict=True)):
            if len(r.output_token_ids) < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                cols = [t for t in stops if in_vocab(t)]
                mask_rows += [i] * len(cols)
                mask_cols += cols
            if p.logit_bias:
                for t, v in p.logit_bias.items():
                    if in_vocab(int(t)):
                        bias_rows.append(i)
                        bias_cols.append(int(t))
                        bias_vals.append(float(v))
        if mask_rows:
            batch.masked = (tensor(mask_rows, torch.long), tensor(mask_cols, torch.long))
        if bias_rows:
            batch.bias = (tensor(bias_rows, torch.long), tensor(bias_cols, torch.long),
                          tensor(bias_vals, torch.float32))
        batch.penalties = _build_penalties(rows, tensor)

        if batch.all_greedy:
            return batch
        if any(greedy):
            batch.greedy = tensor(greedy, torch.bool)
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        if any(t != 1.0 for t in temps):
            batch.temperature = tensor(temps, torch.float32).unsqueeze(1)
        if any(p.top_k > 0 for p in params):
            batch.top_k = tensor([p.top_k for p in params], torch.long)
            batch.max_top_k = max(p.top_k for p in params)
        if any(p.top_p < 1.0 for p in params):
            # inf for disabled rows: a float cumsum may exceed 1.0 and must not cut their tail.
            top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
            batch.top_p = tensor(top_p, torch.float32).unsqueeze(1)
            batch.top_p_within_top_k = all(p.top_k > 0 for p in params if p.top_p < 1.0)
        if any(p.min_p > 0.0 for p in params):
            batch.min_p = tensor([p.min_p for p in params], torch.float32).unsqueeze(1)
        batch.generators = [(i, r.generator) for i, r in enumerate(rows)
                            if r.generator is not None and not greedy[i]]
        return batch


def _build_penalties(rows: list[SamplingRow], tensor) -> _Penalties | None:
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
    return _Penalties(
        rows=tensor(idx, torch.long),
        repetition=repetition,
        presence=column([p.presence_penalty for p in ps], 0.0),
        frequency=column([p.frequency_penalty for p in ps], 0.0),
        prompt_index=pairs([rows[i].prompt_token_ids for i in idx]) if repetition is not None
        else None,
        output_index=pairs([rows[i].output_token_ids for i in idx]),
    )


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator for a seeded request (None for an unseeded one)."""
    if seed is None:
        return None
    return torch.Generator(device=torch.device(device)).manual_seed(seed)
