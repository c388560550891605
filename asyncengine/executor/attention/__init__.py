"""Attention backends. ``get_attention_backend(name, device, shape)`` returns an instance.

``torch_paged`` (PyTorch SDPA over gathered blocks) runs everywhere and is the reference.
``flashinfer`` (``flashinfer.py``) runs FlashInfer's paged prefill/decode kernels on CUDA, in
bfloat16 or float16 (FlashInfer has no float32 kernels), and supports CUDA graphs for decode.
``auto`` picks flashinfer on CUDA when the package is importable and the dtype allows it,
torch_paged otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncengine.executor.attention.base import AttentionBackend, AttentionMetadata

BACKENDS = ("auto", "torch_paged", "flashinfer")
FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class AttentionShape:
    """What a backend that plans ahead needs to know of the model and the cache."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    max_pages_per_seq: int


def resolve_backend_name(name: str, device: str, dtype: torch.dtype | None,
                         flashinfer_importable: bool) -> str:
    """The backend ``--attention-backend name`` means on ``device`` with ``dtype``; a
    ``ValueError`` naming the flag when it cannot run there."""
    if name not in BACKENDS:
        raise ValueError(f"--attention-backend: unknown backend {name!r} (allowed: "
                         f"{', '.join(BACKENDS)})")
    if name == "auto":
        usable = device == "cuda" and flashinfer_importable and dtype in FLASHINFER_DTYPES
        return "flashinfer" if usable else "torch_paged"
    if name == "flashinfer":
        if device != "cuda":
            raise ValueError(f"--attention-backend flashinfer: FlashInfer runs on CUDA only "
                             f"(the device is {device}); use torch_paged or auto")
        if not flashinfer_importable:
            raise ValueError("--attention-backend flashinfer: the flashinfer package is not "
                             "installed (pip install 'asyncengine[cuda]', i.e. "
                             "flashinfer-python); use torch_paged or auto")
        if dtype not in FLASHINFER_DTYPES:
            raise ValueError(f"--attention-backend flashinfer: FlashInfer has no {dtype} "
                             "kernels; use --dtype bfloat16 or float16, or --attention-backend "
                             "torch_paged")
    return name


def get_attention_backend(name: str = "auto", device: str = "cpu",
                          shape: AttentionShape | None = None) -> AttentionBackend:
    from asyncengine.executor.attention.flashinfer import flashinfer_importable

    dtype = shape.dtype if shape is not None else None
    importable = device == "cuda" and name != "torch_paged" and flashinfer_importable()
    chosen = resolve_backend_name(name, device, dtype, importable)
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
           "get_attention_backend", "resolve_backend_name"]
