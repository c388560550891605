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
row is replaced by zeros before the kernel sees it.

Kernels by what the batch asks: no top-k/top-p at all, ``sampling_from_logits``; top-p alone,
``top_p_sampling_from_probs`` on the softmax (never ``top_k = vocab``, which would make the
top-k kernel search the whole vocabulary every step for nothing); top-k alone,
``top_k_sampling_from_probs``; both, ``top_k_top_p_sampling_from_logits`` (top-k first).
All of them live in FlashInfer's one ``sampling`` JIT module, which :func:`prewarm` compiles at
start-up. Not run on a GPU yet.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncengine.executor.kernels.where import on_host
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


def flashinfer_import_error() -> str | None:
    """Why ``flashinfer.sampling`` cannot be imported here (one line), or None."""
    try:
        import flashinfer.sampling  # noqa: F401
    except Exception as e:  # a broken install raises more than ImportError
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def flashinfer_available() -> bool:
    return flashinfer_import_error() is None


def prewarm(device: torch.device | str, vocab_size: int, module: Any = None) -> None:
    """Compile and load FlashInfer's sampling kernels (every entry point :func:`sample_with_
    flashinfer` calls) at start-up, on a tiny batch; raises what the JIT raises."""
    if module is None:
        import flashinfer.sampling as module
    x = torch.zeros(2, vocab_size, dtype=torch.float32, device=device)
    top_k = torch.tensor([1, vocab_size], dtype=torch.int32, device=device)
    top_p = torch.tensor([0.5, 1.0], dtype=torch.float32, device=device)
    module.sampling_from_logits(x, deterministic=True)
    probs = torch.softmax(x, dim=-1)
    module.top_p_sampling_from_probs(probs, top_p, deterministic=True)
    module.top_k_sampling_from_probs(probs, top_k, deterministic=True)
    module.top_k_top_p_sampling_from_logits(x, top_k, top_p, filter_apply_order="top_k_first",
                                            deterministic=True)
    if not on_host(device):
        torch.cuda.synchronize(device)


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
    elif batch.top_k is None:  # top-p alone: no top-k pass over the vocabulary
        top_p = batch.top_p.view(-1).clamp(max=1.0)  # inf: disabled
        ids = module.top_p_sampling_from_probs(torch.softmax(x, dim=-1), top_p,
                                               deterministic=True)
    else:
        top_k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=vocab), vocab)
        top_k = top_k.to(torch.int32)
        if batch.top_p is None:
            ids = module.top_k_sampling_from_probs(torch.softmax(x, dim=-1), top_k,
                                                   deterministic=True)
        else:
            top_p = batch.top_p.view(-1).clamp(max=1.0)
            ids = module.top_k_top_p_sampling_from_logits(x, top_k, top_p,
                                                          filter_apply_order="top_k_first",
                                                          deterministic=True)
    return torch.where(ok, ids.long(), NO_TOKEN)
