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

from dataclasses import dataclass

import torch

from asyncengine.core.request import PositionLogprobs
from asyncengine.executor.sampler.batch import SamplingBatch
from asyncengine.executor.sampler.logprobs import compute_logprobs
from asyncengine.executor.sampler.processing import apply_top_k, apply_top_p, process_logits


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: the sampled token's raw logprob and rank plus the top alternatives, or None.
    logprobs: list[PositionLogprobs | None]


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
        apply_top_k(x, batch.top_k, batch.max_top_k)
    if batch.top_p is not None:
        apply_top_p(x, batch)
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
