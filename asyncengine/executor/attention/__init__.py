"""Attention backends. ``get_attention_backend(name)`` returns an instance.

``torch_paged`` (PyTorch SDPA over gathered blocks) runs everywhere and is the reference.
A FlashInfer backend for CUDA is planned behind the same interface; until it lands, CUDA also
uses ``torch_paged``.
"""

from __future__ import annotations

from asyncengine.executor.attention.base import AttentionBackend, AttentionMetadata

BACKENDS = ("auto", "torch_paged")


def get_attention_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    if name in ("auto", "torch_paged"):
        from asyncengine.executor.attention.torch_paged import TorchPagedBackend

        return TorchPagedBackend()
    raise ValueError(f"--attention-backend: unknown backend {name!r} (allowed: "
                     f"{', '.join(BACKENDS)})")


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "get_attention_backend"]
