"""Compiling an attention backend's kernels at start-up (FlashInfer's JIT), before the engine
serves, with the fallback a failure takes. The engine (``build.py``) and the tensor-parallel
workers (``parallel/worker.py``) both call it."""

from __future__ import annotations

import logging
from typing import Any

import torch

from asyncengine.config import EngineConfig

logger = logging.getLogger("asyncengine")


def prewarm_attention(config: EngineConfig, backend: Any, model: torch.nn.Module, *,
                      graphs: bool | None = None) -> Any:
    """Compile the backend's kernels (FlashInfer's JIT) at start-up. A failure under ``auto``
    falls back to torch_paged with one warning naming it; under ``--attention-backend
    flashinfer`` it is a ValueError naming the flag."""
    prewarm = getattr(backend, "prewarm", None)
    if prewarm is None:
        return backend
    try:
        if graphs is None:
            graphs = not config.model.enforce_eager
        seconds = prewarm(graphs=graphs)
    except Exception as e:
        reason = f"FlashInfer's kernels failed to compile or run ({one_line(e)})"
        if config.device.attention_backend == "flashinfer":
            raise ValueError(f"--attention-backend flashinfer: {reason}; use torch_paged or "
                             "auto") from e
        logger.warning("attention backend torch_paged, not flashinfer: %s", reason)
        from asyncengine.executor.attention.torch_paged import TorchPagedBackend

        backend = TorchPagedBackend()
        if hasattr(model, "attention_options"):
            backend.configure_layers(model.attention_options())
        return backend
    logger.info("%s attention kernels compiled and loaded in %.1f s", backend.name, seconds)
    return backend


def one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:300] if text else type(e).__name__


