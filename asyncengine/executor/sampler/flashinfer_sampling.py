"""Sampling through FlashInfer's kernels (CUDA): top-k and top-p by rejection sampling, with no
sort of the vocabulary and no host synchronization.

A step's batch takes this path when the runner's sampling method is ``flashinfer`` (CUDA, and
the ``flashinfer`` package importable) and :func:`unsupported_reason` finds nothing FlashInfer
cannot express the way the torch sampler does; otherwise the torch path (``sampler.py``,
exponential race) samples it. Logit bias, min_tokens masks, penalties and temperature are
applied to the logits first, exactly as for the torch path; greedy rows keep their argmax.

What routes a batch to the torch path:

* seeded rows: a seeded request must draw the same tokens alone and in any batch, from
  counter-based noise (``noise.py``). FlashInfer draws from its own Philox stream, so a seeded
  row would sample differently depending on which path its batch took;
* ``min_p``: FlashInfer's min-p kernel samples from probabilities without top-k/top-p, so a
  row with all three has no single kernel;
* an all-greedy batch needs no sampling at all (argmax).

Semantics that match: top-k keeps the k largest logits; top-p keeps the smallest set of most
likely tokens whose mass reaches p (``top_k_first``: top-p over the top-k renormalized), as
the torch path and vLLM do. A row with no valid probability mass (NaN, +inf, everything
masked) gets ``NO_TOKEN``, decided from the row's maximum as the torch path decides it; such a
row is replaced by zeros before the kernel sees it. Not run on a GPU yet.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncengine.executor.sampler.batch import SamplingBatch

NO_TOKEN = -1


def unsupported_reason(batch: SamplingBatch) -> str | None:
    """Why FlashInfer's kernels cannot sample ``batch`` as the torch path would, or None."""
    if batch.all_greedy:
        return "every row is greedy"
    if batch.seeded_rows is not None:
        return "seeded rows draw counter-based noise (torch path)"
    if batch.min_p is not None:
        return "min_p has no fused top-k/top-p kernel"
    return None


def flashinfer_available() -> bool:
    try:
        import flashinfer.sampling  # noqa: F401
    except ImportError:
        return False
    return True


def sample_with_flashinfer(x: torch.Tensor, batch: SamplingBatch,
                           module: Any = None) -> torch.Tensor:
    """Token ids ``[N]`` (int64) sampled from the processed, temperature-scaled float32
    logits ``x`` (modified in place); ``NO_TOKEN`` for rows with no valid mass."""
    if module is None:
        import flashinfer.sampling as module
    n, vocab = x.shape
    ok = torch.isfinite(x.amax(dim=-1))
    x.masked_fill_(~ok[:, None], 0.0)  # a broken row must not reach the kernel
    if batch.top_k is None and batch.top_p is None:
        ids = module.sampling_from_logits(x, deterministic=True)
    else:
        if batch.top_k is None:
            top_k: torch.Tensor | int = vocab
        else:
            top_k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=vocab), vocab)
            top_k = top_k.to(torch.int32)
        if batch.top_p is None:
            top_p: torch.Tensor | float = 1.0
        else:
            top_p = batch.top_p.view(-1).clamp(max=1.0)  # inf: disabled
        ids = module.top_k_top_p_sampling_from_logits(x, top_k, top_p,
                                                      filter_apply_order="top_k_first",
                                                      deterministic=True)
    return torch.where(ok, ids.long(), NO_TOKEN)
