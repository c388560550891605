"""Batched sampling on the final logits.

The order of processing is vLLM's: logit bias, min_tokens (stop tokens masked), penalties
(repetition on prompt + output tokens, presence/frequency on output tokens); greedy rows then
take the argmax, the others go through temperature, top-k, top-p and min-p and are sampled.
On CUDA with FlashInfer installed, batches it can sample go through its fused top-k/top-p
kernels (``flashinfer_sampling.py``: no vocabulary sort); otherwise sampling on CUDA is the
exponential race (``argmax(probs / q)``, ``q ~ Exp(1)``, no host sync); on the CPU, where
noise for the whole vocabulary is the dominant cost, it is the inverse CDF (one uniform per
row). Seeded rows take their noise from a counter-based hash of (seed,
output position) (``noise.py``), so they sample the same tokens alone and in any batch, with
no per-row generator or kernel.

A row with no valid probability mass (NaN or infinite logits after processing, everything
masked by a grammar) gets the id ``-1`` instead of a token: the scheduler ends that request
alone with an error. The sampler never returns an id outside ``[0, vocab)`` otherwise. The
checks cost O(rows), not O(rows x vocab): they look at the chosen logit, or at the row's
total mass.

Logprobs are those of the raw model distribution (``log_softmax`` of the logits before any
processing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncengine.core.request import PositionLogprobs
from asyncengine.executor.sampler.argmax import greedy_rows
from asyncengine.executor.sampler.batch import SamplingBatch
from asyncengine.executor.sampler.flashinfer_sampling import (
    sample_with_flashinfer,
    unsupported_reason,
)
from asyncengine.executor.sampler.logprobs import compute_logprobs
from asyncengine.executor.sampler.noise import seeded_uniform
from asyncengine.executor.sampler.processing import apply_top_k, apply_top_p, process_logits

#: The id of a row that had no valid token.
NO_TOKEN = -1


@dataclass
class SamplerOutput:
    token_ids: list[int]  # NO_TOKEN for a row with no valid token
    # Per row: the sampled token's raw logprob and rank plus the top alternatives, or None.
    logprobs: list[PositionLogprobs | None]
    token_ids_tensor: torch.Tensor | None = None  # [N] on the logits' device


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Sample one token per row of ``logits`` (float32 ``[N, V]``); ``logits`` is not modified."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    token_ids = sample_ids(logits, batch)
    want = [i for i, k in enumerate(batch.logprobs) if k is not None]
    logprobs: list[PositionLogprobs | None] = [None] * batch.num_rows
    ids = token_ids.tolist()
    if want:
        rows = torch.tensor(want, device=logits.device)
        chosen = token_ids[rows].clamp(min=0)
        entries = compute_logprobs(logits[rows], chosen, [batch.logprobs[i] or 0 for i in want])
        for i, entry in zip(want, entries, strict=True):
            if ids[i] != NO_TOKEN:
                logprobs[i] = entry
    return SamplerOutput(token_ids=ids, logprobs=logprobs, token_ids_tensor=token_ids)


def sample_ids(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The sampled token ids as a device tensor ``[N]`` (no host synchronization on CUDA);
    ``NO_TOKEN`` for rows with no valid token."""
    x = logits
    if batch.needs_processing:
        x = process_logits(logits, batch)
    if batch.all_greedy:
        return _greedy(x)
    greedy_ids = _greedy(x) if batch.greedy is not None else None
    if batch.temperature is not None:
        x = x / batch.temperature
    elif x is logits:
        x = x.clone()
    if batch.method == "flashinfer" and unsupported_reason(batch) is None:
        sampled = sample_with_flashinfer(x, batch)
    else:
        sampled = _sample_torch(x, batch)
    if greedy_ids is not None:
        sampled = torch.where(batch.greedy, greedy_ids, sampled)
    return sampled


def _sample_torch(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Top-k, top-p, min-p, then the draw, on temperature-scaled logits ``x`` (a copy)."""
    if batch.top_k is not None:
        apply_top_k(x, batch.top_k, batch.max_top_k)
    if batch.top_p is not None:
        apply_top_p(x, batch)
    probs = torch.softmax(x, dim=-1)
    if batch.min_p is not None:
        top = probs.amax(dim=-1, keepdim=True)
        probs.masked_fill_(probs < batch.min_p * top, 0.0)
    if batch.method == "cdf":
        return _inverse_cdf(probs, batch)
    return _exponential_race(probs, batch)  # race, and flashinfer's fallback


def _greedy(x: torch.Tensor) -> torch.Tensor:
    # A NaN, an all -inf row, or a +inf logit (the numbers broke): no token.
    return greedy_rows(x, NO_TOKEN)


def _noise(batch: SamplingBatch, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Uniforms in (0, 1): the global generator's for unseeded rows, (seed, position)'s for
    seeded ones. ``shape`` is ``(N, 1)`` (one per row) or ``(N, V)`` (one per token)."""
    n, width = shape
    if batch.seeded_rows is not None and batch.seeded_rows.numel() == n:
        u = torch.empty(shape, device=device)
    else:
        u = torch.rand(shape, device=device)
    if batch.seeded_rows is not None:
        seeded = seeded_uniform(batch.seeds, batch.counters, None if width == 1 else width)
        u[batch.seeded_rows] = seeded.view(-1, width)
    return u


def _exponential_race(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``argmax(probs / q)`` with ``q ~ Exp(1)``: one noise value per token, no sync."""
    q = _noise(batch, tuple(probs.shape), probs.device).log_().neg_()
    # An Exp(1) draw of exactly 0 would turn a zero probability into 0/0 = nan (and argmax
    # picks nan); clamping keeps masked tokens at probability 0.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    scores = probs.div_(q)
    ids = scores.argmax(dim=-1)
    best = scores.gather(1, ids[:, None]).squeeze(1)
    # No mass (all zero) or broken numbers (NaN, inf) leave no valid token.
    return torch.where(torch.isfinite(best) & (best > 0), ids, NO_TOKEN)


def _inverse_cdf(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One uniform draw per row, located in the row's cumulative distribution."""
    u = _noise(batch, (probs.shape[0], 1), probs.device)
    cdf = probs.cumsum_(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the first entry above it is a token of non-zero mass.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    total = total.squeeze(1)
    ok = torch.isfinite(total) & (total > 0) & (ids < probs.shape[1])
    return torch.where(ok, ids, NO_TOKEN)
