"""Batched sampling and logprobs on the final logits.

The order of processing is vLLM's: logit bias, min_tokens (stop tokens masked), penalties
(repetition on prompt + output tokens, presence/frequency on output tokens); greedy rows then
take the argmax, the others go through temperature, top-k, top-p and min-p and are sampled.
On CUDA sampling is the exponential race (``argmax(probs / q)``, ``q ~ Exp(1)``, no host sync);
on the CPU, where noise for the whole vocabulary is the dominant cost, it is the inverse CDF
(one uniform per row). Either way a seeded row draws from its own generator, so it samples the
same tokens alone and in any batch.

Logprobs are those of the raw model distribution (``log_softmax`` of the logits before any
processing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import NamedTuple

import torch

from asyncengine.request import Logprob, PositionLogprobs
from asyncengine.sampling_params import SamplingParams

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


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: the sampled token's raw logprob and rank plus the top alternatives, or None.
    logprobs: list[PositionLogprobs | None]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator for a seeded request (None for an unseeded one)."""
    if seed is None:
        return None
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Sample one token per row of ``logits`` (float32 ``[N, V]``); ``logits`` is not modified."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    token_ids = sample_ids(logits, batch)
    want = [i for i, k in enumerate(batch.logprobs) if k is not None]
    logprobs: list[PositionLogprobs | None] = [None] * batch.num_rows
    if want:
        rows = torch.tensor(want, device=logits.device)
        entries = compute_logprobs(logits[rows], token_ids[rows],
                                   [batch.logprobs[i] or 0 for i in want])
        for i, entry in zip(want, entries, strict=True):
            logprobs[i] = entry
    return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)


def sample_ids(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The sampled token ids as a device tensor ``[N]`` (no host synchronization on CUDA)."""
    x = logits
    if batch.needs_processing:
        x = process_logits(logits, batch)
    if batch.all_greedy:
        return x.argmax(dim=-1)
    greedy_ids = x.argmax(dim=-1) if batch.greedy is not None else None
    if batch.temperature is not None:
        x = x / batch.temperature
    elif x is logits:
        x = x.clone()
    if batch.top_k is not None:
        _apply_top_k(x, batch.top_k, batch.max_top_k)
    if batch.top_p is not None:
        _apply_top_p(x, batch)
    probs = torch.softmax(x, dim=-1)
    if batch.min_p is not None:
        top = probs.amax(dim=-1, keepdim=True)
        probs.masked_fill_(probs < batch.min_p * top, 0.0)
    if batch.method == "race":
        sampled = _exponential_race(probs, batch)
    else:
        sampled = _inverse_cdf(probs, batch)
    if greedy_ids is not None:
        sampled = torch.where(batch.greedy, greedy_ids, sampled)
    return sampled


def _exponential_race(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``argmax(probs / q)`` with ``q ~ Exp(1)``: one noise value per token, no sync."""
    q = torch.empty_like(probs)
    if len(batch.generators) < batch.num_rows:
        q.exponential_()
    for i, gen in batch.generators:
        q[i].exponential_(generator=gen)
    # An Exp(1) draw of exactly 0 would turn a zero probability into 0/0 = nan (and argmax
    # picks nan); clamping keeps masked tokens at probability 0.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def _inverse_cdf(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One uniform draw per row, located in the row's cumulative distribution."""
    n = probs.shape[0]
    if len(batch.generators) < n:
        u = torch.rand(n, 1, device=probs.device)
    else:
        u = torch.empty(n, 1, device=probs.device)
    for i, gen in batch.generators:
        u[i] = torch.rand(1, generator=gen, device=probs.device)
    cdf = probs.cumsum_(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the first entry above it is a token of non-zero mass.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """A copy of ``logits`` with logit bias, min_tokens masks and penalties applied."""
    x = logits.clone()
    if batch.bias is not None:
        rows, cols, vals = batch.bias
        x.index_put_((rows, cols), vals, accumulate=True)
    if batch.masked is not None:
        x[batch.masked] = float("-inf")
    pen = batch.penalties
    if pen is not None:
        sub = x[pen.rows]
        counts = None
        if pen.output_index is not None:
            counts = torch.zeros_like(sub)
            ones = torch.ones(pen.output_index[0].numel(), dtype=sub.dtype, device=sub.device)
            counts.index_put_(pen.output_index, ones, accumulate=True)
        if pen.repetition is not None:
            seen = counts > 0 if counts is not None else torch.zeros_like(sub, dtype=torch.bool)
            if pen.prompt_index is not None:
                seen[pen.prompt_index] = True
            rep = pen.repetition.expand_as(sub)
            penalized = torch.where(sub > 0, sub / rep, sub * rep)
            sub = torch.where(seen, penalized, sub)
        if counts is not None:
            if pen.frequency is not None:
                sub = sub - pen.frequency * counts
            if pen.presence is not None:
                sub = sub - pen.presence * (counts > 0).to(sub.dtype)
        x[pen.rows] = sub
    return x


def _apply_top_k(x: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Mask (in place, to -inf) what lies below each row's k-th largest logit."""
    width = min(max_top_k, x.shape[-1])
    k = top_k.clamp(min=1, max=width).unsqueeze(1)
    kth = x.topk(width, dim=-1).values.gather(1, k - 1)
    kth.masked_fill_((top_k <= 0).unsqueeze(1), float("-inf"))
    x.masked_fill_(x < kth, float("-inf"))


def _apply_top_p(x: torch.Tensor, batch: SamplingBatch) -> None:
    """Mask (in place) the tokens outside each row's nucleus: the most likely tokens whose
    preceding mass is at most ``top_p`` (after top-k). The most likely token always stays.

    Sorting the whole vocabulary is slow on the CPU, so there the nucleus is first looked for
    among the top candidates and the full sort is the fallback."""
    vocab = x.shape[-1]
    width = vocab
    if not x.is_cuda:
        width = min(vocab, batch.max_top_k if batch.top_p_within_top_k else _TOP_P_CANDIDATES)
    if width < vocab:
        vals = x.topk(width, dim=-1).values
        drop = _nucleus_drop(vals, x, batch.top_p)
        # A row is settled if its cut falls among the candidates, or top-k already masked
        # everything past them, or it has no top-p.
        settled = drop[:, -1] | (batch.top_p.squeeze(1) > 1)
        if batch.top_k is not None:
            settled |= (batch.top_k > 0) & (batch.top_k <= width)
        if not bool(settled.all()):
            width = vocab
    if width == vocab:
        vals = x.sort(dim=-1, descending=True).values
        drop = _nucleus_drop(vals, x, batch.top_p)
    # Ties with the smallest kept logit are kept too.
    smallest_kept = vals.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)
    smallest_kept.masked_fill_(batch.top_p > 1, float("-inf"))  # rows without top-p
    x.masked_fill_(x < smallest_kept, float("-inf"))


def _nucleus_drop(sorted_vals: torch.Tensor, x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    probs = torch.exp(sorted_vals - torch.logsumexp(x, dim=-1, keepdim=True))
    before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    return before > top_p


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     num_top: Sequence[int]) -> list[PositionLogprobs]:
    """For each row: ``{token: Logprob}`` holding the given token's logprob and rank (1 + the
    number of tokens strictly more likely) and the row's ``num_top[i]`` most likely tokens
    with ranks 1..k, from ``log_softmax(logits)``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids.view(-1, 1).long())
    ranks = (lp > chosen).sum(dim=-1) + 1
    max_k = max(num_top, default=0)
    top_vals = top_ids = None
    if max_k > 0:
        top_vals, top_ids = lp.topk(max_k, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out: list[PositionLogprobs] = []
    for i, (tok, val, rank) in enumerate(zip(token_ids.tolist(), chosen.view(-1).tolist(),
                                             ranks.tolist(), strict=True)):
        entry: PositionLogprobs = {tok: Logprob(val, rank)}
        for r in range(num_top[i]):
            tid = top_ids[i][r]
            if tid not in entry:
                entry[tid] = Logprob(top_vals[i][r], r + 1)
        out.append(entry)
    return out


def prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor | Sequence[int],
                    k: int) -> list[PositionLogprobs]:
    """Logprobs of prompt tokens: row ``i`` of ``logits`` [P, V] predicts ``next_token_ids[i]``;
    each entry holds that token's logprob and rank plus the top ``k`` alternatives."""
    ids = torch.as_tensor(next_token_ids, device=logits.device)
    return compute_logprobs(logits, ids, [k] * logits.shape[0])
