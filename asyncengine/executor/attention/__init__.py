"""Attention backends. ``get_attention_backend(name, device, shape)`` returns an instance.

``torch_paged`` (PyTorch SDPA over gathered blocks) runs everywhere and is the reference.
``flashinfer`` (``flashinfer.py``) runs FlashInfer's paged prefill/decode kernels on CUDA, in
bfloat16 or float16 (FlashInfer has no float32 kernels), and supports CUDA graphs for decode.
``auto`` picks flashinfer on CUDA when the package imports, the dtype is bfloat16/float16 and
the head dim is one FlashInfer's kernels are built for (64, 128, 256); otherwise torch_paged,
with ONE warning that names the reason (never a silent fallback).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from asyncengine.executor.attention.base import AttentionBackend, AttentionMetadata

BACKENDS = ("auto", "torch_paged", "flashinfer")
FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)
#: The head dims FlashInfer 0.7's prefill/decode kernels are instantiated for.
FLASHINFER_HEAD_DIMS = (64, 128, 256)

logger = logging.getLogger("asyncengine")


@dataclass
class AttentionShape:
    """What a backend that plans ahead needs to know of the model and the cache."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    max_pages_per_seq: int


def flashinfer_missing(device: str, importable: bool | str) -> str | None:
    """Why no FlashInfer kernel can run here (not CUDA, the package unusable), or None.
    ``importable``: True, False (not installed) or the import's error message."""
    if device != "cuda":
        return f"FlashInfer runs on CUDA only (the device is {device})"
    if importable is not True:
        detail = "not installed" if importable is False else f"import failed: {importable}"
        return (f"the flashinfer package is unusable ({detail}; pip install "
                "'asyncengine[cuda]', i.e. flashinfer-python)")
    return None


def flashinfer_unusable(device: str, dtype: torch.dtype | None, head_dim: int | None,
                        importable: bool | str) -> str | None:
    """Why FlashInfer cannot run this model here, or None. ``importable``: True, False (not
    installed) or the import's error message."""
    missing = flashinfer_missing(device, importable)
    if missing is not None:
        return missing
    if dtype is not None and dtype not in FLASHINFER_DTYPES:
        return f"FlashInfer has no {dtype} kernels (use --dtype bfloat16 or float16)"
    if head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        dims = "/".join(map(str, FLASHINFER_HEAD_DIMS))
        return f"FlashInfer's kernels support head_dim {dims}, the model's is {head_dim}"
    return None


def resolve_backend_name(name: str, device: str, dtype: torch.dtype | None,
                         flashinfer_importable: bool | str, head_dim: int | None = None) -> str:
    """The backend ``--attention-backend name`` means on ``device`` with ``dtype`` and
    ``head_dim``; a ``ValueError`` naming the flag when it cannot run there. ``auto`` on CUDA
    that cannot use FlashInfer logs one warning naming the reason."""
    if name not in BACKENDS:
        raise ValueError(f"--attention-backend: unknown backend {name!r} (allowed: "
                         f"{', '.join(BACKENDS)})")
    if name == "torch_paged":
        return name
    reason = flashinfer_unusable(device, dtype, head_dim, flashinfer_importable)
    if name == "auto":
        if reason is None:
            return "flashinfer"
        if device == "cuda":
            logger.warning("attention backend torch_paged, not flashinfer: %s", reason)
        return "torch_paged"
    if reason is not None:
        raise ValueError(f"--attention-backend flashinfer: {reason}; use torch_paged or auto")
    return name


def get_attention_backend(name: str = "auto", device: str = "cpu",
                          shape: AttentionShape | None = None) -> AttentionBackend:
    from asyncengine.executor.attention.flashinfer import flashinfer_import_error

    dtype = shape.dtype if shape is not None else None
    head_dim = shape.head_dim if shape is not None else None
    importable: bool | str = False
    if device == "cuda" and name != "torch_paged":
        importable = flashinfer_import_error() or True
    chosen = resolve_backend_name(name, device, dtype, importable, head_dim)
    if chosen == "flashinfer":
        from asyncengine.executor.attention.flashinfer import FlashInferBackend

        if shape is None:
            raise ValueError("--attention-backend flashinfer: the model's shape is needed")
        return FlashInferBackend(shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                 shape.block_size, shape.dtype, device,
                                 max_pages_per_seq=shape.max_pages_per_seq)
    from asyncengine.executor.attention.torch_paged import TorchPagedBackend

    return TorchPagedBackend()


__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionShape", "BACKENDS",
           "FLASHINFER_HEAD_DIMS", "flashinfer_unusable", "get_attention_backend",
           "resolve_backend_name"]
