"""Logit processing before sampling: logit bias, min_tokens masks, penalties, top-k, top-p."""

from __future__ import annotations

import torch

from asyncengine.executor.kernels.where import on_host
from asyncengine.executor.sampler.batch import Penalties, SamplingBatch

# Candidates searched for the top-p nucleus on the CPU before falling back to a full sort.
_TOP_P_CANDIDATES = 1024


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
        x[pen.rows] = _penalize(x[pen.rows], pen)
    return x


def _penalize(sub: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """vLLM's order: repetition (prompt and output tokens), then frequency and presence
    (output tokens) on the rows ``sub`` [P, V]."""
    counts = pen.counts
    if counts is None and pen.output_index is not None:
        counts = torch.zeros_like(sub)
        ones = torch.ones(pen.output_index[0].numel(), dtype=sub.dtype, device=sub.device)
        counts.index_put_(pen.output_index, ones, accumulate=True)
    if pen.repetition is not None:
        seen = counts > 0 if counts is not None else torch.zeros_like(sub, dtype=torch.bool)
        if pen.prompt_mask is not None:
            seen |= pen.prompt_mask
        elif pen.prompt_index is not None:
            seen[pen.prompt_index] = True
        rep = pen.repetition.expand_as(sub)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if counts is not None:
        if pen.frequency is not None:
            sub = sub - pen.frequency * counts.to(sub.dtype)
        if pen.presence is not None:
            sub = sub - pen.presence * (counts > 0).to(sub.dtype)
    return sub


def apply_top_k(x: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Mask (in place, to -inf) what lies below each row's k-th largest logit."""
    width = min(max_top_k, x.shape[-1])
    k = top_k.clamp(min=1, max=width).unsqueeze(1)
    kth = x.topk(width, dim=-1).values.gather(1, k - 1)
    kth.masked_fill_((top_k <= 0).unsqueeze(1), float("-inf"))
    x.masked_fill_(x < kth, float("-inf"))


def apply_top_p(x: torch.Tensor, batch: SamplingBatch) -> None:
    """Mask (in place) the tokens outside each row's nucleus: the most likely tokens whose
    preceding mass is at most ``top_p`` (after top-k). The most likely token always stays.

    Sorting the whole vocabulary is slow on the CPU, so there the nucleus is first looked for
    among the top candidates and the full sort is the fallback."""
    vocab = x.shape[-1]
    width = vocab
    if on_host(x):
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
